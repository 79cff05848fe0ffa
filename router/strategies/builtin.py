"""Warply's built-in strategies, each stated as a formula with its knobs (notation in
`router.strategies.base`): two baselines, prefix affinity, kv-reuse cost, tenant isolation,
price against affinity (`router.strategies.cost`), and the default, `adaptive`
(`router.strategies.adaptive`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, Field

from router.index import WorkerMatch
from router.strategies.adaptive import AdaptiveAffinity
from router.strategies.base import (
    NO_MATCH,
    Knobs,
    NoCandidate,
    Ranked,
    RequestView,
    Score,
    Strategy,
    TierWeights,
    WorkerLoad,
    imbalanced,
)
from router.strategies.cost import CostAware
from warply.protocol import namespace_salt


class RoundRobin(Ranked):
    """Baseline: candidates in turn, ignoring cache and load."""

    name = "round_robin"

    def explain(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> dict[str, Score]:
        away = [(i - self._turn) % len(candidates) for i in range(len(candidates))]
        return {
            w.name: Score((away[i],), "in turn", {"turns_away": away[i]})
            for i, w in enumerate(candidates)
        }

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        name = super().choose(request, candidates, matches)
        self._turn += 1
        return name


class LeastLoaded(Ranked):
    """Baseline: argmin load(w), ties broken by fewer in-flight tokens, then in turn."""

    name = "least_loaded"

    def explain(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> dict[str, Score]:
        return self._load_scores(candidates, "least loaded")


_NEW_CONVERSATION = "new conversation: fewest started"


class PrefixAffinityKnobs(Knobs):
    tier_weights: TierWeights = TierWeights()
    min_match_ratio: float = Field(0.0, ge=0, le=1)
    """Below this credit / P, the cache is ignored and the least-loaded worker is taken."""
    balance_abs: int = Field(4, ge=0)
    """Imbalance guard: absolute spread of load(w) that counts as imbalanced..."""
    balance_rel: float = Field(1.5, ge=1)
    """...and the ratio max load / min load that must also be exceeded."""


class PrefixAffinity(Strategy):
    """Longest cached prefix, tier-weighted, load-guarded.

    If max load − min load > balance_abs and max load > balance_rel · min load, the system is
    imbalanced and the least-loaded worker wins. Otherwise the worker with the largest
    credit(w) = Σ_t weight_t · hit_t(w) wins (ties → lower load), unless credit / P <
    min_match_ratio: then the request starts a conversation and goes to the worker that started
    the fewest (then lower load, then larger credit). Remaining ties: in turn.
    """

    name = "prefix_affinity"
    Knobs = PrefixAffinityKnobs

    def __init__(self, knobs: BaseModel | None = None) -> None:
        super().__init__(knobs)
        self._started: Counter[str] = Counter()
        """Requests placed below min_match_ratio (conversations started), per worker."""

    def explain(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> dict[str, Score]:
        k: PrefixAffinityKnobs = self.knobs  # type: ignore[assignment]
        if not request.prefix_reuse:
            return self._load_scores(candidates, "least loaded: prefix_reuse is off")
        if imbalanced([w.load for w in candidates], k.balance_abs, k.balance_rel):
            return self._load_scores(candidates, "least loaded: load imbalanced")
        credit = {w.name: k.tier_weights.credit(matches.get(w.name, NO_MATCH)) for w in candidates}
        top = max(credit.values())
        if top == 0 or top / max(1, request.blocks) < k.min_match_ratio:
            # Too little cached to bind the request (a new conversation): the worker that
            # started the fewest conversations takes it (then lower load, then a small shared
            # prefix such as a system prompt), so conversations split evenly and then stick;
            # load skew beyond the guard above is handled there.
            return {
                w.name: Score(
                    (self._started[w.name], w.load, -credit[w.name]),
                    _NEW_CONVERSATION,
                    {"started": self._started[w.name], "load": w.load, "credit": credit[w.name]},
                )
                for w in candidates
            }
        return {
            w.name: Score(
                (-credit[w.name], w.load, w.in_flight_tokens),
                "longest cached prefix",
                {"credit": credit[w.name], "load": w.load, "in_flight_tokens": w.in_flight_tokens},
            )
            for w in candidates
        }

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        scores = self.explain(request, candidates, matches)
        name = self._lowest(candidates, scores)
        if scores[name].rule == _NEW_CONVERSATION:
            self._started[name] += 1
        return name


class KvReuseKnobs(Knobs):
    tier_weights: TierWeights = TierWeights()
    prefill_weight: float = Field(1.0, ge=0)
    """Cost per block of prefill work: this request's uncached blocks and the queue ahead."""
    queue_weight: float = Field(0.5, ge=0)
    """Weight of a queued prefill block relative to one of this request's uncached blocks."""
    decode_weight: float = Field(0.0, ge=0)
    """Cost per KV block held by w's in-flight requests (decode pressure)."""


