"""The router's event-loop responsiveness: how late the loop runs a timer (a Prometheus
histogram), a warning when it ran a second or more late, and every thread's stack in the log
when it has not run one for `stall_s` (a blocking call on the loop delays every request,
stream and health probe at once, and the stacks say which call)."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import sys
import threading
import time

from prometheus_client import Histogram

from router.tasks import cancel

_log = logging.getLogger(__name__)
_TICK_S = 0.25
_WARN_S = 1.0


class LoopWatch:
    """A timer on the loop every `_TICK_S`, and (unless `stall_s` is None) a watchdog thread
    that dumps the stacks once per stall. The watchdog is a plain thread rather than
    `faulthandler.dump_traceback_later`: re-arming that costs ~0.4 ms of the loop each time (it
    joins and starts a thread); a watchdog thread costs a wake-up every `stall_s / 4` (at most 1 s).
    It needs the GIL to run, so a C call that holds the GIL is seen when it returns."""

    def __init__(self, lag: Histogram, stall_s: float | None) -> None:
        self._lag = lag
        self._stall_s = stall_s
        self._beat = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def start(self) -> None:
        self._beat = time.monotonic()
        self._task = asyncio.create_task(self._run(), name="loop-watch")
        if self._stall_s is not None:
            self._stopped.clear()
            self._thread = threading.Thread(
                target=self._watchdog, args=(self._stall_s,), name="warply-loop-watchdog",
                daemon=True,
            )  # fmt: skip
            self._thread.start()

    async def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            await cancel([self._task])
            self._task = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    async def _run(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(_TICK_S)
            self._beat = now = time.monotonic()
            late = max(0.0, now - start - _TICK_S)
            self._lag.observe(late)
            if late >= _WARN_S:
                _log.warning("the event loop ran a timer %.1f s late", late)

    def _watchdog(self, stall_s: float) -> None:
        dumped_for = None
        while not self._stopped.wait(min(1.0, stall_s / 4)):
            beat = self._beat
            if time.monotonic() - beat < stall_s or dumped_for == beat:
                continue
            dumped_for = beat  # one dump per stall
            _log.error(
                "the event loop has not run for %.1f s; every thread's stack follows on stderr",
                time.monotonic() - beat,
            )
            out = sys.__stderr__  # a file descriptor even where sys.stderr was replaced
            if out is not None:
                faulthandler.dump_traceback(file=out, all_threads=True)
