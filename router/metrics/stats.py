"""The tallies behind `/warply/cache_stats` and the typed `CacheStats` built from them.

Lifetime totals (requests, prompt / predicted / engine-reported cached tokens), the same per
worker, engine evictions by pool, the affinity map ((namespace, first block) → workers that
served it, LRU-capped), and windows of TTFT and router overhead for p50 / p99.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable

from router.index import IndexStats
from router.metrics.alerts import HitAlert, ratio
from router.token_cache import ChunkStats
from router.workers import Workers
from warply.protocol.api import (
    AffinityEntry,
    AlertState,
    CacheStats,
    HitRates,
    IndexView,
    Quantiles,
    TokenizerCacheStats,
    WorkerStats,
)

_AFFINITY_CAP = 4096
_QUANTILE_WINDOW = 2048


def quantiles(values: Iterable[float]) -> Quantiles:
    data = sorted(values)
    if not data:
        return Quantiles(0, None, None)
    last = len(data) - 1
    return Quantiles(len(data), data[int(0.50 * last)], data[int(0.99 * last)])


def bytes_by_pool_tier(index: IndexStats, workers: Workers) -> Counter[tuple[str, str]]:
    """KV bytes the index's entries stand for, per (pool, tier): entries × block × bytes/token."""
    out: Counter[tuple[str, str]] = Counter()
    for (worker, tier), n in index.entries_by_worker_tier.items():
        w = workers.get(worker)
        if w is not None:
            out[(w.pool.name, tier.value)] += n * w.pool.block_size * w.pool.kv_bytes_per_token
    return out


def index_view(
    index: IndexStats, by_pool_tier: Counter[tuple[str, str]], workers: Workers
) -> IndexView:
    by_tier: Counter[str] = Counter()
    by_pool: dict[str, int] = {pool.config.name: 0 for pool in workers.pools}
    for (pool, tier_name), nbytes in by_pool_tier.items():
        by_tier[tier_name] += nbytes
        by_pool[pool] += nbytes
    return IndexView(
        entries=index.entries,
        entries_by_tier={str(t.value): n for t, n in index.entries_by_tier.items()},
        evictions=index.evictions,
        skipped=dict(index.skipped),
        bytes_cached=sum(by_tier.values()),
        bytes_by_tier=dict(by_tier),
        bytes_by_pool=by_pool,
    )


class Stats:
    """What the router has seen so far; `build` turns it into `CacheStats`."""

    def __init__(self, strategy: str, workers: Workers) -> None:
        self.strategy = strategy
        self._workers = workers
        self.totals: Counter[str] = Counter()
        self.per_worker: dict[str, WorkerStats] = {name: WorkerStats() for name in workers}
        self.engine_evictions: Counter[str] = Counter()
        self._affinity: OrderedDict[tuple[str, int], Counter[str]] = OrderedDict()
        self.ttft: deque[float] = deque(maxlen=_QUANTILE_WINDOW)
        self.overhead: deque[float] = deque(maxlen=_QUANTILE_WINDOW)

    def routed(
        self,
        worker: str,
        prompt_tokens: int,
        predicted_cached: int,
        namespace: str,
        first_key: int | None,
        early: bool,
    ) -> None:
        if early:
            self.totals["placed_early"] += 1
        w = self.per_worker[worker]
        w.requests += 1
        w.prompt_tokens += prompt_tokens
        w.predicted_cached_tokens += predicted_cached
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += prompt_tokens
        self.totals["predicted_cached_tokens"] += predicted_cached
        if first_key is not None:
            slot = (namespace, first_key)
            self._affinity.setdefault(slot, Counter())[worker] += 1
            self._affinity.move_to_end(slot)
            if len(self._affinity) > _AFFINITY_CAP:
                self._affinity.popitem(last=False)

    def engine_cached(self, worker: str, prompt_tokens: int, cached: int) -> None:
        self.per_worker[worker].engine_cached_tokens += cached
        self.totals["engine_cached_tokens"] += cached
        self.totals["engine_prompt_tokens"] += prompt_tokens

    def engine_hit(self, worker: str, hit_tokens: int) -> None:
        w = self.per_worker.get(worker)
        if w is not None:
            w.engine_prefix_hits += 1
            w.engine_prefix_hit_tokens += hit_tokens

    def build(
        self,
        index: IndexView,
        tokenizer_cache: ChunkStats | None,
        alert: HitAlert,
        top: int = 20,
    ) -> CacheStats:
        t = self.totals
        affinity = sorted(self._affinity.items(), key=lambda kv: -sum(kv[1].values()))[:top]
        workers = {}
        for name, counts in self.per_worker.items():
            worker = self._workers[name]
            workers[name] = WorkerStats(
                requests=counts.requests,
                prompt_tokens=counts.prompt_tokens,
                predicted_cached_tokens=counts.predicted_cached_tokens,
                engine_cached_tokens=counts.engine_cached_tokens,
                engine_prefix_hits=counts.engine_prefix_hits,
                engine_prefix_hit_tokens=counts.engine_prefix_hit_tokens,
                in_flight=worker.load.in_flight,
                healthy=worker.healthy,
            )
        tok = tokenizer_cache
        return CacheStats(
            strategy=self.strategy,
            requests=t["requests"],
            prompt_tokens=t["prompt_tokens"],
            placed_early=t["placed_early"],
            hit_rate=HitRates(
                predicted=ratio(t["predicted_cached_tokens"], t["prompt_tokens"]),
                engine=ratio(t["engine_cached_tokens"], t["engine_prompt_tokens"]),
                window_predicted=alert.window.predicted(),
                window_engine=alert.window.engine(),
            ),
            predicted_cached_tokens=t["predicted_cached_tokens"],
            engine_cached_tokens=t["engine_cached_tokens"],
            index=index,
            evictions_by_pool=dict(self.engine_evictions),
            workers=workers,
            affinity=[
                AffinityEntry(ns, f"{key:016x}", dict(ws)) for (ns, key), ws in affinity
            ],
            ttft_s=quantiles(self.ttft),
            overhead_s=quantiles(self.overhead),
            tokenizer_cache=None
            if tok is None
            else TokenizerCacheStats(tok.hits, tok.misses, tok.bytes),
            alert=AlertState(alert.config.min_hit_ratio, alert.firing),
        )
