"""One client request's bookkeeping: the load it puts on its workers and what the metrics record.

The proxy and the dispatcher open a `RequestAccount` when a request arrives and report to it
only; the account books load through `router.workers` (one `Booking` per worker per attempt: a
retry after a refused connection books again on the next worker; a hand-off books its prefill
worker until the prefill answers) and hands one `RequestRecord` to `RouterMetrics` when the
request ends.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from router.metrics import RequestRecord, RouterMetrics
from router.placement import Decision, LocalReason
from router.workers import Booking


def cached_tokens(usage: Mapping[str, Any] | None) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` (the Responses API's
    `usage.input_tokens_details.cached_tokens`), when the engine reported a count it can have:
    an integer from 0 to the usage's `prompt_tokens` (`input_tokens`). Anything else (a broken
    or foreign upstream) is not counted: it failed the served request with a 500 (a negative
    count) or put the hit rate in the billions."""
    if not isinstance(usage, Mapping):
        return None
    side = "prompt" if "prompt_tokens" in usage else "input"
    details = usage.get(f"{side}_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    prompt = usage.get(f"{side}_tokens")
    if type(cached) is not int or type(prompt) is not int or not 0 <= cached <= prompt:
        return None
    return cached


class RequestAccount:
    """Load and measurements of one request, across its attempts."""

    __slots__ = ("_answer", "_delivered", "_metrics", "_prefill", "_record", "decision", "t0")

    def __init__(self, metrics: RouterMetrics, t0: float) -> None:
        self._metrics = metrics
        self.t0 = t0
        """When the router received the request (TTFT, overhead and latency start here)."""
        self.decision: Decision | None = None
        """The latest placement (a fallback to a local prefill replaces it)."""
        self._record = RequestRecord()
        self._answer: Booking | None = None
        self._prefill: Booking | None = None
        self._delivered = False

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def placed(self, decision: Decision, exact: bool = True, keyed: bool = True) -> None:
        """Workers were chosen: book the request's load on them (`exact` False: placed from
        the prompt's leading part, `measured` gives the prompt's exact length later; `keyed`
        False: placed by load alone, the prompt holding media the router cannot key)."""
        self.released()
        self.decision = decision
        rec = self._record
        rec.overhead_s = self._now()
        rec.early = not exact
        rec.keyed = keyed
        rec.prompt_tokens = decision.prompt_tokens
        rec.prefill_cached = rec.prefill_s = rec.decode_sent_s = None
        self._answer = decision.worker.book(decision.prompt_tokens, decision.prefill_tokens)
        if (leg := decision.prefill) is not None:
            self._prefill = leg.worker.book(leg.prompt_tokens, leg.prefill_tokens)

    def measured(self, prompt_tokens: int) -> None:
        """The whole prompt's length, tokenized after an early placement."""
        self._record.prompt_tokens = prompt_tokens

    def prefill_answered(self, usage: Mapping[str, Any] | None, started_s: float) -> None:
        """The prefill worker answered (its KV waits for the decode worker)."""
        rec = self._record
        rec.prefill_cached = cached_tokens(usage)
        rec.prefill_s = self._now() - started_s
        self._release_prefill()

    def prefill_failed(self, reason: str) -> None:
        """The prefill leg failed (recorded also when a later attempt succeeds): its worker's
        booking ends; the caller prefills locally (`relocate`) or places the request again."""
        self._record.prefill_failure = reason
        self._release_prefill()

    def relocate(self, reason: LocalReason) -> None:
        """The decode worker prefills locally after all: book its prefill work there."""
        assert self.decision is not None
        decision = self.decision = self.decision.local(reason)
        if self._answer is not None:
            self._answer.release()
        self._answer = decision.worker.book(decision.prompt_tokens, decision.prefill_tokens)

    def elapsed(self) -> float:
        """Seconds since the request arrived."""
        return self._now()

    def answer_sent(self) -> None:
        """The request to the answering worker (aggregated or decode) is being sent."""
        self._record.decode_sent_s = self._now()

    def first_event(self) -> None:
        """The stream's first output reached the router (later calls change nothing)."""
        rec = self._record
        if rec.ttft_s is not None:
            return
        rec.ttft_s = self._now()
        self._metrics.first_token(rec.ttft_s)

    def generated(self, tokens: int = 1) -> None:
        """The stream relayed `tokens` more generated tokens."""
        if self._answer is not None:
            self._answer.progressed(tokens)

    def usage(self, usage: Mapping[str, Any] | None) -> None:
        """The answering engine's usage block (its cached-token count)."""
        self._record.cached = cached_tokens(usage)

    def delivered(self) -> None:
        """The stream's last event (`data: [DONE]`) was sent: the client has the whole answer,
        so a hang-up before the stream's end is not a client abort."""
        self._delivered = True

    def _release_prefill(self) -> None:
        if self._prefill is not None:
            self._prefill.release()
            self._prefill = None

    def overpredicted(self) -> tuple[str, int] | None:
        """(worker, blocks) when the index credited the worker that prefilled the prompt
        (`RequestRecord.prefill_leg`) with more blocks than its engine then reported cached: the
        blocks from the engine's hit to the index's own prediction (before index health's
        caution cut it).

        The index keeps those blocks: the engine computed them for this very request and
        cached them again under the same hashes (vLLM 0.32's `cache_full_blocks` publishes
        BlockStored for them, after the eviction's BlockRemoved), so the engine's own events
        keep the index true, and dropping them here would lose blocks the engine holds."""
        if self.decision is None:
            return None
        leg, cached = self._record.prefill_leg(self.decision)
        if cached is None or cached >= leg.index_cached:
            return None
        bs = leg.worker.pool.block_size
        blocks = leg.index_cached // bs - cached // bs
        return (leg.worker.name, blocks) if blocks else None

    def released(self) -> None:
        """The attempt ended (answered, failed or cancelled): give its load back."""
        self._release_prefill()
        if self._answer is not None:
            self._answer.release()
            self._answer = None

    def closed(self, status: int) -> None:
        """The request ended with HTTP `status` (499, the client gone, counts as 200 once the
        whole answer was delivered): record it."""
        self.released()
        if status == 499 and self._delivered:
            status = 200
        rec = self._record
        rec.status, rec.latency_s, rec.decision = status, self._now(), self.decision
        self._metrics.request(rec)

