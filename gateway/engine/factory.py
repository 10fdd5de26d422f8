"""Old name of build.py (#39 renames): re-exports it while callers move over."""

from prefixgate.gateway.engine.build import (
    available_ram_bytes,
    create_llm_engine,
    default_served_name,
)

__all__ = ["available_ram_bytes", "create_llm_engine", "default_served_name"]
