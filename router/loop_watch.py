"""The router's event-loop responsiveness: how late the loop runs a timer (a Prometheus
histogram), a warning when it ran a second or more late, and every thread's stack in the log
when it has not run one for `stall_s` (a blocking call on the loop delays every request,
stream and health probe at once, and this says which call)."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import sys

from prometheus_client import Histogram

from router.tasks import cancel

_log = logging.getLogger(__name__)
_TICK_S = 0.25
_WARN_S = 1.0


class LoopWatch:
    """Ticks every `_TICK_S` on the loop; `stall_s` None: no stack dumps."""

    def __init__(self, lag: Histogram, stall_s: float | None) -> None:
        self._lag = lag
        self._stall_s = stall_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loop-watch")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel([self._task])
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        # faulthandler writes to a file descriptor: the process's own stderr, even where
        # sys.stderr was replaced by an object without one
        out = sys.__stderr__
        try:
            while True:
                if self._stall_s is not None and out is not None:
                    faulthandler.dump_traceback_later(self._stall_s, file=out)
                start = loop.time()
                await asyncio.sleep(_TICK_S)
                late = max(0.0, loop.time() - start - _TICK_S)
                self._lag.observe(late)
                if late >= _WARN_S:
                    _log.warning("the event loop ran a timer %.1f s late", late)
        finally:
            if self._stall_s is not None:
                faulthandler.cancel_dump_traceback_later()
