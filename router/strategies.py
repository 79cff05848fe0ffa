"""Placement strategies: turn the index's prefix matches plus worker load into one choice.

Every strategy is a class with a `name`, a pydantic `Knobs` model (validated config with precise
errors) and `choose()`. The router and the trace replayer (`warply bench replay`) call the same
classes. Users add their own through the `warply.strategies` entry-point group or a
`module:Class` path in config (`router.registry`).

Notation (per candidate worker w, for one request of P full blocks):
  hit_t(w)  leading blocks of the request that w holds on tier t (`WorkerMatch.by_tier`)
  load(w)   router in-flight requests on w + the engine's waiting queue (last load snapshot)
  active(w) KV blocks held by w's in-flight requests (router-side, prompt + generated so far)
  queued(w) uncached prompt blocks routed to w that have no first token yet (prefill ahead)
"""

from __future__ import annotations

import abc
import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from router.index import WorkerMatch


@dataclass(slots=True)
class WorkerLoad:
    """What the router knows of one worker's load when it places a request."""

    name: str
    in_flight: int = 0
    """Requests the router has sent to this worker that have not finished."""
    in_flight_tokens: int = 0
    """Prompt + generated tokens of those requests (their KV footprint)."""
    pending_prefill_tokens: int = 0
    """Uncached prompt tokens (prompt minus predicted prefix hit) of those requests that have no
    first token yet: the prefill work queued or running ahead of a new request."""
    engine_waiting: int = 0
    """The engine's waiting queue from its last load snapshot."""
    kv_usage: float = 0.0
    """The engine's KV occupancy (0..1) from its last load snapshot."""

    @property
    def load(self) -> int:
        return self.in_flight + self.engine_waiting


