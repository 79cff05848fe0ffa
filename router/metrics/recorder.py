"""`RouterMetrics`: records each request and engine event into the parts that need it — the
Prometheus series (`registry`), the hit window and its alert (`alerts`) and the tallies behind
`/warply/cache_stats` (`stats`) — and reads them back as `/metrics` text or a `CacheStats`.

The index's numbers are passed in by the caller (`render`, `cache_stats`): the metrics hold no
index of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from router.config import RouterConfig
from router.index import IndexStats
from router.metrics.alerts import HitAlert
from router.metrics.record import RequestRecord
from router.metrics.registry import Series
from router.metrics.stats import Stats, bytes_by_pool_tier, index_view
from router.token_cache import ChunkStats
from router.workers import Worker, Workers
from warply.protocol.api import CacheStats, IndexHealthView, KvTransferStats, StrategyState


class RouterMetrics:
    """All router measurements; `render()` for Prometheus, `cache_stats()` for JSON."""

    def __init__(
        self,
        config: RouterConfig,
        workers: Workers,
        tokenizer_cache: ChunkStats | None = None,
    ) -> None:
        self._workers = workers
        self._tokenizer_cache = tokenizer_cache
        self.series = Series()
        self.alert = HitAlert(config.alerts)
        self.stats = Stats(config.strategy.name, workers, config.pd.local_prefill_tokens)
        self.on_request: list[Callable[[RequestRecord], None]] = []
        """Called with each ended request's record after it is counted (e.g. the tier
        policy's prefix tracker)."""

    @property
    def alert_firing(self) -> bool:
        return self.alert.firing

    # -- recording ------------------------------------------------------------------------------

    def request(self, rec: RequestRecord) -> None:
        """One request ended: its placement, what the engines reported, its timings."""
        d = rec.decision
        s = self.series
        s.child(s.requests, d.worker.name if d else "", str(rec.status)).inc()
        s.latency.observe(rec.latency_s)
        for observe in self.on_request:
            observe(rec)
        if d is None:
            return
        if rec.overhead_s is not None:
            s.overhead.observe(rec.overhead_s)
            self.stats.overhead.append(rec.overhead_s)
        if rec.early:
            s.early.inc()
            self.stats.totals["placed_early"] += 1
        if not rec.keyed:
            s.unkeyed.inc()
            self.stats.totals["placed_unkeyed"] += 1
        prompt = rec.prompt_tokens
        reason = d.local_reason or ("remote" if d.prefill is not None else "")
        s.child(s.decisions, d.mode, reason).inc()
        leg, cached = rec.prefill_leg(d)
        self._computed(leg.worker, prompt, leg.predicted_cached, cached)
        if d.prefill is not None:  # handed off: the prefill worker computed, the decode pulled
            self.stats.handoff(d.worker.name, prompt, d.predicted_cached)
            pool = d.worker.pool.name
            s.child(s.handoff_prompt_tokens, pool).inc(prompt)
            s.child(s.handoff_held_tokens, pool).inc(d.predicted_cached)
        if rec.prefill_failure:
            s.child(s.prefill_failures, rec.prefill_failure).inc()
        self.stats.decided(d.mode, d.local_reason, rec.prefill_failure)
        if d.worker.role == "decode":
            self.stats.phases(rec)
            for phase, value in (
                ("queue", rec.overhead_s),
                ("prefill", rec.prefill_s),
                ("decode_first_token", rec.decode_first_token_s),
            ):
                if value is not None and (phase == "queue" or leg is not None):
                    s.child(s.phase, phase).observe(value)
        # The client's view: the cached tokens its usage reports (no engine computed them).
        self.stats.routed(
            d.worker.name,
            prompt,
            d.reported_cached,
            d.namespace,
            d.keys[0] if d.keys else None,
            rec.cached,
        )
        sample = self.alert.add(prompt, d.reported_cached)
        if rec.cached is not None:
            self.alert.engine(sample, rec.cached)

    def _computed(
        self, worker: Worker, prompt: int, predicted: int, cached: int | None
    ) -> None:
        """`worker` computed a prompt of `prompt` tokens itself (aggregated, prefill leg, or a
        local prefill on decode): its pool's and role's hit counters."""
        labels = (worker.pool.name, worker.role)
        s = self.series
        s.child(s.prompt_tokens, *labels).inc(prompt)
        s.child(s.predicted_tokens, *labels).inc(predicted)
        if cached is not None:
            s.child(s.engine_tokens, *labels).inc(cached)
        self.stats.computed(worker.name, prompt, predicted, cached)

    def error(self, status: int, code: str | None) -> None:
        """The router answered a request with an error of its own (`router.errors.ApiError`)."""
        s = self.series
        s.child(s.errors, str(status), code or "").inc()

    def forwarded(self, endpoint: str, worker: str, status: int) -> None:
        """A request forwarded without placement (`router.passthrough`) was answered."""
        s = self.series
        s.child(s.forwarded, endpoint, worker, str(status)).inc()

    def stream_rejections(self, worker: str, rejected: Mapping[str, int]) -> None:
        """A worker's subscriber's rejection counts so far (set before each scrape)."""
        for reason, n in rejected.items():
            self.series.stream_rejected.labels(worker, reason).set(n)

    def first_token(self, ttft_s: float) -> None:
        self.series.ttft.observe(ttft_s)
        self.stats.ttft.append(ttft_s)

    def engine_removed(self, worker: str, blocks: int) -> None:
        """Blocks an engine reported evicted / removed."""
        pool = self._workers[worker].pool.name
        self.series.evictions.labels(pool).inc(blocks)
        self.stats.engine_evictions[pool] += blocks

    def engine_hit(self, worker: str, hit_tokens: int) -> None:
        """An engine reported reusing `hit_tokens` cached prompt tokens for one request."""
        self.series.prefix_hit_tokens.labels(worker).inc(hit_tokens)
        self.stats.engine_hit(worker, hit_tokens)

    def engine_transfers(self, worker: str, stats: KvTransferStats) -> None:
        """A decode engine's KV-transfer counters, as last read from its /metrics."""
        self.stats.transfers[worker] = stats

    def joined(self, worker: str) -> None:
        """A worker joined at runtime (its gauges appear at the next scrape)."""
        self.stats.joined(worker)

    def left(self, worker: str) -> None:
        """A worker left: its counters and its Prometheus series go."""
        self.stats.left(worker)
        self.series.forget(worker)

    # -- reading ---------------------------------------------------------------------------------

    def render(
        self,
        index: IndexStats,
        strategies: Mapping[str, StrategyState],
        health: Mapping[str, IndexHealthView],
    ) -> bytes:
        """Prometheus text exposition of the router's registry."""
        by_pool_tier = bytes_by_pool_tier(index, self._workers)
        self.series.refresh(
            index,
            by_pool_tier,
            self._workers.values(),
            self._tokenizer_cache,
            self.alert,
            self.stats.transfers,
            strategies,
        )
        self.series.refresh_health(self._workers.values(), health, self.stats)
        return self.series.render()

    def cache_stats(
        self,
        index: IndexStats,
        strategies: Mapping[str, StrategyState],
        health: Mapping[str, IndexHealthView],
        top: int = 20,
    ) -> CacheStats:
        """The JSON view: hit rates, bytes, evictions, per-worker numbers, affinity, latencies."""
        view = index_view(index, bytes_by_pool_tier(index, self._workers), self._workers)
        stats = self.stats.build(view, self._tokenizer_cache, self.alert, health, top)
        stats.strategy_state = dict(strategies)
        return stats
