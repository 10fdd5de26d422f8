"""Old name of engine_core.py (#39 renames): re-exports it while callers move over."""

from prefixgate.gateway.engine.engine_core import LLMEngine

__all__ = ["LLMEngine"]
