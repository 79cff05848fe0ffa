"""The router's Prometheus series (`/metrics`), in its own registry.

Counters and histograms are fed as requests and engine events happen; gauges (index size,
bytes cached, in-flight, health, tokenizer cache, windowed hit rate, alert) are set from the
current state by `refresh` just before each scrape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.exposition import generate_latest

from router.index import IndexStats
from router.metrics.alerts import HitAlert
from router.metrics.stats import Stats
from router.token_cache import ChunkStats
from router.workers import Worker
from warply.protocol.api import IndexHealthView, KvTransferStats, StrategyState

_M = TypeVar("_M", PromCounter, Gauge, Histogram)
_INDEX_STATES = ("exact", "degraded", "fallback")
_BREAKER_STATES = ("closed", "open", "half_open")

_OVERHEAD_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_LAG_BUCKETS = (1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 10)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def tenant_label(namespace: str) -> str:
    """A cache namespace as a /metrics label: its cache salt (a request's `cache_key`, vLLM's
    `cache_salt`: the secret that keeps a tenant's KV apart, and /metrics needs no token) as a
    12-hex-digit BLAKE2b digest, then `:ADAPTER` in a LoRA adapter's namespace; "" for the
    unsalted base model. The same label on every replica and after a restart."""
    salt, _, adapter = namespace.partition("\0")
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=6)
    label = digest.hexdigest() if salt else ""
    return f"{label}:{adapter}" if adapter else label


def _remove_worker(metric: PromCounter | Gauge, worker: str) -> None:
    """Remove `metric`'s children whose `worker` label is `worker` (a sample's labels are in the
    metric's label order)."""
    children = {
        tuple(sample.labels.values())
        for family in metric.collect()
        for sample in family.samples
        if sample.labels.get("worker") == worker
    }
    for labels in children:
        metric.remove(*labels)


class Series:
    """Every series the router exports; `render()` is the text exposition."""

    def __init__(self) -> None:
        self._children: dict[tuple[object, tuple[str, ...]], object] = {}
        r = self.registry = CollectorRegistry()
        self.requests = PromCounter(
            "warply_router_requests", "Requests by worker and outcome", ["worker", "status"],
            registry=r,
        )
        self.errors = PromCounter(
            "warply_router_errors",
            "Error answers the router made itself (not passed on from an engine), by status and "
            "code: 4xx are rejected client input (invalid_json, invalid_prompt, "
            "request_too_large, ...), 5xx the router's or the fleet's failures",
            ["status", "code"],
            registry=r,
        )
        self.forwarded = PromCounter(
            "warply_router_forwarded_requests",
            "Requests forwarded without placement (/tokenize, /detokenize), by endpoint, worker "
            "and the status answered (502 / 504: the router's own for a failed upstream)",
            ["endpoint", "worker", "status"],
            registry=r,
        )
        self.stream_rejected = Gauge(
            "warply_stream_rejected",
            "State-stream frames (or events) a worker's subscriber rejected, by reason",
            ["worker", "reason"],
            registry=r,
        )
        self.prompt_tokens = PromCounter(
            "warply_router_prompt_tokens",
            "Prompt tokens computed, by the pool and role of the worker that computed them",
            ["pool", "role"],
            registry=r,
        )
        self.early = PromCounter(
            "warply_router_early_placements",
            "Requests placed from the leading part of their prompt (the rest tokenized after)",
            registry=r,
        )
        self.unkeyed = PromCounter(
            "warply_router_unkeyed_requests",
            "Requests placed by load alone, nothing predicted cached: the router cannot key "
            "their prompt (chats with images, audio or video)",
            registry=r,
        )
        self.predicted_tokens = PromCounter(
            "warply_router_predicted_cached_tokens",
            "Prompt tokens the index predicted cached on the worker that computed the prompt",
            ["pool", "role"],
            registry=r,
        )
        self.engine_tokens = PromCounter(
            "warply_router_engine_cached_tokens",
            "Cached prompt tokens engines reported (usage.prompt_tokens_details.cached_tokens), "
            "by the pool and role of the worker that computed the prompt",
            ["pool", "role"],
            registry=r,
        )
        self.hit_ratio = Gauge(
            "warply_router_hit_ratio", "Windowed hit rate", ["source"], registry=r
        )
        self.alert = Gauge(
            "warply_router_hit_ratio_alert",
            "1 while the windowed hit rate is below min_hit_ratio",
            registry=r,
        )
        self.ttft = Histogram(
            "warply_router_ttft_seconds", "Time to first token measured at the router (streams)",
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.latency = Histogram(
            "warply_router_request_seconds", "Request latency at the router",
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.overhead = Histogram(
            "warply_router_overhead_seconds",
            "Router time before the upstream request (parse, tokenize, match, choose)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "warply_router_event_loop_lag_seconds",
            "How late the router's event loop ran a 0.25 s timer (work that blocked the loop)",
            buckets=_LAG_BUCKETS, registry=r,
        )
        self.decisions = PromCounter(
            "warply_router_pd_decisions",
            "Requests by how they were served (mode aggregated, remote = handed off, local = "
            "the decode worker prefilled, on_prefill = a prefill worker answered whole) and why "
            "a decode worker prefilled locally",
            ["mode", "reason"],
            registry=r,
        )
        self.prefill_failures = PromCounter(
            "warply_router_prefill_failures",
            "Prefill legs that failed (each fell back to a local prefill on decode), by reason",
            ["reason"],
            registry=r,
        )
        self.phase = Histogram(
            "warply_router_pd_phase_seconds",
            "TTFT parts of requests placed on decode workers: queue (receipt to the first "
            "upstream request), prefill (the prefill worker's answer), decode_first_token "
            "(KV transfer and the first decode step, streams)",
            ["phase"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.handoff_prompt_tokens = PromCounter(
            "warply_router_handoff_prompt_tokens",
            "Prompt tokens of requests handed off to a decode worker, by its pool",
            ["pool"],
            registry=r,
        )
        self.handoff_held_tokens = PromCounter(
            "warply_router_handoff_held_tokens",
            "Prompt tokens of hand-offs the decode worker already held (index view): not "
            "transferred",
            ["pool"],
            registry=r,
        )
        self.kv_transfer_bytes = Gauge(
            "warply_engine_kv_transfer_bytes",
            "KV bytes a decode engine pulled from prefill engines (vllm:nixl_bytes_transferred)",
            ["worker"],
            registry=r,
        )
        self.kv_transfer_seconds = Gauge(
            "warply_engine_kv_transfer_seconds",
            "Time a decode engine spent in KV transfers (vllm:nixl_xfer_time_seconds_sum)",
            ["worker"],
            registry=r,
        )
        self.kv_transfers = Gauge(
            "warply_engine_kv_transfers",
            "KV transfers a decode engine made, by outcome (ok, failed)",
            ["worker", "outcome"],
            registry=r,
        )
        self.p2p_tokens = Gauge(
            "warply_engine_p2p_tokens",
            "Prompt tokens an engine took from another engine's cache "
            "(vllm:prompt_tokens_cached_by_source_total{source=\"p2p\"})",
            ["worker"],
            registry=r,
        )
        self.entries = Gauge(
            "warply_index_entries", "(block, worker) entries by tier", ["tier"], registry=r
        )
        self.bytes = Gauge(
            "warply_cached_bytes", "KV bytes cached by pool and tier", ["pool", "tier"], registry=r
        )
        self.index_evictions = Gauge(
            "warply_index_evictions", "Entries dropped by the index's own cap", registry=r
        )
        self.store_failures = Gauge(
            "warply_index_store_failures",
            "Calls the shared index store failed since start-up, by operation (the router "
            "placed without its matches meanwhile)",
            ["op"],
            registry=r,
        )
        self.overpredicted = Gauge(
            "warply_index_overpredicted_blocks",
            "Blocks the index credited to a worker that its engine then reported not cached, "
            "since start-up",
            ["worker"],
            registry=r,
        )
        self.evictions = PromCounter(
            "warply_engine_evicted_blocks", "Blocks engines removed, by pool", ["pool"], registry=r
        )
        self.prefix_hit_tokens = PromCounter(
            "warply_engine_prefix_hit_tokens",
            "Prompt tokens engines reported reusing from their prefix cache (PrefixHit events)",
            ["worker"],
            registry=r,
        )
        self.in_flight = Gauge(
            "warply_router_in_flight", "In-flight requests by worker", ["worker"], registry=r
        )
        self.healthy = Gauge("warply_worker_healthy", "1 if healthy", ["worker"], registry=r)
        self.tok_chunks = Gauge(
            "warply_router_tokenizer_chunks",
            "Prompt chunks the tokenizer cache served (hit) or encoded (miss)",
            ["result"],
            registry=r,
        )
        self.tok_bytes = Gauge(
            "warply_router_tokenizer_cache_bytes",
            "Bytes held by the tokenizer's chunk cache (at most tokenizer_cache_mib)",
            registry=r,
        )
        self.tok_texts_bytes = Gauge(
            "warply_router_tokenizer_texts_bytes",
            "Bytes of whole prompts the tokenizer remembers (at most half of tokenizer_cache_mib)",
            registry=r,
        )
        self.strategy_state = Gauge(
            "warply_strategy_state",
            "A pool's strategy as it measures itself (adaptive: eviction_loss, queue_depth, "
            "duplicate_price, spills, ...)",
            ["pool", "name"],
            registry=r,
        )
        self.strategy_worker_state = Gauge(
            "warply_strategy_worker_state",
            "A pool's strategy's per-worker state (adaptive: routed_share, 1 = fair share)",
            ["pool", "worker", "name"],
            registry=r,
        )
        self.index_state = Gauge(
            "warply_index_state",
            "1 for the state a worker's index is in (exact; degraded: gap being replayed or "
            "evictions lagging, its matches count for their leading part; fallback: not trusted, "
            "placed by load)",
            ["worker", "state"],
            registry=r,
        )
        self.index_aged_out = Gauge(
            "warply_index_aged_out",
            "Times a worker's index entries were aged out: its state stream stayed silent "
            "index.stale_after_s after it stored blocks, since start-up",
            ["worker"],
            registry=r,
        )
        self.parity_mismatch = Gauge(
            "warply_index_parity_mismatch",
            "1 while a worker's engine tokenizes the probes differently (tokenizer) or stores "
            "blocks of another size (block_size) than the router: its matches are not used",
            ["worker", "kind"],
            registry=r,
        )
        self.breaker_state = Gauge(
            "warply_worker_breaker_state",
            "1 for the state of a worker's circuit breaker (closed, open, half_open)",
            ["worker", "state"],
            registry=r,
        )
        self.breaker_trips = Gauge(
            "warply_worker_breaker_trips",
            "Times a worker's circuit breaker opened since start-up",
            ["worker"],
            registry=r,
        )
        self.worker_tokens = Gauge(
            "warply_router_worker_tokens",
            "Per worker, prompts it computed: prompt tokens, tokens the index predicted cached, "
            "cached tokens its engine reported, and prompt tokens of the requests that reported "
            "usage (kind: prompt, predicted_cached, engine_cached, engine_prompt)",
            ["worker", "kind"],
            registry=r,
        )
        self.tenant_tokens = Gauge(
            "warply_router_tenant_tokens",
            "Per tenant (a digest of its cache key, `:ADAPTER` added for a LoRA adapter; the most "
            "recently active ones): prompt tokens, tokens predicted cached, engine-reported "
            "cached tokens, prompt tokens that reported usage",
            ["tenant", "kind"],
            registry=r,
        )

        self.tiering_rounds = PromCounter(
            "warply_tiering_rounds", "Tier-policy rounds run", registry=r
        )
        self.tiering_failures = PromCounter(
            "warply_tiering_policy_failures",
            "Tier-policy rounds whose decide() raised (logged; routing went on)",
            registry=r,
        )
        self.tiering_directives = PromCounter(
            "warply_tiering_directives",
            "Tier-policy directives by kind and outcome (applied, rejected, timeout, error, "
            "no_control, dropped, refused)",
            ["kind", "outcome"],
            registry=r,
        )
        self.tiering_pins_refused = PromCounter(
            "warply_tiering_pins_refused",
            "Pins of tier policies refused by the runner, not sent, per namespace (a digest of its "
            "cache key) and reason "
            "(over_budget: past tiering.pin_budget; unknown_bytes: size not known under a budget)",
            ["namespace", "reason"],
            registry=r,
        )
        self.tiering_pinned_bytes = Gauge(
            "warply_tiering_pinned_bytes",
            "Bytes the tier runner's applied pins hold per namespace (a digest of its cache key) "
            "and tier, all workers",
            ["namespace", "tier"],
            registry=r,
        )

    def child(self, metric: _M, *labels: str) -> _M:
        """`metric.labels(*labels)`, looked up once: prometheus_client's `labels` validates and
        locks on every call, a cost each request paid several times."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return cast(_M, found)

    def forget(self, worker: str) -> None:
        """Remove every labelled series of `worker` (it left the router)."""
        self._children.clear()
        for metric in (
            self.requests,
            self.forwarded,
            self.kv_transfer_bytes,
            self.kv_transfer_seconds,
            self.kv_transfers,
            self.p2p_tokens,
            self.prefix_hit_tokens,
            self.in_flight,
            self.healthy,
            self.strategy_worker_state,
            self.index_state,
            self.index_aged_out,
            self.parity_mismatch,
            self.breaker_state,
            self.breaker_trips,
            self.worker_tokens,
            self.stream_rejected,
        ):
            _remove_worker(metric, worker)

    def refresh(
        self,
        index: IndexStats,
        bytes_by_pool_tier: Mapping[tuple[str, str], int],
        workers: Iterable[Worker],
        tokenizer_cache: ChunkStats | None,
        alert: HitAlert,
        transfers: Mapping[str, KvTransferStats],
        strategies: Mapping[str, StrategyState],
    ) -> None:
        """Set the gauges from the current state."""
        for pool, state in strategies.items():
            for name, value in state.gauges.items():
                self.strategy_state.labels(pool, name).set(value)
            for name, per_worker in state.workers.items():
                for worker, value in per_worker.items():
                    self.strategy_worker_state.labels(pool, worker, name).set(value)
        for worker, t in transfers.items():
            self.kv_transfer_bytes.labels(worker).set(t.bytes)
            self.kv_transfer_seconds.labels(worker).set(t.seconds)
            self.kv_transfers.labels(worker, "ok").set(t.transfers)
            self.kv_transfers.labels(worker, "failed").set(t.failed)
            self.p2p_tokens.labels(worker).set(t.p2p_tokens)
        for tier, n in index.entries_by_tier.items():
            self.entries.labels(tier.value).set(n)
        self.index_evictions.set(index.evictions)
        for op, n in index.store_failures.items():
            self.store_failures.labels(op).set(n)
        for worker, n in index.overpredicted.items():
            self.overpredicted.labels(worker).set(n)
        for (pool, tier_name), nbytes in bytes_by_pool_tier.items():
            self.bytes.labels(pool, tier_name).set(nbytes)
        for w in workers:
            self.in_flight.labels(w.name).set(w.load.in_flight)
            self.healthy.labels(w.name).set(1 if w.healthy else 0)
        if (tok := tokenizer_cache) is not None:
            self.tok_chunks.labels("hit").set(tok.hits)
            self.tok_chunks.labels("miss").set(tok.misses)
            self.tok_bytes.set(tok.bytes)
            self.tok_texts_bytes.set(tok.texts_bytes)
        engine, predicted = alert.window.engine(), alert.window.predicted()
        if engine is not None:
            self.hit_ratio.labels("engine").set(engine)
        if predicted is not None:
            self.hit_ratio.labels("predicted").set(predicted)
        self.alert.set(1 if alert.firing else 0)

    def refresh_health(
        self, workers: Iterable[Worker], health: Mapping[str, IndexHealthView], stats: Stats
    ) -> None:
        """Set the per-worker index health, breaker and hit gauges and the per-tenant ones."""
        for w in workers:
            name = w.name
            view = health.get(name)
            if view is not None:
                for state in _INDEX_STATES:
                    self.index_state.labels(name, state).set(1 if view.state == state else 0)
                self.index_aged_out.labels(name).set(view.aged_out)
                for kind in ("tokenizer", "block_size"):
                    self.parity_mismatch.labels(name, kind).set(
                        1 if view.reason == f"parity_{kind}" else 0
                    )
            state = w.breaker.state
            for each in _BREAKER_STATES:
                self.breaker_state.labels(name, each).set(1 if state == each else 0)
            self.breaker_trips.labels(name).set(w.breaker.trips)
            counts = stats.per_worker.get(name)
            if counts is not None:
                self.worker_tokens.labels(name, "prompt").set(counts.prompt_tokens)
                self.worker_tokens.labels(name, "predicted_cached").set(
                    counts.predicted_cached_tokens
                )
                self.worker_tokens.labels(name, "engine_cached").set(counts.engine_cached_tokens)
                self.worker_tokens.labels(name, "engine_prompt").set(
                    stats.engine_prompt_tokens(name)
                )
        self.tenant_tokens.clear()
        for namespace, t in stats.tenants.items():
            tenant = tenant_label(namespace)
            self.tenant_tokens.labels(tenant, "prompt").set(t.prompt_tokens)
            self.tenant_tokens.labels(tenant, "predicted_cached").set(t.predicted_cached_tokens)
            self.tenant_tokens.labels(tenant, "engine_cached").set(t.engine_cached_tokens)
            self.tenant_tokens.labels(tenant, "engine_prompt").set(t.engine_prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
