"""Stopping background loops (the index publisher, the router's health and heartbeat loops)
even when a library swallows their cancellation.

``task.cancel(); await task`` waits forever if the task catches the ``CancelledError``: a client
library that turns a cancellation arriving during its own timeout into a ``TimeoutError``, or
a loop whose ``except`` for network errors catches what the library raised instead. The loop
then sleeps and carries on, and whoever awaits it hangs (a replica that never shuts down; a
test that ran into its 600 s limit). The loops here therefore also check a stop flag, re-raise
when their task is being cancelled, and are awaited with a bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

RECANCEL_EVERY_S = 0.1


def cancel_requested() -> bool:
    """Whether the running task has a cancellation pending: a loop's ``except`` for network
    errors re-raises then instead of retrying (the error may be a cancellation in disguise)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def cancel_and_wait(tasks: Iterable[asyncio.Task | None], grace_s: float = 5.0) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again every
    ``RECANCEL_EVERY_S`` (a swallowed cancellation is not the last word); after ``grace_s`` the
    ones still running are left behind with an error logged, so that a stop always returns.
    A task that ended with an exception other than its cancellation has it logged."""
    pending = {task for task in tasks if task is not None and not task.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            logger.error("background tasks still running %.1f s after their cancellation, left "
                         "behind: %s", grace_s, sorted(task.get_name() for task in pending))
            return
        done, pending = await asyncio.wait(pending, timeout=min(RECANCEL_EVERY_S, left))
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                logger.error("background task %s ended with %r", task.get_name(),
                             task.exception())


__all__ = ["cancel_and_wait", "cancel_requested"]
