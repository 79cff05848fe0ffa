"""What the router measures: hit rates, bytes cached by tier, evictions, affinity, TTFT, overhead.

Prometheus series live in the router's own registry (`/metrics`); the same numbers, plus windowed
quantiles and the affinity map, are served as JSON (`/warply/cache_stats`). Hit rate comes in two
flavours: *predicted* (what the index said the chosen worker holds) and *engine* (what the
engine's `usage.prompt_tokens_details.cached_tokens` reported). `min_hit_ratio` raises an alert
(log line, gauge, optional callback) when the windowed hit rate falls below it.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.exposition import generate_latest

from router.config import AlertConfig, ConfigError, RouterConfig
from router.index import PrefixIndex
from router.placement import Decision
from router.token_cache import ChunkStats
from router.workers import Workers
from warply.common.loading import LoadError, load_path

_log = logging.getLogger("warply.router")
_AFFINITY_CAP = 4096
_QUANTILE_WINDOW = 2048
_OVERHEAD_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

AlertCallback = Callable[[float, float], object]


@dataclass(slots=True)
class Sample:
    prompt: int
    predicted: int
    engine: int | None = None


def _quantiles(values: Iterable[float]) -> dict[str, float | int | None]:
    data = sorted(values)
    if not data:
        return {"n": 0, "p50": None, "p99": None}
    last = len(data) - 1
    return {"n": len(data), "p50": data[int(0.50 * last)], "p99": data[int(0.99 * last)]}


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def _load_callback(spec: str | None) -> AlertCallback | None:
    if spec is None:
        return None
    try:
        fn = load_path(spec)
    except LoadError as exc:
        raise ConfigError(f"alerts.callback: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"alerts.callback: {spec!r} is not callable")
    return fn


class HitWindow:
    """Sliding window of recent requests' prompt / predicted / engine-reported cached tokens."""

    def __init__(self, size: int) -> None:
        self._samples: deque[Sample] = deque(maxlen=size)

    def add(self, prompt: int, predicted: int) -> Sample:
        sample = Sample(prompt, predicted)
        self._samples.append(sample)
        return sample

    def __len__(self) -> int:
        return len(self._samples)

    def predicted(self) -> float | None:
        return _ratio(sum(s.predicted for s in self._samples), sum(s.prompt for s in self._samples))

    def engine(self) -> float | None:
        done = [s for s in self._samples if s.engine is not None]
        return _ratio(sum(s.engine or 0 for s in done), sum(s.prompt for s in done))


