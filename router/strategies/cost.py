"""`cost_aware`: trade what a worker costs against cache affinity and the prefill queued on it,
under a TTFT guard, within a pool and across priced pools (notation in `router.strategies.base`).

For a request of L prompt tokens, per candidate w (bs = block size):

    miss(w) = max(0, L − bs · credit(w))           prompt tokens w would compute
    wait(w) = (bs · queued(w) + miss(w)) / R(w)      estimated time to w's first token, s
    cost(w) = price(w) · miss(w) / R(w)  +  latency_weight · p̄ · wait(w)

p̄ is the candidates' mean price (1 when none is priced), so `latency_weight` has no unit: one
second of estimated TTFT weighs as much as `latency_weight` seconds of an average worker's
time. Candidates whose wait(w) exceeds `ttft_target_ms` are dropped unless every one does
(then the lowest wait(w) wins). The lowest cost wins; ties → lower load, then in turn.

A cheap pool takes requests while its queue stays short enough; as its queue grows, the wait
term (and past the target, the guard) sends requests to dearer, idle workers. With
`latency_weight` 0 and no target the cheapest worker that holds the prefix takes everything.
R(w) is the pool's `prefill_tokens_per_s` (required by this strategy: config validation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from pydantic import Field

from router.index import WorkerMatch
from router.strategies.base import (
    NO_MATCH,
    Knobs,
    Pick,
    Ranked,
    RequestView,
    Score,
    TierWeights,
    WorkerLoad,
)

_T = TypeVar("_T")


class CostAwareKnobs(Knobs):
    tier_weights: TierWeights = TierWeights()
    latency_weight: float = Field(1.0, ge=0)
    """Seconds of an average worker's time one second of estimated TTFT is worth."""
    ttft_target_ms: float | None = Field(None, gt=0)
    """TTFT guard: workers estimated to miss it are not chosen while another meets it."""


class CostAware(Ranked):
    """Lowest price · compute + latency_weight · p̄ · wait, under a TTFT guard (module doc)."""

    name = "cost_aware"
    Knobs = CostAwareKnobs

    def explain(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> dict[str, Score]:
        """Keys are `_terms`: a candidate that misses the TTFT target sorts after every one that
        meets it (the guard), and only its wait counts among those that all miss it."""
        mean = _mean_price(candidates)
        scores = {}
        for w in candidates:
            key = self._terms(request, w, matches.get(w.name, NO_MATCH), mean)
            rule = "misses ttft_target_ms: lowest wait" if key[0] else "lowest cost"
            scores[w.name] = Score(key, rule, {"late_wait_s": key[0], "cost": key[1]})
        return scores

    def prefer(self, picks: Sequence[Pick]) -> Pick:
        mean = _mean_price([p.load for p in picks])
        terms = [self._terms(p.request, p.load, p.match, mean) for p in picks]
        kept = _guarded(list(zip(picks, terms, strict=True)), terms)
        return min(kept, key=lambda pt: pt[1])[0]

    def _terms(
        self, request: RequestView, w: WorkerLoad, match: WorkerMatch, mean_price: float
    ) -> tuple[float, float, int]:
        """(wait(w) when it misses the target else 0, cost(w), load(w)): the sort key."""
        k: CostAwareKnobs = self.knobs  # type: ignore[assignment]
        credit = k.tier_weights.credit(match) if request.prefix_reuse else 0.0
        rate = w.prefill_tokens_per_s
        if rate <= 0:
            raise ValueError(f"worker {w.name}: cost_aware needs its pool's prefill_tokens_per_s")
        miss = max(0.0, request.prompt_tokens - request.block_size * credit)
        wait = (w.pending_prefill_tokens + miss) / rate
        cost = w.price_per_hour * miss / rate + k.latency_weight * mean_price * wait
        late = k.ttft_target_ms is not None and wait * 1000 > k.ttft_target_ms
        return (wait if late else 0.0, cost, w.load)


def _guarded(items: Sequence[_T], terms: Sequence[tuple[float, float, int]]) -> list[_T]:
    """The items the TTFT guard keeps: those meeting the target, or (none does) the ones with
    the lowest wait."""
    low = min(t[0] for t in terms)
    return [item for item, t in zip(items, terms, strict=True) if t[0] == low]


def _mean_price(loads: Sequence[WorkerLoad]) -> float:
    mean = sum(w.price_per_hour for w in loads) / len(loads)
    return mean if mean > 0 else 1.0
