"""Stopping without dropping requests silently: on SIGTERM / SIGINT the router stops accepting
connections, lets the requests in flight finish for up to `drain_timeout_s`, then ends each one
still open with a 503 (`shutting_down`; an error event and `[DONE]` on a stream that has
started) before it exits, so no client is left with a connection that just closes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

SHUTTING_DOWN = "the router is shutting down"
"""The message of a request ended by the drain's deadline."""

GRACE_S = 2.0
"""How long a request ended at the deadline has to write its answer before the router exits."""
_POLL_S = 0.05


@dataclass(slots=True, eq=False)
class InFlight:
    """One request being handled."""

    task: asyncio.Task[Any]
    """The task of its handler."""
    stream: asyncio.Task[Any] | None = None
    """The task relaying its stream once the client's response has started (the handler's, or
    a hand-off's decode leg): the one to end, so that it writes the stream's last event."""
    cut: bool = False
    """The drain's deadline ended it: its task's cancellation means "answer 503"."""

    def streaming(self) -> None:
        """The current task is starting this request's stream."""
        self.stream = asyncio.current_task()


class Drain:
    """The requests in flight, so that a stopping router can wait for them and then end the
    ones left."""

    def __init__(self) -> None:
        self._running: set[InFlight] = set()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def enter(self) -> InFlight:
        """The request the current task is handling, counted until `leave`."""
        task = asyncio.current_task()
        assert task is not None, "called outside a task"
        request = InFlight(task)
        self._running.add(request)
        return request

    def leave(self, request: InFlight) -> None:
        self._running.discard(request)

    async def run_out(self, timeout_s: float) -> tuple[int, int]:
        """Wait up to `timeout_s` for the requests in flight to end, then cancel those left
        (their stream's task once it started, else their handler's), give them `GRACE_S` to
        write their answer. Returns (in flight at the start, cut)."""
        started = len(self._running)
        await self._settle(timeout_s)
        left = list(self._running)
        for request in left:
            request.cut = True
            (request.stream or request.task).cancel()
        await self._settle(GRACE_S)
        return started, len(left)

    async def _settle(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._running and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)


def withdraw_cancel() -> None:
    """In an `except CancelledError` that answers the client instead of propagating: the
    current task's cancellation is withdrawn (it was the drain's, now handled)."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
