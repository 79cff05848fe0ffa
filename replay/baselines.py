"""Baseline placement strategies modelled on other routers' published formulas.

They are `router.strategies.Strategy` subclasses, so the replay runs them next to Warply's
strategies under one engine model. Each models its anchor's decision rule, not its code:

- `sglang_cache_aware` (SGLang router `cache_aware`): an approximate tree of the requests the
  router itself routed (not engine state); imbalance guard, then match-rate threshold.
- `dynamo_kv` (NVIDIA Dynamo's default KV router cost).
- `llmd_precise` (llm-d precise prefix-cache scorer + queue + KV-utilisation scorers).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, Field

from router.index import WorkerMatch
from router.strategies import NO_MATCH, Knobs, RequestView, Strategy, WorkerLoad, imbalanced


class SglangCacheAwareKnobs(Knobs):
    cache_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    max_tree_tokens: int = Field(2**24, gt=0)
    """Per-worker tree cap (SGLang: `max_tree_size`), enforced by LRU on insert."""


class SglangCacheAware(Strategy):
    """SGLang router `cache_aware`, over block keys instead of characters.

    load(w) = router in-flight requests. If max load − min load > balance_abs_threshold and
    max load > balance_rel_threshold · min load: least loaded. Else match the request in the
    router's own tree: if matched / prompt tokens > cache_threshold, the worker holding the
    longest match (most recent on ties), otherwise the worker with the smallest tree. The chosen
    worker's tree then gets the request's blocks. Nothing is learnt from engine evictions.
    """

    name = "sglang_cache_aware"
    Knobs = SglangCacheAwareKnobs

    def __init__(self, knobs: BaseModel | None = None) -> None:
        super().__init__(knobs)
        self._holders: dict[int, dict[str, int]] = {}
        """Key → {worker: insertion tick}."""
        self._trees: dict[str, OrderedDict[int, None]] = {}
        """Worker → its keys, least recently inserted first."""
        self._tick = 0

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        k: SglangCacheAwareKnobs = self.knobs  # type: ignore[assignment]
        loads = [w.in_flight for w in candidates]
        if imbalanced(loads, k.balance_abs_threshold, k.balance_rel_threshold):
            name = min(candidates, key=lambda w: w.in_flight).name
        else:
            names = {w.name for w in candidates}
            depth, holder = self._match(request.keys, names)
            if holder and depth * request.block_size / request.prompt_tokens > k.cache_threshold:
                name = holder
            else:
                name = min(
                    candidates, key=lambda w: (len(self._trees.get(w.name, ())), w.in_flight)
                ).name
        self._insert(name, request.keys, max(1, k.max_tree_tokens // request.block_size))
        return name

    def _match(self, keys: Sequence[int], names: set[str]) -> tuple[int, str | None]:
        depth, holder = 0, None
        for key in keys:
            held = self._holders.get(key)
            if not held:
                break
            live = [(tick, w) for w, tick in held.items() if w in names]
            if not live:
                break
            depth, holder = depth + 1, max(live)[1]
        return depth, holder

    def _insert(self, worker: str, keys: Sequence[int], cap: int) -> None:
        self._tick += 1
        tree = self._trees.setdefault(worker, OrderedDict())
        for key in reversed(keys):  # the head ends most recent: tails are evicted first
            tree[key] = None
            tree.move_to_end(key)
            self._holders.setdefault(key, {})[worker] = self._tick
        while len(tree) > cap:
            key, _ = tree.popitem(last=False)
            held = self._holders[key]
            del held[worker]
            if not held:
                del self._holders[key]


class _SeededKnobs(Knobs):
    seed: int = 0
    """Seed of the random tie-break."""


class _RandomTies(Strategy):
    """Base of the baselines that break ties at random, as their upstreams do."""

    def __init__(self, knobs: BaseModel | None = None) -> None:
        super().__init__(knobs)
        self._rng = random.Random(self.knobs.seed)  # type: ignore[attr-defined]

    def _pick(self, candidates: Sequence[WorkerLoad], values: list[float], best: float) -> str:
        tied = [w for w, v in zip(candidates, values, strict=True) if v == best]
        return self._rng.choice(tied).name


class DynamoKvKnobs(_SeededKnobs):
    overlap_weight: float = Field(1.0, ge=0)
    """Weight of the prefill term (Dynamo: `overlap_score_weight`)."""


class DynamoKv(_RandomTies):
    """Dynamo's default KV router cost; the lowest wins, ties at random.

    cost(w) = overlap_weight · max(0, (queued prefill tokens(w) + prompt tokens) / B − cached(w))
              + active(w),
    cached(w) = blocks of the request w holds (index), active(w) = in-flight tokens(w) / B,
    queued prefill tokens = prompt tokens routed to w that have no first token yet.
    """

    name = "dynamo_kv"
    Knobs = DynamoKvKnobs

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        k: DynamoKvKnobs = self.knobs  # type: ignore[assignment]
        bs = request.block_size

        def cost(w: WorkerLoad) -> float:
            queued = w.pending_prefill_tokens
            cached = matches.get(w.name, NO_MATCH).blocks if request.prefix_reuse else 0
            prefill = max(0.0, (queued + request.prompt_tokens) / bs - cached)
            return k.overlap_weight * prefill + w.in_flight_tokens / bs

        costs = [cost(w) for w in candidates]
        return self._pick(candidates, costs, min(costs))


class LlmdPreciseKnobs(_SeededKnobs):
    prefix_weight: float = Field(3.0, ge=0)
    queue_weight: float = Field(2.0, ge=0)
    kv_weight: float = Field(2.0, ge=0)


def _minmax(values: list[float], higher_is_better: bool) -> list[float]:
    """Min-max normalise to [0, 1] (all equal → 1), as llm-d's scorers do."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    if higher_is_better:
        return [(v - lo) / (hi - lo) for v in values]
    return [(hi - v) / (hi - lo) for v in values]


class LlmdPrecise(_RandomTies):
    """llm-d's scheduler with the precise prefix-cache, queue and KV-utilisation scorers.

    score(w) = prefix_weight · minmax(cached blocks(w)) + queue_weight · minmax⁻(waiting(w))
               + kv_weight · (1 − kv_usage(w)); the highest wins, ties at random
    (minmax⁻ rewards the shortest queue).
    """

    name = "llmd_precise"
    Knobs = LlmdPreciseKnobs

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        k: LlmdPreciseKnobs = self.knobs  # type: ignore[assignment]
        cached = [
            float(matches.get(w.name, NO_MATCH).blocks) if request.prefix_reuse else 0.0
            for w in candidates
        ]
        prefix = _minmax(cached, higher_is_better=True)
        queue = _minmax([float(w.engine_waiting) for w in candidates], higher_is_better=False)
        scores = [
            k.prefix_weight * p + k.queue_weight * q + k.kv_weight * (1.0 - w.kv_usage)
            for w, p, q in zip(candidates, prefix, queue, strict=True)
        ]
        return self._pick(candidates, scores, max(scores))


BASELINES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (SglangCacheAware, DynamoKv, LlmdPrecise)
}
