"""The live-gateway fixtures live in tests/live_gateway.py (a root plugin, shared with agents/
and scale-out tests); the names below are re-exported for the gateway tests' imports."""

from tests.live_gateway import (  # noqa: F401
    ADMIN_KEY,
    API_KEYS,
    KEY_ALPHA,
    KEY_BETA,
    KEY_PLAIN,
    NUM_PAGES,
    PAGE_SIZE,
    LiveGateway,
    shared_block_tokens,
    wait_idle,
)