class KvReuse(Ranked):
    """Prefill work this request would wait for and do on w, plus decode pressure.

    cost(w) = prefill_weight · (max(0, P − credit(w)) + queue_weight · queued(w))
              + decode_weight · active(w)
    The lowest cost wins; ties → lower load, then in turn. The defaults (queue 0.5, decode 0)
    were tuned with `warply bench replay` on the Mooncake conversation trace: TTFT follows the
    prefill queued on a worker, not its count of decoding requests (docs/replay.md).
    """

    name = "kv-reuse"
    Knobs = KvReuseKnobs

    def explain(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> dict[str, Score]:
        k: KvReuseKnobs = self.knobs  # type: ignore[assignment]
        bs, blocks = request.block_size, request.blocks

        def score(w: WorkerLoad) -> Score:
            match = matches.get(w.name, NO_MATCH) if request.prefix_reuse else NO_MATCH
            uncached = max(0.0, blocks - k.tier_weights.credit(match))
            queued = w.pending_prefill_tokens / bs
            prefill = uncached + k.queue_weight * queued
            cost = k.prefill_weight * prefill + k.decode_weight * w.in_flight_tokens / bs
            terms = {"uncached_blocks": uncached, "queued_blocks": queued, "cost": cost}
            return Score((cost, w.load), "lowest prefill + decode cost", terms)

        return {w.name: score(w) for w in candidates}


class TenantIsolatedKnobs(PrefixAffinityKnobs):
    tenants: dict[str, list[str]] = Field(default_factory=dict)
    """Tenant (the request's `cache_key` / `cache_salt`) → the workers reserved for it."""
    shared: list[str] = Field(default_factory=list)
    """Workers for namespaces not listed in `tenants` (empty: all workers not reserved)."""


class TenantIsolated(PrefixAffinity):
    """Route only within the request's tenant's workers, then by prefix affinity among them.

    Keys are already namespaced per tenant (the cache_key seeds the key chain), so tenants never
    share index hits; this strategy also keeps their KV on disjoint workers.
    """

    name = "tenant_isolated"
    Knobs = TenantIsolatedKnobs

    def explain(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> dict[str, Score]:
        return super().explain(request, self._mine(request, candidates), matches)

    def _mine(self, request: RequestView, candidates: Sequence[WorkerLoad]) -> list[WorkerLoad]:
        """The candidates reserved for the request's tenant; raises `NoCandidate` if none."""
        k: TenantIsolatedKnobs = self.knobs  # type: ignore[assignment]
        tenant = namespace_salt(request.namespace)  # a LoRA adapter does not change the tenant
        if tenant in k.tenants:
            allowed = set(k.tenants[tenant])
        elif k.shared:
            allowed = set(k.shared)
        else:
            allowed = {w.name for w in candidates} - {w for ws in k.tenants.values() for w in ws}
        mine = [w for w in candidates if w.name in allowed]
        if not mine:
            raise NoCandidate(f"no healthy worker for tenant {tenant!r}")
        return mine


BUILTIN: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        AdaptiveAffinity,
        RoundRobin,
        LeastLoaded,
        PrefixAffinity,
        KvReuse,
        TenantIsolated,
        CostAware,
    )
}
