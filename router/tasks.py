"""Ending background asyncio tasks (stream readers, removals, loops) at shutdown or removal."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel the tasks and wait until each has ended."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
