"""The OpenAI-compatible HTTP gateway in front of one engine (FastAPI + uvicorn)."""

from gateway.server.app import create_app
from gateway.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
