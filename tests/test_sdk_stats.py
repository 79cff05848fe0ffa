"""`cache_stats()`'s typed view of the router's `/warply/cache_stats` body."""

from __future__ import annotations

import msgspec

from warply.protocol.api import CacheStats
from warply.stats import view

BODY = {
    "strategy": "prefix_affinity", "requests": 5, "prompt_tokens": 1000, "placed_early": 0,
    "hit_rate": {"predicted": 0.4, "engine": 0.5, "window_predicted": None,
                 "window_engine": None},
    "predicted_cached_tokens": 400, "engine_cached_tokens": 500,
    "index": {"entries": 7, "entries_by_tier": {"gpu": 5, "cpu": 2}, "evictions": 0,
              "skipped": {}, "bytes_cached": 3000, "bytes_by_tier": {"gpu": 2000, "cpu": 1000},
              "bytes_by_pool": {"prefill": 1200, "decode": 1800}},
    "evictions_by_pool": {"decode": 3},
    "workers": {},
    "affinity": [
        {"namespace": "tenant:a", "first_block": "00000000000000aa", "workers": {"d-0": 2}},
        {"namespace": "tenant:a", "first_block": "00000000000000bb", "workers": {"d-0": 1,
                                                                                "d-1": 4}},
        {"namespace": "", "first_block": "00000000000000cc", "workers": {"d-1": 1}},
    ],
    "ttft_s": {"n": 3, "p50": 0.05, "p99": 0.2}, "overhead_s": {"n": 5, "p50": 0.001, "p99": 0.004},
    "tokenizer_cache": None, "alert": {"min_hit_ratio": 0.0, "firing": False},
    "pools": {"prefill": {"role": "prefill", "requests": 2, "prompt_tokens": 600,
                          "engine_cached_tokens": 0, "hit_rate": 0.0},
              "decode": {"role": "decode", "requests": 3, "prompt_tokens": 400,
                         "engine_cached_tokens": 500, "hit_rate": 1.25, "handoffs": 2,
                         "handoff_held_tokens": 64}},
}  # fmt: skip


def test_view_maps_the_routers_figures() -> None:
    stats = view(msgspec.convert(BODY, CacheStats))
    assert (stats.hit_rate, stats.predicted_hit_rate) == (0.5, 0.4)
    assert (stats.requests, stats.prompt_tokens, stats.cached_tokens) == (5, 1000, 500)
    assert stats.bytes_cached == 3000 and stats.bytes_by_tier == {"gpu": 2000, "cpu": 1000}
    assert stats.evictions_by_pool == {"decode": 3}
    assert stats.affinity_map == {"tenant:a": {"d-0": 3, "d-1": 4}, "": {"d-1": 1}}
    assert (stats.ttft_p50, stats.ttft_p99) == (0.05, 0.2)
    assert (stats.router_overhead_p50, stats.router_overhead_p99) == (0.001, 0.004)
    decode = stats.pools["decode"]
    assert (decode.bytes_cached, decode.evictions, decode.handoffs) == (1800, 3, 2)
    assert stats.pools["prefill"].evictions == 0 and stats.raw.strategy == "prefix_affinity"
    text = stats.summary()
    assert "hit rate            50.0% engine-reported, 40.0% router-predicted" in text
    assert "bytes cached        0.00 MB (cpu 0.00 MB, gpu 0.00 MB)" in text
    assert "affinity (no cache_key) d-1 1" in text