class RouterMetrics:
    """All router measurements; `render()` for Prometheus, `cache_stats()` for JSON."""

    def __init__(
        self,
        config: RouterConfig,
        workers: Workers,
        index: PrefixIndex,
        tokenizer_cache: ChunkStats | None = None,
    ) -> None:
        self._config = config
        self._tokenizer_cache = tokenizer_cache
        self._workers = workers
        self._index = index
        self._alert_cfg: AlertConfig = config.alerts
        self._callback = _load_callback(config.alerts.callback)
        self.alert_firing = False
        self.window = HitWindow(config.alerts.window)
        self._affinity: OrderedDict[tuple[str, int], Counter[str]] = OrderedDict()
        self._ttft: deque[float] = deque(maxlen=_QUANTILE_WINDOW)
        self._overhead: deque[float] = deque(maxlen=_QUANTILE_WINDOW)
        self._totals: Counter[str] = Counter()
        self._per_worker: dict[str, Counter[str]] = {w: Counter() for w in workers}
        self._engine_evictions: Counter[str] = Counter()
        self._bytes_per_block = {
            w.name: w.pool.block_size * w.pool.kv_bytes_per_token
            for w in workers.values()
        }

        r = self.registry = CollectorRegistry()
        self._requests = PromCounter(
            "warply_router_requests", "Requests by worker and outcome", ["worker", "status"],
            registry=r,
        )
        self._prompt_tokens = PromCounter(
            "warply_router_prompt_tokens", "Prompt tokens routed", ["pool"], registry=r
        )
        self._early = PromCounter(
            "warply_router_early_placements",
            "Requests placed from the leading part of their prompt (the rest tokenized after)",
            registry=r,
        )
        self._predicted_tokens = PromCounter(
            "warply_router_predicted_cached_tokens",
            "Prompt tokens the index predicted cached on the chosen worker",
            ["pool"],
            registry=r,
        )
        self._engine_tokens = PromCounter(
            "warply_router_engine_cached_tokens",
            "Cached prompt tokens engines reported (usage.prompt_tokens_details.cached_tokens)",
            ["pool"],
            registry=r,
        )
        self._hit_ratio = Gauge(
            "warply_router_hit_ratio", "Windowed hit rate", ["source"], registry=r
        )
        self._alert = Gauge(
            "warply_router_hit_ratio_alert",
            "1 while the windowed hit rate is below min_hit_ratio",
            registry=r,
        )
        self._ttft_h = Histogram(
            "warply_router_ttft_seconds", "Time to first token measured at the router (streams)",
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self._latency_h = Histogram(
            "warply_router_request_seconds", "Request latency at the router",
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self._overhead_h = Histogram(
            "warply_router_overhead_seconds",
            "Router time before the upstream request (parse, tokenize, match, choose)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self._entries = Gauge(
            "warply_index_entries", "(block, worker) entries by tier", ["tier"], registry=r
        )
        self._bytes = Gauge(
            "warply_cached_bytes", "KV bytes cached by pool and tier", ["pool", "tier"], registry=r
        )
        self._index_evictions = Gauge(
            "warply_index_evictions", "Entries dropped by the index's own cap", registry=r
        )
        self._evictions = PromCounter(
            "warply_engine_evicted_blocks", "Blocks engines removed, by pool", ["pool"], registry=r
        )
        self._in_flight = Gauge(
            "warply_router_in_flight", "In-flight requests by worker", ["worker"], registry=r
        )
        self._healthy = Gauge("warply_worker_healthy", "1 if healthy", ["worker"], registry=r)
        self._tok_chunks = Gauge(
            "warply_router_tokenizer_chunks",
            "Prompt chunks the tokenizer cache served (hit) or encoded (miss)",
            ["result"],
            registry=r,
        )
        self._tok_bytes = Gauge(
            "warply_router_tokenizer_cache_bytes", "Bytes held by the tokenizer cache", registry=r
        )

    # -- recording ------------------------------------------------------------------------------

    def routed(self, decision: Decision, overhead_s: float, early: bool = False) -> Sample:
        """A request was placed (`early`: from its prompt's leading part); returns its window
        sample (engine numbers are filled later)."""
        pool = decision.worker.pool.name
        if early:
            self._early.inc()
            self._totals["placed_early"] += 1
        self._prompt_tokens.labels(pool).inc(decision.prompt_tokens)
        self._predicted_tokens.labels(pool).inc(decision.predicted_cached)
        self._overhead_h.observe(overhead_s)
        self._overhead.append(overhead_s)
        w = self._per_worker[decision.worker.name]
        w["requests"] += 1
        w["prompt_tokens"] += decision.prompt_tokens
        w["predicted_cached_tokens"] += decision.predicted_cached
        self._totals["requests"] += 1
        self._totals["prompt_tokens"] += decision.prompt_tokens
        self._totals["predicted_cached_tokens"] += decision.predicted_cached
        if decision.keys:
            slot = (decision.namespace, decision.keys[0])
            self._affinity.setdefault(slot, Counter())[decision.worker.name] += 1
            self._affinity.move_to_end(slot)
            if len(self._affinity) > _AFFINITY_CAP:
                self._affinity.popitem(last=False)
        sample = self.window.add(decision.prompt_tokens, decision.predicted_cached)
        self._check_alert()
        return sample

    def usage(self, decision: Decision, sample: Sample, usage: Mapping[str, Any] | None) -> None:
        """The engine's usage block for a request: its cached-token count."""
        if not isinstance(usage, Mapping):
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        if not isinstance(cached, int):
            return
        sample.engine = cached
        self._engine_tokens.labels(decision.worker.pool.name).inc(cached)
        self._per_worker[decision.worker.name]["engine_cached_tokens"] += cached
        self._totals["engine_cached_tokens"] += cached
        self._totals["engine_prompt_tokens"] += decision.prompt_tokens
        self._check_alert()

    def finished(self, decision: Decision | None, status: int, latency_s: float) -> None:
        """A request ended with `status` (HTTP) after `latency_s`."""
        self._requests.labels(decision.worker.name if decision else "", str(status)).inc()
        self._latency_h.observe(latency_s)

    def first_token(self, ttft_s: float) -> None:
        self._ttft_h.observe(ttft_s)
        self._ttft.append(ttft_s)

    def engine_removed(self, worker: str, blocks: int) -> None:
        """Blocks an engine reported evicted / removed."""
        pool = self._workers[worker].pool.name
        self._evictions.labels(pool).inc(blocks)
        self._engine_evictions[pool] += blocks

    # -- alert -----------------------------------------------------------------------------------

    def _check_alert(self) -> None:
        engine, predicted = self.window.engine(), self.window.predicted()
        if engine is not None:
            self._hit_ratio.labels("engine").set(engine)
        if predicted is not None:
            self._hit_ratio.labels("predicted").set(predicted)
        threshold = self._alert_cfg.min_hit_ratio
        ratio = engine if engine is not None else predicted
        if threshold <= 0 or ratio is None or len(self.window) < self._alert_cfg.min_requests:
            return
        firing = ratio < threshold
        if firing == self.alert_firing:
            return
        self.alert_firing = firing
        self._alert.set(1 if firing else 0)
        if not firing:
            _log.info("hit-rate alert cleared: windowed hit rate %.3f >= %.3f", ratio, threshold)
            return
        _log.warning(
            "hit-rate alert: windowed hit rate %.3f < min_hit_ratio %.3f (last %d requests)",
            ratio, threshold, len(self.window),
        )
        if self._callback is not None:
            try:
                self._callback(ratio, threshold)
            except Exception:  # a user callback must not take a request down
                _log.exception("hit-rate alert callback %s failed", self._alert_cfg.callback)

    # -- reading ---------------------------------------------------------------------------------

    def _refresh(self) -> dict[str, Any]:
        """Update the gauges from the index and workers; returns the index view for JSON."""
        stats = self._index.stats()
        for tier, n in stats.entries_by_tier.items():
            self._entries.labels(tier.value).set(n)
        self._index_evictions.set(stats.evictions)
        by_pool_tier: Counter[tuple[str, str]] = Counter()
        for (worker, tier), n in stats.entries_by_worker_tier.items():
            w = self._workers.get(worker)
            if w is not None:
                by_pool_tier[(w.pool.name, tier.value)] += n * self._bytes_per_block[worker]
        for (pool, tier_name), nbytes in by_pool_tier.items():
            self._bytes.labels(pool, tier_name).set(nbytes)
        for w in self._workers.values():
            self._in_flight.labels(w.name).set(w.load.in_flight)
            self._healthy.labels(w.name).set(1 if w.healthy else 0)
        if (tok := self._tokenizer_cache) is not None:
            self._tok_chunks.labels("hit").set(tok.hits)
            self._tok_chunks.labels("miss").set(tok.misses)
            self._tok_bytes.set(tok.bytes)
        by_tier: Counter[str] = Counter()
        for (_, tier_name), nbytes in by_pool_tier.items():
            by_tier[tier_name] += nbytes
        return {
            "entries": stats.entries,
            "entries_by_tier": {str(t.value): n for t, n in stats.entries_by_tier.items()},
            "evictions": stats.evictions,
            "skipped": dict(stats.skipped),
            "bytes_cached": sum(by_tier.values()),
            "bytes_by_tier": dict(by_tier),
            "bytes_by_pool": {
                pool: sum(n for (p, _), n in by_pool_tier.items() if p == pool)
                for pool in {w.pool.name for w in self._workers.values()}
            },
        }

    def render(self) -> bytes:
        """Prometheus text exposition of the router's registry."""
        self._refresh()
        return generate_latest(self.registry)

    def cache_stats(self, top: int = 20) -> dict[str, Any]:
        """The JSON view: hit rates, bytes, evictions, per-worker numbers, affinity, latencies."""
        index = self._refresh()
        t = self._totals
        affinity = sorted(self._affinity.items(), key=lambda kv: -sum(kv[1].values()))[:top]
        return {
            "strategy": self._config.strategy.name,
            "requests": t["requests"],
            "prompt_tokens": t["prompt_tokens"],
            "placed_early": t["placed_early"],
            "hit_rate": {
                "predicted": _ratio(t["predicted_cached_tokens"], t["prompt_tokens"]),
                "engine": _ratio(t["engine_cached_tokens"], t["engine_prompt_tokens"]),
                "window_predicted": self.window.predicted(),
                "window_engine": self.window.engine(),
            },
            "predicted_cached_tokens": t["predicted_cached_tokens"],
            "engine_cached_tokens": t["engine_cached_tokens"],
            "index": index,
            "evictions_by_pool": dict(self._engine_evictions),
            "workers": {
                name: {
                    **counts,
                    "in_flight": self._workers[name].load.in_flight,
                    "healthy": self._workers[name].healthy,
                }
                for name, counts in self._per_worker.items()
            },
            "affinity": [
                {"namespace": ns, "first_block": f"{key:016x}", "workers": dict(ws)}
                for (ns, key), ws in affinity
            ],
            "ttft_s": _quantiles(self._ttft),
            "overhead_s": _quantiles(self._overhead),
            "tokenizer_cache": None
            if self._tokenizer_cache is None
            else asdict(self._tokenizer_cache),
            "alert": {
                "min_hit_ratio": self._alert_cfg.min_hit_ratio,
                "firing": self.alert_firing,
            },
        }
