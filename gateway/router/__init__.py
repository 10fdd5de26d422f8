"""Scale-out, front side: a cache-aware router over prefixgate replicas (``prefixgate route``).

It hashes each prompt as the replicas do, asks the shared Redis index (gateway/scaleout) how
much of it every replica holds, and weighs that against load (see ``policy.py``).
"""

from prefixgate.gateway.router.app import create_router_app
from prefixgate.gateway.router.settings import RouterSettings

__all__ = ["RouterSettings", "create_router_app"]
