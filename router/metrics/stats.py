"""The tallies behind `/warply/cache_stats` and the typed `CacheStats` built from them.

Lifetime totals (requests, prompt / predicted / engine-reported cached tokens), the same per
worker (summed per pool and per role when read), engine evictions by pool, the affinity map
((namespace, first block) → workers that served it, LRU-capped), the same client view per
tenant (cache namespace, the most recently active ones), windows of TTFT and router
overhead for p50 / p99, and the P/D hand-off: decisions, prefill failures, the TTFT parts of
handed-off requests and the decode workers' KV transfer counters.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping

from msgspec.structs import replace as struct_replace

from router.index import IndexStats
from router.metrics.alerts import HitAlert, ratio
from router.metrics.record import RequestRecord
from router.token_cache import ChunkStats
from router.workers import Worker, Workers
from warply.protocol import Tier
from warply.protocol.api import (
    AffinityEntry,
    AlertState,
    CacheStats,
    HitRates,
    IndexHealthView,
    IndexView,
    KvTransferStats,
    PdStats,
    PoolStats,
    Quantiles,
    TenantStats,
    TokenizerCacheStats,
    TtftBreakdown,
    WorkerStats,
)

_AFFINITY_CAP = 4096
TENANT_CAP = 256
"""Tenants (cache namespaces) tallied at once; the least recently active one goes first."""
_QUANTILE_WINDOW = 2048


def quantiles(values: Iterable[float]) -> Quantiles:
    data = sorted(values)
    if not data:
        return Quantiles(0, None, None)
    last = len(data) - 1
    return Quantiles(len(data), data[int(0.50 * last)], data[int(0.99 * last)])


def bytes_by_pool_tier(index: IndexStats, workers: Workers) -> Counter[tuple[str, str]]:
    """KV bytes per (pool, tier): each worker's `tier_bytes`."""
    entries: dict[str, dict[Tier, int]] = {}
    for (worker, tier), n in index.entries_by_worker_tier.items():
        entries.setdefault(worker, {})[tier] = n
    out: Counter[tuple[str, str]] = Counter()
    for w in workers.values():
        for tier, nbytes in tier_bytes(w, entries.get(w.name, {})).items():
            out[(w.pool.name, tier.value)] += nbytes
    return out


def tier_bytes(worker: Worker, entries: Mapping[Tier, int]) -> dict[Tier, int]:
    """KV bytes `worker` holds per tier: the tier backend's own count where the engine reports
    one (`LoadSnapshot.backend_bytes`, e.g. LMCache's `/status`), else its index entries × bytes
    per block (the pool's `kv_bytes_per_token` × block size, or the engine's
    `kv_bytes_per_block`)."""
    per_block = block_bytes(worker)
    out = {tier: n * per_block for tier, n in entries.items()}
    if worker.snapshot is not None and worker.snapshot.backend_bytes:
        out.update(worker.snapshot.backend_bytes)
    return out


def block_bytes(worker: Worker) -> int:
    """KV bytes one block takes on `worker` (the pool's statement, else the engine's report;
    0: neither)."""
    stated = worker.pool.block_size * worker.pool.kv_bytes_per_token
    if stated or worker.snapshot is None:
        return stated
    return worker.snapshot.kv_bytes_per_block


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
        overpredicted=dict(index.overpredicted),
    )


