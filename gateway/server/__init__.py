"""The OpenAI-compatible HTTP gateway in front of one engine (FastAPI + uvicorn)."""

from prefixgate.gateway.server.app import create_app
from prefixgate.gateway.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
