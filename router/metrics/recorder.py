"""`RouterMetrics`: records each request and engine event into the parts that need it — the
Prometheus series (`registry`), the hit window and its alert (`alerts`) and the tallies behind
`/warply/cache_stats` (`stats`) — and reads them back as `/metrics` text or a `CacheStats`.

The index's numbers are passed in by the caller (`render`, `cache_stats`): the metrics hold no
index of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.config import RouterConfig
from router.index import IndexStats
from router.metrics.alerts import HitAlert, Sample
from router.metrics.registry import Series
from router.metrics.stats import Stats, bytes_by_pool_tier, index_view
from router.placement import Decision
from router.token_cache import ChunkStats
from router.workers import Workers
from warply.protocol.api import CacheStats


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
        self.stats = Stats(config.strategy.name, workers)

    @property
    def alert_firing(self) -> bool:
        return self.alert.firing

    # -- recording ------------------------------------------------------------------------------

    def routed(self, decision: Decision, overhead_s: float, early: bool = False) -> Sample:
        """A request was placed (`early`: from its prompt's leading part); returns its window
        sample (engine numbers are filled later)."""
        pool = decision.worker.pool.name
        s = self.series
        if early:
            s.early.inc()
        s.prompt_tokens.labels(pool).inc(decision.prompt_tokens)
        s.predicted_tokens.labels(pool).inc(decision.predicted_cached)
        s.overhead.observe(overhead_s)
        self.stats.overhead.append(overhead_s)
        self.stats.routed(
            decision.worker.name,
            decision.prompt_tokens,
            decision.predicted_cached,
            decision.namespace,
            decision.keys[0] if decision.keys else None,
            early,
        )
        return self.alert.add(decision.prompt_tokens, decision.predicted_cached)

    def usage(self, decision: Decision, sample: Sample, usage: Mapping[str, Any] | None) -> None:
        """The engine's usage block for a request: its cached-token count."""
        if not isinstance(usage, Mapping):
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        if not isinstance(cached, int):
            return
        self.series.engine_tokens.labels(decision.worker.pool.name).inc(cached)
        self.stats.engine_cached(decision.worker.name, decision.prompt_tokens, cached)
        self.alert.engine(sample, cached)

    def finished(self, decision: Decision | None, status: int, latency_s: float) -> None:
        """A request ended with `status` (HTTP) after `latency_s`."""
        self.series.requests.labels(decision.worker.name if decision else "", str(status)).inc()
        self.series.latency.observe(latency_s)

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

    # -- reading ---------------------------------------------------------------------------------

    def render(self, index: IndexStats) -> bytes:
        """Prometheus text exposition of the router's registry."""
        by_pool_tier = bytes_by_pool_tier(index, self._workers)
        self.series.refresh(
            index, by_pool_tier, self._workers.values(), self._tokenizer_cache, self.alert
        )
        return self.series.render()

    def cache_stats(self, index: IndexStats, top: int = 20) -> CacheStats:
        """The JSON view: hit rates, bytes, evictions, per-worker numbers, affinity, latencies."""
        view = index_view(index, bytes_by_pool_tier(index, self._workers), self._workers)
        return self.stats.build(view, self._tokenizer_cache, self.alert, top)
