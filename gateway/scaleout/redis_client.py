"""Redis clients for the scale-out path: short timeouts, no hidden retries.

Replicas and the router both treat Redis as optional: a call that fails marks Redis down and
the caller carries on without it. redis-py's default retries with backoff would turn a dead
Redis into seconds of waiting per call, so there is one immediate retry at most; our own loops
retry on their pace.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

# Everything a Redis call may raise when Redis is down, slow or restarting.
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)


def connect(url: str, *, timeout_s: float = 1.0) -> aioredis.Redis:
    """A client for ``url`` (``redis://host:port/db``); connects lazily on the first command.

    Raises:
        ValueError: the URL is not a redis:// / rediss:// / unix:// URL.
    """
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"--redis-url must start with redis://, rediss:// or unix://, got {url!r}")
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        # One immediate retry on a connection error only: a pooled connection goes stale
        # when Redis restarts; a timeout is not retried (it would double the wait).
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        retry_on_timeout=False,
        decode_responses=False,
    )


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
