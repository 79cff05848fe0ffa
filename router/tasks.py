"""Background asyncio tasks: periodic rounds that outlive a failed round, and ending tasks
(stream readers, removals, loops) at shutdown or removal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

_log = logging.getLogger("warply.router")


def periodic(
    round_: Callable[[], Awaitable[None]], interval_s: float, name: str
) -> asyncio.Task[None]:
    """A task that runs `round_` every `interval_s` until cancelled. A round that raises is
    logged with its traceback and the next one runs on time: one odd answer from one engine
    must not end the router's health checks (or tier rounds) for good."""

    async def loop() -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await round_()
            except Exception:
                _log.exception("%s round failed; the next runs in %g s", name, interval_s)

    return asyncio.create_task(loop(), name=name)


async def cancel(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel the tasks and wait until each has ended."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
