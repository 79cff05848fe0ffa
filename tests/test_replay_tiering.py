"""Tier directives in the replay: the simulated engine's tiers under pin / unpin / offload /
prefetch / evict, and a user policy run by the router's `TierRunner` over a replay."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.engine import EngineConfig, SimEngine, SimRequest
from replay.report import summarize
from replay.sim import SimPool, simulate_pools
from replay.trace import ExpandedTrace, TraceRequest, read_trace
from router.config import TieringConfig, TierPolicyConfig
from router.index import MemoryStore, completed
from router.strategies import PrefixAffinity
from warply.protocol import BlockRemoved, Directive, DirectiveKind, Tier, TierMoved

CONVERSATION = Path(__file__).parents[1] / "../shared/traces/mooncake/conversation_trace.jsonl"
PIN, UNPIN, OFFLOAD, PREFETCH, EVICT = (
    DirectiveKind.PIN, DirectiveKind.UNPIN, DirectiveKind.OFFLOAD, DirectiveKind.PREFETCH,
    DirectiveKind.EVICT,
)  # fmt: skip


def _served_engine(host_blocks: int) -> tuple[SimEngine, list[int]]:
    """An engine that served one 1024-token request (its 16 blocks idle on the GPU)."""
    trace = ExpandedTrace([TraceRequest(0.0, 1024, 1, (1, 2))], 512, 64)
    cfg = EngineConfig(num_blocks=40, block_size=64, watermark=0, host_blocks=host_blocks,
                       host_load_ms_per_token=0.01)  # fmt: skip
    engine = SimEngine("w0", trace.tokens, cfg)
    r = trace.requests[0]
    engine.enqueue(SimRequest(0, r.arrival_ms, r.input_length, r.output_length, trace.keys[0]))
    engine.advance(float("inf"))
    engine.events.clear()
    return engine, trace.keys[0]


def _do(engine: SimEngine, kind: DirectiveKind, keys: list[int], tier: Tier | None, **kw: float):  # type: ignore[no-untyped-def]
    return engine.apply(Directive(kind.value, kind, keys=keys, tier=tier, **kw), engine.now)


def test_pins_hold_blocks_and_offload_prefetch_evict_move_them() -> None:
    engine, keys = _served_engine(host_blocks=64)
    assert set(keys) <= set(engine.lru)
    ack = _do(engine, PIN, keys[:4], Tier.GPU)
    assert ack.applied and ack.blocks == 4
    assert all(engine.holders[k] == 1 and k not in engine.lru for k in keys[:4])
    assert engine.used_blocks == 4  # pinned blocks count as used, as vLLM's ref counts do
    assert _do(engine, OFFLOAD, keys, Tier.CPU).blocks == len(keys) - 4  # pinned ones stay
    assert set(keys[4:]) == set(engine.host) and not engine.lru
    assert engine.events[-1] == TierMoved(keys[4:], Tier.GPU, Tier.CPU)
    assert _do(engine, UNPIN, keys[:4], None).blocks == 4
    assert not engine.holders and list(engine.lru) == list(reversed(keys[:4]))

    before = engine.now
    ack = _do(engine, PREFETCH, keys, Tier.GPU)
    assert ack.blocks == len(keys) - 4 and not engine.host
    assert engine.events[-1] == TierMoved(keys[4:], Tier.CPU, Tier.GPU)
    assert engine.now == pytest.approx(before + 12 * 64 * 0.01)  # the host load, on its clock

    assert _do(engine, OFFLOAD, keys[8:], Tier.CPU).applied
    assert _do(engine, EVICT, keys, Tier.CPU).blocks == 8
    assert engine.events[-1] == BlockRemoved(keys[8:], Tier.CPU)
    assert _do(engine, EVICT, keys, None).blocks == 8 and not engine.cached_keys()


def test_directives_the_simulator_cannot_apply_are_rejected_with_the_reason() -> None:
    engine, keys = _served_engine(host_blocks=0)
    for kind, tier, extra, reason in [
        (OFFLOAD, Tier.CPU, {}, "no host tier"),
        (PIN, Tier.GPU, {"ttl_s": 5.0}, "until unpinned"),
        (PIN, Tier.CPU, {}, "gpu blocks only"),
    ]:
        ack = _do(engine, kind, keys, tier, **extra)
        assert not ack.applied and reason in ack.reason
    ack = engine.apply(Directive("q", DirectiveKind.QUOTA, namespace="a", quota_bytes=1), 0.0)
    assert not ack.applied and "canonical keys" in ack.reason
    engine, keys = _served_engine(host_blocks=8)
    ack = _do(engine, OFFLOAD, keys, Tier.SSD)
    assert not ack.applied and "only lower tier is cpu" in ack.reason


def test_a_user_policy_runs_over_the_replay_and_changes_its_outcome() -> None:
    if not CONVERSATION.exists():
        pytest.skip("shared traces not present")
    trace = ExpandedTrace(read_trace(CONVERSATION, limit=600), 512, 64)
    cfg = EngineConfig(num_blocks=2048, host_blocks=4096, host_load_ms_per_token=0.005)
    tiering = TieringConfig(
        policy=TierPolicyConfig(name="examples.tier_policies:KeepConversations"), interval_s=2
    )
    pools = [SimPool("w", "both", 4, PrefixAffinity())]
    plain = simulate_pools(trace, pools, "plain", cfg)
    tiered = simulate_pools(trace, pools, "tiered", cfg, tiering=tiering)

    assert plain.tiering is None and tiered.tiering is not None
    stats = tiered.tiering
    assert stats.policy == "keep_conversations" and stats.policy_failures == 0
    assert stats.rounds >= trace.requests[-1].arrival_ms / 1000 / 2 - 1
    assert stats.directives["pin"]["applied"] > 0 and stats.directives["unpin"]["applied"] > 0
    assert sum(e.stats.directive_blocks["pin"] for e in tiered.engines.values()) > 0
    a, b = summarize(plain), summarize(tiered)
    assert (a["reuse"], a["ttft_mean_ms"]) != (b["reuse"], b["ttft_mean_ms"])
    # The index still mirrors every engine's two tiers after the policy's moves.
    store = tiered.index.store
    assert isinstance(store, MemoryStore)
    gpu, cpu = 1 << list(Tier).index(Tier.GPU), 1 << list(Tier).index(Tier.CPU)
    for name, engine in tiered.engines.items():
        held = [(key, bits) for key, worker, bits in store.entries() if worker == name]
        assert {key for key, bits in held if bits & gpu} == engine.cached_keys()
        assert {key for key, bits in held if bits & cpu} == set(engine.host)
    assert not completed(tiered.index.stats()).skipped

    promote = TierPolicyConfig(
        name="examples.tier_policies:PromoteRecent", knobs={"hold_s": 600, "min_requests": 1}
    )
    promoted = simulate_pools(
        trace, pools, "promoted", cfg, tiering=TieringConfig(policy=promote, interval_s=2)
    )
    assert promoted.tiering is not None
    assert promoted.tiering.directives["prefetch"]["applied"] > 0
    assert sum(e.stats.directive_blocks["prefetch"] for e in promoted.engines.values()) > 0
