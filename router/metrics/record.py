"""`RequestRecord`: what the metrics keep of one request when it ends (filled in by
`router.accounting.RequestAccount`, read by the recorder and the stats)."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement import Decision


@dataclass(slots=True)
class RequestRecord:
    """One request as the metrics record it when it ends (`RequestAccount` fills it in)."""

    decision: Decision | None = None
    """The final placement (None: the request failed before one was made)."""
    status: int = 0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    """Exact, also after an early placement."""
    early: bool = False
    keyed: bool = True
    """False: placed by load alone, its prompt not keyed (a chat with images, audio or video)."""
    overhead_s: float | None = None
    """Receipt → placement done: the router's queue before the first upstream request."""
    cached: int | None = None
    """The answering engine's `usage.prompt_tokens_details.cached_tokens`."""
    prefill_cached: int | None = None
    """The prefill engine's cached tokens (hand-offs)."""
    prefill_s: float | None = None
    """Prefill request sent → answered (hand-offs)."""
    prefill_failure: str = ""
    decode_sent_s: float | None = None
    """When (since receipt) the request to the answering worker went out."""
    ttft_s: float | None = None
    """When (since receipt) the stream's first event arrived."""

    def prefill_leg(self, decision: Decision) -> tuple[Decision, int | None]:
        """The leg of `decision` that prefilled the prompt (a hand-off's prefill worker, else
        the answering worker) and the cached tokens its engine reported: a decode after a
        hand-off reports the prefill's hit."""
        if decision.prefill is not None:
            return decision.prefill, self.prefill_cached
        return decision, self.cached

    @property
    def decode_first_token_s(self) -> float | None:
        """Answer request sent → first event: KV transfer and first decode step (streams)."""
        if self.ttft_s is None or self.decode_sent_s is None:
            return None
        return self.ttft_s - self.decode_sent_s
