"""Placement strategies: formulas, knobs validation, guards."""

from __future__ import annotations

import pydantic
import pytest

from router.index import WorkerMatch
from router.strategies import (
    BUILTIN,
    KvReuse,
    LeastLoaded,
    NoCandidate,
    PrefixAffinity,
    RequestView,
    RoundRobin,
    TenantIsolated,
    WorkerLoad,
)
from warply.protocol import Tier

REQ = RequestView(keys=list(range(10)), prompt_tokens=160, block_size=16)


def _workers(*loads: int) -> list[WorkerLoad]:
    return [WorkerLoad(f"w{i}", in_flight=n, in_flight_tokens=100 * n) for i, n in enumerate(loads)]


def test_round_robin_and_least_loaded() -> None:
    rr = RoundRobin()
    assert [rr.choose(REQ, _workers(0, 0, 0), {}) for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    assert LeastLoaded().choose(REQ, _workers(3, 1, 2), {}) == "w1"


def test_prefix_affinity_prefers_longest_tier_weighted_prefix() -> None:
    s = PrefixAffinity()
    matches = {"w0": WorkerMatch(6, {Tier.SSD: 6}), "w1": WorkerMatch(4, {Tier.GPU: 4})}
    assert s.choose(REQ, _workers(1, 1), matches) == "w1"  # 4 * 1.0 > 6 * 0.25
    matches["w0"] = WorkerMatch(8, {Tier.GPU: 8})
    assert s.choose(REQ, _workers(1, 1), matches) == "w0"


def test_prefix_affinity_guard_and_overrides() -> None:
    s = PrefixAffinity(PrefixAffinity.Knobs(balance_abs=2, balance_rel=1.5))
    matches = {"w0": WorkerMatch(10, {Tier.GPU: 10})}
    assert s.choose(REQ, _workers(2, 1), matches) == "w0"
    assert s.choose(REQ, _workers(6, 1), matches) == "w1"  # imbalanced: load decides
    no_reuse = RequestView(REQ.keys, REQ.prompt_tokens, REQ.block_size, prefix_reuse=False)
    assert s.choose(no_reuse, _workers(2, 1), matches) == "w1"
    assert s.choose(REQ, _workers(2, 1), {}) == "w1"  # nothing cached anywhere


def test_prefix_affinity_new_conversations_split_evenly_then_by_load_then_credit() -> None:
    knobs = PrefixAffinity.Knobs(min_match_ratio=0.3)
    small = {"w1": WorkerMatch(2, {Tier.GPU: 2})}  # 2 of 10 blocks: below the floor
    s = PrefixAffinity(knobs)
    assert s.choose(REQ, _workers(1, 1), small) == "w1"  # nothing started yet: the holder
    assert s.choose(REQ, _workers(1, 3), small) == "w0"  # w1 started one conversation already
    assert s.choose(REQ, _workers(2, 1), small) == "w1"  # one each: lower load
    at_floor = {"w1": WorkerMatch(3, {Tier.GPU: 3})}  # 3 of 10: binds to the holder
    assert s.choose(REQ, _workers(1, 1), at_floor) == "w1"


def test_kv_reuse_counts_uncached_and_queued_prefill() -> None:
    s = KvReuse()  # defaults: queue_weight 0.5, decode_weight 0
    matches = {"w0": WorkerMatch(10, {Tier.GPU: 10})}
    # w0: (10 - 10) + 0.5 * 30 = 15 blocks of prefill; w1: 10 + 0 = 10 -> w1
    loads = [WorkerLoad("w0", pending_prefill_tokens=16 * 30), WorkerLoad("w1")]
    assert s.choose(REQ, loads, matches) == "w1"
    loads[0].pending_prefill_tokens = 16 * 10  # w0: 5 < 10
    assert s.choose(REQ, loads, matches) == "w0"


def test_kv_reuse_decode_pressure_when_weighted() -> None:
    s = KvReuse(KvReuse.Knobs(queue_weight=0, decode_weight=1))
    matches = {"w0": WorkerMatch(10, {Tier.GPU: 10})}
    # w0: 0 to prefill + 100/16 active; w1: 10 to prefill + 0 active.
    assert s.choose(REQ, [WorkerLoad("w0", 1, 100), WorkerLoad("w1")], matches) == "w0"
    # w0 busy with 400 tokens (25 blocks) > 10 blocks of prefill saved.
    assert s.choose(REQ, [WorkerLoad("w0", 2, 400), WorkerLoad("w1")], matches) == "w1"


def test_tenant_isolated_routes_within_the_tenant() -> None:
    s = TenantIsolated(TenantIsolated.Knobs(tenants={"a": ["w0"], "b": ["w1"]}))
    matches = {"w1": WorkerMatch(10, {Tier.GPU: 10})}
    req_a = RequestView(REQ.keys, REQ.prompt_tokens, REQ.block_size, namespace="a")
    assert s.choose(req_a, _workers(5, 0, 0), matches) == "w0"
    # A LoRA adapter's requests keep their tenant: the namespace is the salt plus the adapter.
    req_a_lora = RequestView(REQ.keys, REQ.prompt_tokens, REQ.block_size, namespace="a\0lora1")
    assert s.choose(req_a_lora, _workers(5, 0, 0), matches) == "w0"
    req_other = RequestView(REQ.keys, REQ.prompt_tokens, REQ.block_size, namespace="zzz")
    assert s.choose(req_other, _workers(0, 0, 0), matches) == "w2"
    with pytest.raises(NoCandidate):
        s.choose(req_a, [WorkerLoad("w1")], matches)


def test_knobs_are_validated_with_the_field_named() -> None:
    with pytest.raises(pydantic.ValidationError, match="balance_rel"):
        PrefixAffinity.Knobs(balance_rel=0.5)
    with pytest.raises(pydantic.ValidationError, match="unknown_knob"):
        KvReuse.Knobs(unknown_knob=1)  # type: ignore[call-arg]
    assert set(BUILTIN) == {
        "round_robin",
        "least_loaded",
        "prefix_affinity",
        "kv-reuse",
        "tenant_isolated",
    }


@pytest.mark.parametrize("name", ["least_loaded", "prefix_affinity", "kv-reuse"])
def test_equal_idle_workers_take_new_requests_in_turn(name: str) -> None:
    s = BUILTIN[name]()
    picks = [s.choose(REQ, _workers(0, 0, 0), {}) for _ in range(6)]
    assert sorted(picks) == ["w0", "w0", "w1", "w1", "w2", "w2"]