class Stats:
    """What the router has seen so far; `build` turns it into `CacheStats`."""

    def __init__(self, strategy: str, workers: Workers, local_prefill_tokens: int = 0) -> None:
        self.strategy = strategy
        self._workers = workers
        self.local_prefill_tokens = local_prefill_tokens
        self.pd = any(pool.role != "both" for pool in workers.pools)
        self.totals: Counter[str] = Counter()
        self.per_worker: dict[str, WorkerStats] = {name: WorkerStats() for name in workers}
        self._engine_prompt: Counter[str] = Counter()
        """Per worker: prompt tokens of the requests it computed that reported usage."""
        self.engine_evictions: Counter[str] = Counter()
        self._affinity: OrderedDict[tuple[str, int], Counter[str]] = OrderedDict()
        self.tenants: OrderedDict[str, TenantStats] = OrderedDict()
        self.ttft: deque[float] = deque(maxlen=_QUANTILE_WINDOW)
        self.overhead: deque[float] = deque(maxlen=_QUANTILE_WINDOW)
        self.decisions: Counter[str] = Counter()
        self.prefill_failures: Counter[str] = Counter()
        self.queue_s: deque[float] = deque(maxlen=_QUANTILE_WINDOW)
        self.prefill_s: deque[float] = deque(maxlen=_QUANTILE_WINDOW)
        self.decode_first_s: deque[float] = deque(maxlen=_QUANTILE_WINDOW)
        self.transfers: dict[str, KvTransferStats] = {}

    def routed(
        self,
        worker: str,
        prompt_tokens: int,
        reported_cached: int,
        namespace: str,
        first_key: int | None,
        cached: int | None,
    ) -> None:
        """A request answered by `worker`: the client's view (the cached tokens its usage
        reports, predicted and engine-reported) and the affinity map."""
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += prompt_tokens
        self.totals["predicted_cached_tokens"] += reported_cached
        tenant = self.tenants.get(namespace)
        if tenant is None:
            tenant = self.tenants[namespace] = TenantStats()
            if len(self.tenants) > TENANT_CAP:
                self.tenants.popitem(last=False)
        self.tenants.move_to_end(namespace)
        tenant.requests += 1
        tenant.prompt_tokens += prompt_tokens
        tenant.predicted_cached_tokens += reported_cached
        if cached is not None:
            self.totals["engine_cached_tokens"] += cached
            self.totals["engine_prompt_tokens"] += prompt_tokens
            tenant.engine_cached_tokens += cached
            tenant.engine_prompt_tokens += prompt_tokens
        if first_key is not None:
            slot = (namespace, first_key)
            self._affinity.setdefault(slot, Counter())[worker] += 1
            self._affinity.move_to_end(slot)
            if len(self._affinity) > _AFFINITY_CAP:
                self._affinity.popitem(last=False)

    def computed(self, worker: str, prompt_tokens: int, predicted: int, cached: int | None) -> None:
        """`worker` computed a prompt itself (aggregated, prefill leg, local prefill)."""
        w = self.per_worker.get(worker)
        if w is None:  # left while the request was placed
            return
        w.requests += 1
        w.prompt_tokens += prompt_tokens
        w.predicted_cached_tokens += predicted
        if cached is not None:
            w.engine_cached_tokens += cached
            self._engine_prompt[worker] += prompt_tokens

    def handoff(self, worker: str, prompt_tokens: int, held: int) -> None:
        """Decode worker `worker` pulled a prompt's KV; it already held `held` tokens of it."""
        w = self.per_worker.get(worker)
        if w is None:
            return
        w.handoffs += 1
        w.handoff_prompt_tokens += prompt_tokens
        w.handoff_held_tokens += held

    def decided(self, mode: str, reason: str, failure: str) -> None:
        """How a request was served: aggregated, handed off, prefilled on decode (why), or
        answered whole by a prefill worker."""
        self.decisions[f"{mode}:{reason}" if mode == "local" else mode] += 1
        if failure:
            self.prefill_failures[failure] += 1

    def phases(self, rec: RequestRecord) -> None:
        """A hand-off's TTFT parts (the queue of every request placed on a decode worker)."""
        if rec.overhead_s is not None:
            self.queue_s.append(rec.overhead_s)
        if rec.decision is None or rec.decision.prefill is None:
            return
        if rec.prefill_s is not None:
            self.prefill_s.append(rec.prefill_s)
        if (first := rec.decode_first_token_s) is not None:
            self.decode_first_s.append(first)

    def joined(self, worker: str) -> None:
        """A worker joined at runtime: its counters start at zero."""
        self.per_worker[worker] = WorkerStats()

    def left(self, worker: str) -> None:
        """A worker left: its counters, transfer counters and affinity entries go."""
        self.per_worker.pop(worker, None)
        self._engine_prompt.pop(worker, None)
        self.transfers.pop(worker, None)
        for slot, served in list(self._affinity.items()):
            served.pop(worker, None)
            if not served:
                del self._affinity[slot]

    def engine_hit(self, worker: str, hit_tokens: int) -> None:
        w = self.per_worker.get(worker)
        if w is not None:
            w.engine_prefix_hits += 1
            w.engine_prefix_hit_tokens += hit_tokens

    def engine_prompt_tokens(self, worker: str) -> int:
        """Prompt tokens `worker` computed for requests whose engine reported usage."""
        return self._engine_prompt[worker]

    def _worker_view(
        self, name: str, counts: WorkerStats, health: Mapping[str, IndexHealthView]
    ) -> WorkerStats:
        worker = self._workers[name]
        view = health.get(name)
        return struct_replace(
            counts,
            in_flight=worker.load.in_flight,
            healthy=worker.healthy,
            index_state=view.state if view is not None else "exact",
            predicted_hit_rate=ratio(counts.predicted_cached_tokens, counts.prompt_tokens),
            engine_hit_rate=ratio(counts.engine_cached_tokens, self._engine_prompt[name]),
        )

    def _by(self, key: str) -> dict[str, PoolStats]:
        """Per-worker numbers summed by pool (`key` "pool") or by role ("role")."""
        out: dict[str, PoolStats] = {}
        prompts: Counter[str] = Counter()
        for name, w in self.per_worker.items():
            worker = self._workers[name]
            slot = worker.pool.name if key == "pool" else worker.role
            agg = out.setdefault(slot, PoolStats(role=worker.role))
            agg.requests += w.requests
            agg.prompt_tokens += w.prompt_tokens
            agg.predicted_cached_tokens += w.predicted_cached_tokens
            agg.engine_cached_tokens += w.engine_cached_tokens
            agg.handoffs += w.handoffs
            agg.handoff_prompt_tokens += w.handoff_prompt_tokens
            agg.handoff_held_tokens += w.handoff_held_tokens
            agg.engine_prefix_hit_tokens += w.engine_prefix_hit_tokens
            prompts[slot] += self._engine_prompt[name]
        for slot, agg in out.items():
            agg.hit_rate = ratio(agg.engine_cached_tokens, prompts[slot])
        return out

    def build(
        self,
        index: IndexView,
        tokenizer_cache: ChunkStats | None,
        alert: HitAlert,
        health: Mapping[str, IndexHealthView],
        top: int = 20,
    ) -> CacheStats:
        t = self.totals
        affinity = sorted(self._affinity.items(), key=lambda kv: -sum(kv[1].values()))[:top]
        workers = {
            name: self._worker_view(name, w, health) for name, w in self.per_worker.items()
        }
        tenants = {
            ns: struct_replace(
                ts,
                predicted_hit_rate=ratio(ts.predicted_cached_tokens, ts.prompt_tokens),
                engine_hit_rate=ratio(ts.engine_cached_tokens, ts.engine_prompt_tokens),
            )
            for ns, ts in self.tenants.items()
        }
        tok = tokenizer_cache
        pd = None
        if self.pd:
            pd = PdStats(
                local_prefill_tokens=self.local_prefill_tokens,
                decisions=dict(self.decisions),
                prefill_failures=dict(self.prefill_failures),
                ttft=TtftBreakdown(
                    quantiles(self.queue_s),
                    quantiles(self.prefill_s),
                    quantiles(self.decode_first_s),
                ),
                transfers=dict(self.transfers),
            )
        return CacheStats(
            strategy=self.strategy,
            requests=t["requests"],
            prompt_tokens=t["prompt_tokens"],
            placed_early=t["placed_early"],
            placed_unkeyed=t["placed_unkeyed"],
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
            pools=self._by("pool"),
            roles=self._by("role"),
            pd=pd,
            tenants=tenants,
        )
