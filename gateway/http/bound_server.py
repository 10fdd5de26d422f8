"""A uvicorn server that knows the address it bound, and the event loop every server of ours
runs on (the replica's and the router's alike)."""

from __future__ import annotations

import uvicorn

# NOTE: uvicorn's default ("auto") picks uvloop whenever it is importable, and ray[serve]
# (the dev extras, #40.2) installs it. The suite was validated on asyncio's loop (the stream
# pacing, the engine's wakeups, the slow-client timers), so the servers pin it: installing a
# package must never silently change the event loop (docs/fleet.md, "The event loop").
EVENT_LOOP = "asyncio"


class BoundServer(uvicorn.Server):
    """A uvicorn server that knows the address it actually bound (port 0 = any free port)."""

    @property
    def bound_port(self) -> int:
        """The port actually bound (differs from the configured one when that was 0)."""
        for server in self.servers:
            for sock in server.sockets:
                return sock.getsockname()[1]
        raise RuntimeError("the server has not bound a socket yet")

    @property
    def base_url(self) -> str:
        host = self.config.host
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.bound_port}"
