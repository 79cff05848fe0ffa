"""The `warply` KV-event publisher: SGLang's own event pump feeds the Warply state stream.

SGLang 0.5.23's scheduler drains `tree_cache.take_events()` into a `KVEventBatch` and calls
`publish()` on the publisher `--kv-events-config` names (from `on_idle`, `pause_generation` and
the metrics reporter, all on the scheduler thread). This publisher converts the batch to Warply
events, adds directive acks and load snapshots, and sends it with `StatePublisher`.
`scheduler.py` hooks give it the cache and a per-step call (`step`) to apply directives.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from sglang.srt.disaggregation.kv_events import EventPublisher, ZmqEventPublisher

from sglang_hook.applier import DirectiveApplier
from sglang_hook.events import PageBook, to_warply
from sglang_hook.settings import WarplySettings
from warply.protocol import Event, LoadSnapshot
from warply.protocol.control import ControlServer
from warply.protocol.publisher import StatePublisher

_log = logging.getLogger(__name__)
_LOG_FIRST = 5
_active: WarplyEventPublisher | None = None


def active() -> WarplyEventPublisher | None:
    """This process's Warply publisher, if the scheduler made one (used by the L3 backend)."""
    return _active


class WarplyEventPublisher(EventPublisher):  # type: ignore[misc]
    """Constructed by SGLang's `EventPublisherFactory` with the `--kv-events-config` fields."""

    settings: WarplySettings | None = None
    """Set by the scheduler hook before the factory runs (None: config given by hand)."""

    def __init__(
        self,
        attn_dp_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        bind: bool | None = None,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
    ) -> None:
        global _active
        settings = self.settings or WarplySettings(
            events_endpoint=endpoint, replay_endpoint=replay_endpoint
        )
        self.settings = settings
        worker = settings.worker or f"{socket.gethostname()}:{os.getpid()}"
        self.worker = worker if attn_dp_rank == 0 else f"{worker}/dp{attn_dp_rank}"
        self.page_book = PageBook()
        self._state = StatePublisher(
            endpoint,
            replay_endpoint=ZmqEventPublisher.offset_endpoint_port(replay_endpoint, attn_dp_rank),
            topic=topic,
            worker=self.worker,
            buffer_steps=buffer_steps,
            bind=bind,
        )
        self._control = (
            ControlServer(
                ZmqEventPublisher.offset_endpoint_port(settings.control_endpoint, attn_dp_rank),
                token=settings.control_token,
            )
            if settings.control_endpoint
            else None
        )
        self.skipped: Counter[str] = Counter()
        """Cache events not exported, by reason (`unknown_medium`); never raised."""
        self._pending: list[Event] = []
        self._l3: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._applier: DirectiveApplier | None = None
        self._load: Callable[[], LoadSnapshot] | None = None
        self._next_snapshot = 0.0
        _active = self

    def attach(self, tree_cache: Any, load: Callable[[], LoadSnapshot] | None = None) -> None:
        """Bind the radix cache directives act on, and the load probe for snapshots."""
        assert self.settings is not None
        self._applier = DirectiveApplier(
            tree_cache, max_pinned_fraction=self.settings.max_pinned_fraction
        )
        self._load = load

    def report(self, events: list[Event]) -> None:
        """Queue events from another thread (the L3 backend); they go out with the next step."""
        for ev in events:
            self._l3.put(ev)

    def step(self) -> None:
        """Scheduler thread, before the cache's events are taken: directives and a snapshot."""
        if self._applier is not None:
            self._applier.expire()
            if self._control is not None:
                self._pending.extend(self._control.apply_pending(self._applier.apply))
        now = time.monotonic()
        if self._load is not None and now >= self._next_snapshot:
            assert self.settings is not None
            self._next_snapshot = now + self.settings.snapshot_interval_s
            self._pending.append(self._load())

    def flush(self) -> None:
        """Scheduler thread, after the cache's events went out: send what is still queued."""
        self._send([])

    def publish(self, events: Any) -> None:
        """SGLang's pump: one `KVEventBatch` from `tree_cache.take_events()`."""
        before = self.skipped.total()
        converted = to_warply(events.events, self.skipped)
        if before < self.skipped.total() and before < _LOG_FIRST:
            _log.warning("Warply: skipped KV events not placed on a tier: %s", dict(self.skipped))
        self.page_book.record(converted)
        self._send(converted)

    def shutdown(self) -> None:
        global _active
        if self._applier is not None:
            self._applier.release_all()
        if self._control is not None:
            self._control.close()
        self._state.close()
        if _active is self:
            _active = None

    def _send(self, events: list[Event]) -> None:
        # Acks follow the cache events their directive caused (same batch, after them).
        out = events + self._pending
        self._pending = []
        while True:
            try:
                out.append(self._l3.get_nowait())
            except queue.Empty:
                break
        if out:
            self._state.publish(out)