@dataclass(frozen=True, slots=True)
class RequestView:
    """The request as strategies see it: its key chain and size."""

    keys: Sequence[int]
    """Keys of the prompt's full blocks; of its leading part only, when the router placed it
    before tokenizing the rest (nothing after that part can be cached anywhere)."""
    prompt_tokens: int
    block_size: int
    namespace: str = ""
    prefix_reuse: bool = True
    """False (per-request override) means: place by load alone."""

    @property
    def blocks(self) -> int:
        """P: the whole prompt's full blocks."""
        return max(len(self.keys), self.prompt_tokens // self.block_size)


_NO_MATCH = WorkerMatch(0, {})


class _Knobs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def imbalanced(loads: Sequence[int], balance_abs: float, balance_rel: float) -> bool:
    """The load guard: max − min load > balance_abs and max > balance_rel · min."""
    hi, lo = max(loads), min(loads)
    return hi - lo > balance_abs and hi > balance_rel * lo


class Strategy(abc.ABC):
    """Chooses a worker for a request among the healthy candidates (never empty)."""

    name: ClassVar[str]
    Knobs: ClassVar[type[BaseModel]] = _Knobs

    def __init__(self, knobs: BaseModel | None = None) -> None:
        self.knobs = knobs if knobs is not None else self.Knobs()
        self._ties = itertools.count()

    def _best(self, candidates: Sequence[WorkerLoad], key: Callable[[WorkerLoad], Any]) -> str:
        """The candidate with the smallest key; exact ties are served in turn, so idle, equal
        workers share new conversations instead of the first one taking them all."""
        keys = [key(w) for w in candidates]
        low = min(keys)
        tied = [w for w, k in zip(candidates, keys, strict=True) if k == low]
        return tied[next(self._ties) % len(tied)].name if len(tied) > 1 else tied[0].name

    def _least_loaded(self, candidates: Sequence[WorkerLoad]) -> str:
        """argmin load(w), then fewer in-flight tokens, then in turn."""
        return self._best(candidates, lambda w: (w.load, w.in_flight_tokens))

    @abc.abstractmethod
    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        """Name of the worker to send `request` to."""


class RoundRobin(Strategy):
    """Baseline: candidates in turn, ignoring cache and load."""

    name = "round_robin"

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        return candidates[next(self._ties) % len(candidates)].name


class LeastLoaded(Strategy):
    """Baseline: argmin load(w), ties broken by fewer in-flight tokens, then in turn."""

    name = "least_loaded"

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        return self._least_loaded(candidates)


class TierWeights(BaseModel):
    """Credit for a cached block by the tier it must be loaded from (1 = free reuse)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    gpu: float = Field(1.0, ge=0, le=1)
    cpu: float = Field(0.75, ge=0, le=1)
    ssd: float = Field(0.25, ge=0, le=1)
    object_store: float = Field(0.1, ge=0, le=1)

    def credit(self, match: WorkerMatch) -> float:
        """Σ_t weight_t · hit_t(w): cached blocks, discounted by how slow their tier is."""
        weights: dict[str, float] = self.model_dump()
        return sum(weights[tier.value] * n for tier, n in match.by_tier.items())


class PrefixAffinityKnobs(_Knobs):
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

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        k: PrefixAffinityKnobs = self.knobs  # type: ignore[assignment]
        loads = [w.load for w in candidates]
        if not request.prefix_reuse or imbalanced(loads, k.balance_abs, k.balance_rel):
            return self._least_loaded(candidates)
        credit = {w.name: k.tier_weights.credit(matches.get(w.name, _NO_MATCH)) for w in candidates}
        top = max(credit.values())
        if top == 0 or top / max(1, request.blocks) < k.min_match_ratio:
            # Too little cached to bind the request (a new conversation): the worker that
            # started the fewest conversations takes it (then lower load, then a small shared
            # prefix such as a system prompt), so conversations split evenly and then stick;
            # load skew beyond the guard above is handled there.
            name = self._best(
                candidates, lambda w: (self._started[w.name], w.load, -credit[w.name])
            )
            self._started[name] += 1
            return name
        return self._best(candidates, lambda w: (-credit[w.name], w.load, w.in_flight_tokens))


class KvReuseKnobs(_Knobs):
    tier_weights: TierWeights = TierWeights()
    prefill_weight: float = Field(1.0, ge=0)
    """Cost per block of prefill work: this request's uncached blocks and the queue ahead."""
    queue_weight: float = Field(0.5, ge=0)
    """Weight of a queued prefill block relative to one of this request's uncached blocks."""
    decode_weight: float = Field(0.0, ge=0)
    """Cost per KV block held by w's in-flight requests (decode pressure)."""


class KvReuse(Strategy):
    """Prefill work this request would wait for and do on w, plus decode pressure.

    cost(w) = prefill_weight · (max(0, P − credit(w)) + queue_weight · queued(w))
              + decode_weight · active(w)
    The lowest cost wins; ties → lower load, then in turn. The defaults (queue 0.5, decode 0)
    were tuned with `warply bench replay` on the Mooncake conversation trace: TTFT follows the
    prefill queued on a worker, not its count of decoding requests (docs/replay.md).
    """

    name = "kv-reuse"
    Knobs = KvReuseKnobs

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        k: KvReuseKnobs = self.knobs  # type: ignore[assignment]
        bs, blocks = request.block_size, request.blocks

        def cost(w: WorkerLoad) -> tuple[float, int]:
            match = matches.get(w.name, _NO_MATCH) if request.prefix_reuse else _NO_MATCH
            uncached = max(0.0, blocks - k.tier_weights.credit(match))
            prefill = uncached + k.queue_weight * w.pending_prefill_tokens / bs
            return (k.prefill_weight * prefill + k.decode_weight * w.in_flight_tokens / bs, w.load)

        return self._best(candidates, cost)


class NoCandidate(LookupError):
    """No healthy worker may serve this request (the router answers 503)."""


class TenantIsolatedKnobs(PrefixAffinityKnobs):
    tenants: dict[str, list[str]] = Field(default_factory=dict)
    """Cache namespace (tenant) → the workers reserved for it."""
    shared: list[str] = Field(default_factory=list)
    """Workers for namespaces not listed in `tenants` (empty: all workers not reserved)."""


class TenantIsolated(PrefixAffinity):
    """Route only within the request's tenant's workers, then by prefix affinity among them.

    Keys are already namespaced per tenant (the cache_key seeds the key chain), so tenants never
    share index hits; this strategy also keeps their KV on disjoint workers.
    """

    name = "tenant_isolated"
    Knobs = TenantIsolatedKnobs

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        k: TenantIsolatedKnobs = self.knobs  # type: ignore[assignment]
        if request.namespace in k.tenants:
            allowed = set(k.tenants[request.namespace])
        elif k.shared:
            allowed = set(k.shared)
        else:
            allowed = {w.name for w in candidates} - {w for ws in k.tenants.values() for w in ws}
        mine = [w for w in candidates if w.name in allowed]
        if not mine:
            raise NoCandidate(f"no healthy worker for cache namespace {request.namespace!r}")
        return super().choose(request, mine, matches)


BUILTIN: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, PrefixAffinity, KvReuse, TenantIsolated)
}
