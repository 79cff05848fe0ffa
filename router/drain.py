"""Stopping without dropping requests silently: on SIGTERM / SIGINT the router stops accepting
connections, lets the requests in flight finish for up to `drain_timeout_s`, then ends each one
still open with a 503 (`shutting_down`; an error event and `[DONE]` on a stream that has
started) before it exits, so no client is left with a connection that just closes."""

from __future__ import annotations

import asyncio
from typing import Any

SHUTTING_DOWN = "the router is shutting down"
"""The message of a request ended by the drain's deadline."""

GRACE_S = 2.0
"""How long a request ended at the deadline has to write its answer before the router exits."""
_POLL_S = 0.05


class Drain:
    """The request handlers in flight, so that a stopping router can wait for them and then
    end the ones left."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def enter(self) -> asyncio.Task[Any] | None:
        """Count the request the current task is handling (until `leave`)."""
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
        return task

    def leave(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._running.discard(task)

    def was_cut(self) -> bool:
        """In an `except CancelledError`: whether `run_out` ended this request (the caller then
        answers 503 rather than propagating); the cancellation is withdrawn."""
        task = asyncio.current_task()
        if task is None or task not in self._cut:
            return False
        self._cut.discard(task)
        task.uncancel()
        return True

    async def run_out(self, timeout_s: float) -> tuple[int, int]:
        """Wait up to `timeout_s` for the requests in flight to end, then cancel those left and
        give them `GRACE_S` to write their answer. Returns (in flight at the start, cut)."""
        started = len(self._running)
        await self._settle(timeout_s)
        left = list(self._running)
        self._cut.update(left)
        for task in left:
            task.cancel()
        await self._settle(GRACE_S)
        return started, len(left)

    async def _settle(self, timeout_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._running and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(_POLL_S)
