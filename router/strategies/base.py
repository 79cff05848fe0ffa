"""The strategy contract: what a strategy sees (request, candidates' load, index matches) and
returns (one worker's name), plus the helpers built-ins share.

Notation (per candidate worker w, for one request of P full blocks):
  hit_t(w)  leading blocks of the request that w holds on tier t (`WorkerMatch.by_tier`)
  load(w)   router in-flight requests on w + the engine's waiting queue (last load snapshot)
  active(w) KV blocks held by w's in-flight requests (router-side, prompt + generated so far)
  queued(w) uncached prompt blocks routed to w that have no first token yet (prefill ahead)
  price(w)  what w costs per hour (its pool's `price_per_hour`)
  R(w)      w's prefill speed in tokens per second (its pool's `prefill_tokens_per_s`)
"""

from __future__ import annotations

import abc
import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
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
    price_per_hour: float = 0.0
    """Its pool's price (any currency, per worker-hour; 0: not priced)."""
    prefill_tokens_per_s: float = 0.0
    """Its pool's prefill speed (0: not stated)."""

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


NO_MATCH = WorkerMatch(0, {})
"""The match of a worker that holds none of the request."""


@dataclass(frozen=True, slots=True)
class Pick:
    """One pool's choice for a request, as the pools' picks are compared (`Strategy.prefer`)."""

    request: RequestView
    """The request in this pool's key chain and block size."""
    load: WorkerLoad
    """The chosen worker."""
    match: WorkerMatch
    cached_tokens: int
    """Prompt tokens the worker would report cached (full blocks, never the last token)."""


@dataclass(frozen=True, slots=True)
class Score:
    """One candidate as a strategy ranks it for one request (`Strategy.explain`)."""

    key: tuple[float, ...]
    """What the strategy minimises: the smallest key wins, exact ties are served in turn."""
    rule: str
    """Which of the strategy's rules ranked the candidates (e.g. "longest cached prefix")."""
    terms: Mapping[str, float] = field(default_factory=dict)
    """The named numbers behind `key`, for people (`/warply/where`)."""


class Knobs(BaseModel):
    """Base of every strategy's knobs: strict (unknown keys are errors) and immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


MEASURED_TIER_WEIGHTS = Path(__file__).with_name("tier_weights.json")
"""The default tier weights and the measurement they come from: `bench/tier_weights.py --write`
(the share of the recompute a block loaded from each tier saves, on real vLLM + LMCache)."""
_MEASURED: dict[str, float] = json.loads(MEASURED_TIER_WEIGHTS.read_text())["weights"]


class TierWeights(BaseModel):
    """Credit for a cached block by the tier it must be loaded from (1 = free reuse); defaults:
    the measured weights (`MEASURED_TIER_WEIGHTS`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    gpu: float = Field(_MEASURED["gpu"], ge=0, le=1)
    cpu: float = Field(_MEASURED["cpu"], ge=0, le=1)
    ssd: float = Field(_MEASURED["ssd"], ge=0, le=1)
    object_store: float = Field(_MEASURED["object_store"], ge=0, le=1)

    @cached_property
    def _by_name(self) -> dict[str, float]:
        return self.model_dump()

    def credit(self, match: WorkerMatch) -> float:
        """Σ_t weight_t · hit_t(w): cached blocks, discounted by how slow their tier is."""
        if not match.by_tier:
            return 0.0
        weights = self._by_name
        return sum(weights[tier.value] * n for tier, n in match.by_tier.items())


def imbalanced(loads: Sequence[int], balance_abs: float, balance_rel: float) -> bool:
    """The load guard: max − min load > balance_abs and max > balance_rel · min."""
    hi, lo = max(loads), min(loads)
    return hi - lo > balance_abs and hi > balance_rel * lo


class Strategy(abc.ABC):
    """Chooses a worker for a request among the healthy candidates (never empty)."""

    name: ClassVar[str]
    Knobs: ClassVar[type[BaseModel]] = Knobs

    def __init__(self, knobs: BaseModel | None = None) -> None:
        self.knobs = knobs if knobs is not None else self.Knobs()
        self._turn = 0
        """Exact ties taken so far: the next one goes to the tied candidate in this turn."""

    def _best(
        self,
        candidates: Sequence[WorkerLoad],
        key: Callable[[WorkerLoad], Any],
        advance: bool = True,
    ) -> str:
        """The candidate with the smallest key; exact ties are served in turn, so idle, equal
        workers share new conversations instead of the first one taking them all. `advance`
        False: only say who it would be (the turn is not taken)."""
        keys = [key(w) for w in candidates]
        low = min(keys)
        tied = [w for w, k in zip(candidates, keys, strict=True) if k == low]
        if len(tied) == 1:
            return tied[0].name
        turn = self._turn
        self._turn += advance
        return tied[turn % len(tied)].name

    def _lowest(
        self, candidates: Sequence[WorkerLoad], scores: Mapping[str, Score], advance: bool = True
    ) -> str:
        """The scored candidate with the smallest `Score.key` (ties in turn, as `_best`)."""
        scored = [w for w in candidates if w.name in scores]
        return self._best(scored, lambda w: scores[w.name].key, advance)

    @staticmethod
    def _load_scores(candidates: Sequence[WorkerLoad], rule: str) -> dict[str, Score]:
        """load(w), then fewer in-flight tokens: the least-loaded ranking."""
        return {
            w.name: Score(
                (w.load, w.in_flight_tokens),
                rule,
                {"load": w.load, "in_flight_tokens": w.in_flight_tokens},
            )
            for w in candidates
        }

    def explain(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> dict[str, Score]:
        """Each candidate's score as `choose` would rank it now, changing no state (the debugging
        view, `/warply/where`). The built-ins' `choose` is this ranking plus their bookkeeping,
        one computation; candidates a strategy rules out get no score. A strategy that does not
        override it explains nothing (empty)."""
        return {}

    def preview(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> tuple[str, dict[str, Score]]:
        """The worker `choose` would name now and the scores behind it, changing no state: the
        smallest key (exact ties: the one whose turn it is). A strategy that explains nothing is
        asked on a copy of itself."""
        scores = self.explain(request, candidates, matches)
        if not scores:
            return copy.deepcopy(self).choose(request, candidates, matches), {}
        return self._lowest(candidates, scores, advance=False), scores

    def prefer(self, picks: Sequence[Pick]) -> Pick:
        """The winner among several pools' picks for one request (never empty): by default the
        one holding the most cached tokens, then the lower load."""
        return max(picks, key=lambda p: (p.cached_tokens, -p.load.load))

    def gauges(self) -> dict[str, float]:
        """The strategy's own measured state, for metrics (name → value); none by default."""
        return {}

    def worker_gauges(self) -> dict[str, dict[str, float]]:
        """Per-worker measured state, for metrics (name → worker → value); none by default."""
        return {}

    def forget(self, worker: str) -> None:
        """`worker` left its pool at runtime: drop what the strategy keeps for it (nothing by
        default)."""
        return None

    @abc.abstractmethod
    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        """Name of the worker to send `request` to."""


class Ranked(Strategy):
    """A strategy whose choice is its explained ranking, nothing more: the candidate with the
    smallest `Score.key` (exact ties in turn), so `choose` and `/warply/where` cannot differ."""

    @abc.abstractmethod
    def explain(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> dict[str, Score]: ...

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        return self._lowest(candidates, self.explain(request, candidates, matches))


class NoCandidate(LookupError):
    """No healthy worker may serve this request (the router answers 503)."""
