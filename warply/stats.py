"""`cache_stats()`: the router's `/warply/cache_stats` (`warply.protocol.api.CacheStats`) as the
figures a user asks for first, typed; the full router view stays in `raw`."""

from __future__ import annotations

from collections import defaultdict

import msgspec

from warply.admin import call
from warply.protocol.api import CacheStats


class PoolFigures(msgspec.Struct, frozen=True):
    """One pool: the prompts its engines computed, their cache hits, bytes and evictions."""

    role: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens its engines reported cached (`usage.prompt_tokens_details`)."""
    hit_rate: float | None
    bytes_cached: int
    evictions: int
    handoffs: int
    """Decode pools: requests whose KV came from a prefill worker."""
    handoff_held_tokens: int
    """Of those, prompt tokens the decode worker already held (not transferred)."""


class CacheStatsView(msgspec.Struct, frozen=True):
    """Lifetime figures since the router started; ratios and latencies are None until measured."""

    hit_rate: float | None
    """Cached / prompt tokens as the engines report them."""
    predicted_hit_rate: float | None
    """The same, as the router's index predicted for the workers it chose."""
    requests: int
    prompt_tokens: int
    cached_tokens: int
    bytes_cached: int
    bytes_by_tier: dict[str, int]
    """KV bytes per tier (`gpu`: engine memory, `cpu`, `ssd`, `object_store`)."""
    bytes_by_pool: dict[str, int]
    evictions_by_pool: dict[str, int]
    """Blocks the engines reported removed."""
    affinity_map: dict[str, dict[str, int]]
    """Cache namespace (a request's `cache_key`; "" without one) → worker → requests it served."""
    ttft_p50: float | None
    ttft_p99: float | None
    """Time to first token at the router, seconds (recent window)."""
    router_overhead_p50: float | None
    router_overhead_p99: float | None
    """The router's own time per request (tokenize, place), seconds."""
    pools: dict[str, PoolFigures]
    raw: CacheStats

    def summary(self) -> str:
        """A few aligned lines for a terminal."""

        def pct(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:.1f}%"

        def ms(x: float | None) -> str:
            return "-" if x is None else f"{1e3 * x:.1f} ms"

        tiers = ", ".join(f"{t} {n / 1e6:.2f} MB" for t, n in sorted(self.bytes_by_tier.items()))
        lines = [
            f"requests            {self.requests} ({self.prompt_tokens} prompt tokens)",
            f"hit rate            {pct(self.hit_rate)} engine-reported, "
            f"{pct(self.predicted_hit_rate)} router-predicted",
            f"bytes cached        {self.bytes_cached / 1e6:.2f} MB ({tiers or 'none'})",
            f"TTFT p50 / p99      {ms(self.ttft_p50)} / {ms(self.ttft_p99)}",
            f"router overhead p50 {ms(self.router_overhead_p50)}",
        ]
        for name, pool in self.pools.items():
            lines.append(
                f"pool {name:<14} {pool.role}: {pool.requests} requests, hit rate "
                f"{pct(pool.hit_rate)}, {pool.bytes_cached / 1e6:.2f} MB, "
                f"{pool.evictions} evictions, {pool.handoffs} hand-offs"
            )
        for namespace, workers in self.affinity_map.items():
            served = ", ".join(f"{w} {n}" for w, n in sorted(workers.items()))
            lines.append(f"affinity {namespace or '(no cache_key)'!s:<11} {served}")
        return "\n".join(lines)


def view(stats: CacheStats) -> CacheStatsView:
    """The SDK's figures from the router's `CacheStats`."""
    affinity: dict[str, dict[str, int]] = defaultdict(dict)
    for entry in stats.affinity:
        served = affinity[entry.namespace]
        for worker, n in entry.workers.items():
            served[worker] = served.get(worker, 0) + n
    pools = {
        name: PoolFigures(
            role=p.role,
            requests=p.requests,
            prompt_tokens=p.prompt_tokens,
            cached_tokens=p.engine_cached_tokens,
            hit_rate=p.hit_rate,
            bytes_cached=stats.index.bytes_by_pool.get(name, 0),
            evictions=stats.evictions_by_pool.get(name, 0),
            handoffs=p.handoffs,
            handoff_held_tokens=p.handoff_held_tokens,
        )
        for name, p in stats.pools.items()
    }
    return CacheStatsView(
        hit_rate=stats.hit_rate.engine,
        predicted_hit_rate=stats.hit_rate.predicted,
        requests=stats.requests,
        prompt_tokens=stats.prompt_tokens,
        cached_tokens=stats.engine_cached_tokens,
        bytes_cached=stats.index.bytes_cached,
        bytes_by_tier=dict(stats.index.bytes_by_tier),
        bytes_by_pool=dict(stats.index.bytes_by_pool),
        evictions_by_pool=dict(stats.evictions_by_pool),
        affinity_map=dict(affinity),
        ttft_p50=stats.ttft_s.p50,
        ttft_p99=stats.ttft_s.p99,
        router_overhead_p50=stats.overhead_s.p50,
        router_overhead_p99=stats.overhead_s.p99,
        pools=pools,
        raw=stats,
    )


def fetch_cache_stats(
    router_url: str, token: str | None = None, timeout: float = 10
) -> CacheStatsView:
    """GET `/warply/cache_stats` from a router (with its admin token, if it has one)."""
    return view(call(router_url, "/warply/cache_stats", CacheStats, token=token, timeout=timeout))
