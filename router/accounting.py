"""One client request's bookkeeping: the load it puts on its worker and what the metrics record.

The proxy opens a `RequestAccount` when a request arrives and reports to it only; the account
books load through `router.workers` (one `Booking` per attempt: a retry after a refused
connection books again on the next worker) and records through `RouterMetrics`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from router.metrics import RouterMetrics, Sample
from router.placement import Decision
from router.workers import Booking


class RequestAccount:
    """Load and measurements of one request, across its attempts."""

    __slots__ = ("_booking", "_measured", "_metrics", "_routed_s", "_sample", "decision", "t0")

    def __init__(self, metrics: RouterMetrics, t0: float) -> None:
        self._metrics = metrics
        self.t0 = t0
        """When the router received the request (TTFT, overhead and latency start here)."""
        self.decision: Decision | None = None
        self._measured: Decision | None = None
        """The decision as the metrics see it: with the exact prompt length."""
        self._sample: Sample | None = None
        self._booking: Booking | None = None
        self._routed_s = 0.0

    def placed(self, decision: Decision, exact: bool = True) -> None:
        """A worker was chosen: book the request's load on it, and record the placement now,
        or (`exact` False: placed from the prompt's leading part) once `measured` gives the
        prompt's exact length."""
        self.decision = self._measured = decision
        self._routed_s = time.perf_counter() - self.t0
        self._sample = self._metrics.routed(decision, self._routed_s) if exact else None
        self._booking = decision.worker.book(decision.prompt_tokens, decision.prefill_tokens)

    def measured(self, prompt_tokens: int) -> None:
        """The whole prompt's length, tokenized after an early placement."""
        assert self.decision is not None
        self._measured = dataclasses.replace(self.decision, prompt_tokens=prompt_tokens)
        self._sample = self._metrics.routed(self._measured, self._routed_s, early=True)

    def first_event(self) -> None:
        """The stream's first event reached the router."""
        self._metrics.first_token(time.perf_counter() - self.t0)

    def generated(self, tokens: int = 1) -> None:
        """The stream relayed `tokens` more generated tokens."""
        if self._booking is not None:
            self._booking.progressed(tokens)

    def usage(self, usage: Mapping[str, Any] | None) -> None:
        """The engine's usage block (its cached-token count)."""
        if usage is not None and self._sample is not None and self._measured is not None:
            self._metrics.usage(self._measured, self._sample, usage)

    def released(self) -> None:
        """The attempt ended (answered, failed or cancelled): give its load back."""
        if self._booking is not None:
            self._booking.release()
            self._booking = None

    def closed(self, status: int) -> None:
        """The request ended with HTTP `status`."""
        self._metrics.finished(self.decision, status, time.perf_counter() - self.t0)
