"""Placement strategies: formulas, knobs validation, guards."""

from __future__ import annotations

import pydantic
import pytest

from router.index import WorkerMatch
from router.strategies import (
    BUILTIN,
    AdaptiveAffinity,
    CostAware,
    KvReuse,
    LeastLoaded,
    NoCandidate,
    Pick,
    PrefixAffinity,
    RequestView,
    RoundRobin,
    TenantIsolated,
    TierWeights,
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
    s = PrefixAffinity(PrefixAffinity.Knobs(tier_weights=TierWeights(ssd=0.25)))
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
        "adaptive",
        "round_robin",
        "least_loaded",
        "prefix_affinity",
        "kv-reuse",
        "tenant_isolated",
        "cost_aware",
    }
    with pytest.raises(pydantic.ValidationError, match="ttft_target_ms"):
        CostAware.Knobs(ttft_target_ms=0)


@pytest.mark.parametrize("name", ["least_loaded", "prefix_affinity", "kv-reuse", "adaptive"])
def test_equal_idle_workers_take_new_requests_in_turn(name: str) -> None:
    s = BUILTIN[name]()
    picks = [s.choose(REQ, _workers(0, 0, 0), {}) for _ in range(6)]
    assert sorted(picks) == ["w0", "w0", "w1", "w1", "w2", "w2"]


# ---- adaptive (the default) ----------------------------------------------------------------

LONG = RequestView(keys=list(range(100, 164)), prompt_tokens=64 * 16, block_size=16)
"""64 blocks of 16 tokens: two 512-token checkpoints (depths 32 and 64)."""


def _idle(*queued: int) -> list[WorkerLoad]:
    return [WorkerLoad(f"w{i}", pending_prefill_tokens=q) for i, q in enumerate(queued)]


def test_adaptive_cost_formula_prices_waiting_against_recomputing() -> None:
    # REQ: 160 tokens, all cached on w0 (u = 0); on w1 u = 160 = u(w1) - u*. Fresh state:
    # pi = 0, h = 1, typical work = one block (16 tokens) so n(w) = q(w) / 16.
    # cost(w0) = q0;  cost(w1) = q1 + 160 + (q1/16 + duplicate_floor 8) * 160.
    held = {"w0": WorkerMatch(10, {Tier.GPU: 10})}
    assert AdaptiveAffinity().choose(REQ, _idle(1400, 0), held) == "w0"  # 1400 < 1440
    assert AdaptiveAffinity().choose(REQ, _idle(1500, 0), held) == "w1"  # 1500 > 1440
    # Recomputing on a busy worker costs more: w1 with 160 queued -> 160 + 160 + 18 * 160.
    assert AdaptiveAffinity().choose(REQ, _idle(3100, 160), held) == "w0"
    assert AdaptiveAffinity().choose(REQ, _idle(3300, 160), held) == "w1"
    # The knobs are the formula's: no duplication price -> cost(w1) = 160, 160 < 200.
    free = AdaptiveAffinity(AdaptiveAffinity.Knobs(duplicate_floor=0))
    assert free.choose(REQ, _idle(200, 0), held) == "w1"
    # Fixed knobs (no adaptation): X = duplicate_floor whatever the destination's queue.
    fixed = AdaptiveAffinity.Knobs(adapt=False)
    assert AdaptiveAffinity(fixed).choose(REQ, _idle(1500, 160), held) == "w0"  # < 160+160+1280
    assert AdaptiveAffinity(fixed).choose(REQ, _idle(1700, 160), held) == "w1"  # > 1600
    # A request that may not reuse goes by load alone.
    no_reuse = RequestView(REQ.keys, REQ.prompt_tokens, REQ.block_size, prefix_reuse=False)
    assert AdaptiveAffinity().choose(no_reuse, _idle(600, 0), held) == "w1"


def test_adaptive_one_hot_worker_does_not_turn_affinity_off_for_the_others() -> None:
    # w0 is swamped; w1 holds this conversation with a short queue; w2 is idle. Fleet-wide
    # guards (prefix_affinity, sglang cache_aware) send everything to the least loaded now.
    loads = [
        WorkerLoad("w0", in_flight=40, pending_prefill_tokens=50_000),
        WorkerLoad("w1", in_flight=2, pending_prefill_tokens=100),
        WorkerLoad("w2"),
    ]
    held = {"w1": WorkerMatch(10, {Tier.GPU: 10})}
    guarded = PrefixAffinity(PrefixAffinity.Knobs(balance_abs=4, balance_rel=1.5))
    assert guarded.choose(REQ, loads, held) == "w2"
    assert AdaptiveAffinity().choose(REQ, loads, held) == "w1"


def test_adaptive_corrects_skew_the_load_guard_cannot_see() -> None:
    # Four requests in flight, split 3/1: the guard (spread > 4) never fires, so prefix
    # affinity keeps the conversation on the worker whose prefill queue is long.
    loads = [
        WorkerLoad("w0", in_flight=3, pending_prefill_tokens=3 * 4096),
        WorkerLoad("w1", in_flight=1),
    ]
    held = {"w0": WorkerMatch(2, {Tier.GPU: 2})}  # 2 of 10 blocks cached on w0
    assert PrefixAffinity().choose(REQ, loads, held) == "w0"
    assert AdaptiveAffinity().choose(REQ, loads, held) == "w1"


@pytest.mark.parametrize("balance", [3.0, 0.0])
def test_adaptive_new_conversations_go_where_less_work_was_routed(balance: float) -> None:
    s = AdaptiveAffinity(AdaptiveAffinity.Knobs(balance=balance))
    part = {"w0": WorkerMatch(5, {Tier.GPU: 5})}  # half cached on w0: 80 uncached tokens
    for _ in range(3):
        assert s.choose(REQ, _idle(0, 0), part) == "w0"
    share = s.worker_gauges()["routed_share"]
    assert share["w0"] == 2.0 and share["w1"] == 0.0  # all recent work went to w0
    # s(w0) = 2 * 80 * (1 - d)(1 + d + d^2) with d = 1 - 1/32: 14.5 tokens, times balance.
    # A new conversation (nothing cached anywhere), w1 with a short queue of 30 tokens:
    # balance 3 -> cost(w0) = 160 + 43.6 > cost(w1) = 30 + 160; balance 0 -> w0 (no queue).
    expected = "w1" if balance else "w0"
    assert s.choose(REQ, _idle(0, 30), {}) == expected
    # Equal costs: the less-routed worker, not the next in turn.
    assert s.choose(REQ, _idle(0, 0), {}) == "w1"


@pytest.mark.parametrize(("count_weight", "expected"), [(0.0, ["w1", "w1"]), (1.0, ["w1", "w0"])])
def test_adaptive_count_weight_balances_conversations_not_only_tokens(
    count_weight: float, expected: list[str]
) -> None:
    # A 160-token new conversation goes to w0, then two 16-token ones arrive (idle workers,
    # so s(w) alone decides; decay d = 1 - 1/32). By tokens, w1 is still owed work after the
    # first short one. By count, each placement adds u-bar (160, then 160d + 16(1 - d) =
    # 155.5), and w0's 160 decayed once (155.0) is the smaller: the conversations alternate.
    short = RequestView(keys=[7], prompt_tokens=16, block_size=16)
    s = AdaptiveAffinity(AdaptiveAffinity.Knobs(count_weight=count_weight))
    assert s.choose(REQ, _idle(0, 0), {}) == "w0"
    assert [s.choose(short, _idle(0, 0), {}) for _ in range(2)] == expected


def test_adaptive_replicates_a_hot_shared_prefix_but_keeps_a_private_one() -> None:
    held = {"w0": WorkerMatch(10, {Tier.GPU: 10})}
    private = AdaptiveAffinity()
    assert private.choose(REQ, _idle(400, 0), held) == "w0"  # 400 < 160 + 3 * 160
    hot = AdaptiveAffinity()
    for _ in range(9):  # nine earlier requests whose longest cached prefix ended at key 9
        assert hot.choose(REQ, _idle(0, 0), held) == "w0"
    # h ≈ 8.9 (decayed a little): duplicate price 8 / 8.9; w0's queue exceeds w1's by more than
    # one typical request, so w1 is charged a = h^-0.5 of the recompute: ≈ (0.34 + 0.9) * 160.
    assert hot.choose(REQ, _idle(400, 0), held) == "w1"
    assert hot.gauges()["spills"] == 1 and hot.gauges()["spill_tokens"] == 160


@pytest.mark.parametrize(
    ("knobs", "expected"), [({}, "w1"), ({"amortize": 0.0}, "w0"), ({"adapt": False}, "w0")]
)
def test_adaptive_charges_part_of_copying_a_hot_prefix_whose_holder_is_queued(
    knobs: dict[str, object], expected: str
) -> None:
    # Nine requests made key 9 hot (h ≈ 8.9); its holder w0 now has 300 tokens queued, w1 none.
    # Charged all of the recompute, cost(w1) = 160 + (8 / 8.9) * 160 ≈ 304 > 300: stay queued.
    # By default the copy also serves the requests after it: a = 8.9^-0.5, cost(w1) ≈ 197.
    s = AdaptiveAffinity(AdaptiveAffinity.Knobs.model_validate(knobs))
    held = {"w0": WorkerMatch(10, {Tier.GPU: 10})}
    for _ in range(9):
        s.choose(REQ, _idle(0, 0), held)
    assert s.choose(REQ, _idle(300, 0), held) == expected


def test_adaptive_next_turn_checkpoints_only_its_new_blocks() -> None:
    # Three checkpoints remembered, one every 32 blocks. A's next turn refreshes its deepest
    # checkpoint and adds its new one, leaving A's early checkpoint to age: B's checkpoint
    # outlives it, so B's return is still measured (refreshing A's whole history each turn
    # would push B's out instead, and cost every turn time in proportion to the history).
    s = AdaptiveAffinity(AdaptiveAffinity.Knobs(memory=3))
    a, b = list(range(1000, 1096)), list(range(2000, 2032))

    def view(keys: list[int]) -> RequestView:
        return RequestView(keys=keys, prompt_tokens=len(keys) * 16, block_size=16)

    s.choose(view(a[:64]), _idle(0, 0), {})  # A's checkpoints at 32 and 64
    s.choose(view(b), _idle(0, 0), {})  # B's at 32
    s.choose(view(a), _idle(0, 0), {"w0": WorkerMatch(64, {Tier.GPU: 64})})  # A's at 96
    assert s.eviction_loss == 0  # A came back for 64 blocks and found them
    s.choose(view(b), _idle(0, 0), {})  # B comes back for 32 blocks, held nowhere
    assert s.eviction_loss > 0


def test_adaptive_measures_eviction_loss_and_raises_the_duplication_price() -> None:
    s = AdaptiveAffinity()
    k = s.knobs
    assert isinstance(k, AdaptiveAffinity.Knobs)
    assert s.choose(LONG, _idle(0, 0), {}) in {"w0", "w1"}  # checkpoints at 32 and 64 stored
    assert s.eviction_loss == 0 and s.duplicate_price() == k.duplicate_floor
    s.choose(LONG, _idle(0, 0), {})  # back for 64 blocks, none held anywhere: all lost
    assert s.eviction_loss == 1
    assert s.gauges()["duplicate_price"] == k.duplicate_floor + k.eviction_gain
    s.choose(LONG, _idle(0, 0), {"w1": WorkerMatch(64, {Tier.GPU: 64})})  # all found
    assert 0.4 < s.eviction_loss < 0.6  # decayed: lost 64·d / asked (64·d + 64)
    gauges = s.gauges()
    assert set(gauges) == {
        "eviction_loss",
        "duplicate_price",
        "queue_depth",
        "work_per_request_tokens",
        "placements",
        "spills",
        "spill_tokens",
    }
    assert gauges["placements"] == 3
    # Bounded: the price never exceeds floor + gain, whatever the measurements.
    assert s.duplicate_price() <= k.duplicate_floor + k.eviction_gain
    fixed = AdaptiveAffinity(AdaptiveAffinity.Knobs(adapt=False))
    for _ in range(2):
        fixed.choose(LONG, _idle(0, 0), {})
    assert fixed.eviction_loss == 1 and fixed.duplicate_price() == k.duplicate_floor


def test_adaptive_is_the_default() -> None:
    from router.config import StrategyConfig

    assert StrategyConfig().name == AdaptiveAffinity.name == "adaptive"
    assert BUILTIN["adaptive"] is AdaptiveAffinity
    with pytest.raises(pydantic.ValidationError, match="eviction_gain"):
        AdaptiveAffinity.Knobs(eviction_gain=-1)


def _priced(name: str, price: float, rate: float = 1000.0, queued: int = 0) -> WorkerLoad:
    return WorkerLoad(name, pending_prefill_tokens=queued, price_per_hour=price,
                      prefill_tokens_per_s=rate)  # fmt: skip


def test_cost_aware_weighs_price_against_wait() -> None:
    """cost(w) = price(w)·miss(w)/R(w) + latency_weight·p̄·wait(w), p̄ = mean price = 2 here.
    REQ: 160 tokens, none cached. cheap: 1·0.16 + 2·(q + 160)/1000; dear: 3·0.16 + 2·0.16."""
    s = CostAware()
    idle = [_priced("cheap", 1), _priced("dear", 3)]
    assert s.choose(REQ, idle, {}) == "cheap"  # 0.48 vs 0.80
    # 200 tokens queued on the cheap worker: 0.16 + 0.72 = 0.88 > 0.80
    assert s.choose(REQ, [_priced("cheap", 1, queued=200), _priced("dear", 3)], {}) == "dear"
    # ...but 100 are not enough: 0.16 + 0.52 = 0.68 < 0.80
    assert s.choose(REQ, [_priced("cheap", 1, queued=100), _priced("dear", 3)], {}) == "cheap"
    # a cached prefix on the dear worker: 6 of 10 blocks → miss 64 tokens: 3·0.064 + 2·0.064
    held = {"dear": WorkerMatch(6, {Tier.GPU: 6})}
    assert s.choose(REQ, idle, held) == "dear"  # 0.32 < 0.48
    # latency_weight 0: price alone (the cheapest compute wins whatever its queue)
    s0 = CostAware(CostAware.Knobs(latency_weight=0))
    assert s0.choose(REQ, [_priced("cheap", 1, queued=10**6), _priced("dear", 3)], {}) == "cheap"


def test_cost_aware_ttft_guard() -> None:
    s = CostAware(CostAware.Knobs(latency_weight=0, ttft_target_ms=500))
    # the cheap worker would start in (400 + 160) / 1000 = 0.56 s > 0.5 s: the dear one
    assert s.choose(REQ, [_priced("cheap", 1, queued=400), _priced("dear", 3)], {}) == "dear"
    assert s.choose(REQ, [_priced("cheap", 1, queued=300), _priced("dear", 3)], {}) == "cheap"
    # both miss: the shorter wait
    late = [_priced("cheap", 1, queued=900), _priced("dear", 3, queued=1000)]
    assert s.choose(REQ, late, {}) == "cheap"
    late = [_priced("cheap", 1, queued=1000), _priced("dear", 3, queued=900)]
    assert s.choose(REQ, late, {}) == "dear"
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        s.choose(REQ, [WorkerLoad("unstated")], {})


def test_prefer_compares_pools_picks() -> None:
    """By default the most cached tokens, then the lower load; cost_aware by its cost."""
    small = RequestView(keys=list(range(5)), prompt_tokens=160, block_size=32)
    a = Pick(REQ, _priced("a", 1), WorkerMatch(0, {}), 0)
    b = Pick(small, _priced("b", 3), WorkerMatch(3, {Tier.GPU: 3}), 96)
    assert PrefixAffinity().prefer([a, b]) is b
    # b: miss 160 − 96 = 64 → 3·0.064 + 2·0.064 = 0.32; a: 1·0.16 + 2·0.16 = 0.48
    assert CostAware().prefer([a, b]) is b
    b = Pick(small, _priced("b", 3), WorkerMatch(1, {Tier.GPU: 1}), 32)  # miss 128: 0.64
    assert CostAware().prefer([a, b]) is a


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_preview_names_what_choose_picks_and_changes_nothing(name: str) -> None:
    """Over a random run of requests, each strategy's `preview` (the `/warply/where` path)
    names the worker its `choose` then picks, with one score per candidate it keeps; a twin
    instance that is never previewed picks the same workers, so previews leave no trace."""
    import random

    knobs = {"tenant_isolated": TenantIsolated.Knobs(tenants={"t": ["w0", "w2"]})}
    cls = BUILTIN[name]
    seen, twin = cls(knobs.get(name)), cls(knobs.get(name))
    rng = random.Random(7)
    tiers = [Tier.GPU, Tier.CPU, Tier.SSD]
    for step in range(300):
        n = rng.randint(1, 12)
        keys = [rng.randint(0, 5) * 100 + i for i in range(n)]
        namespace = rng.choice(["", "t"])
        request = RequestView(keys, 16 * n + 3, 16, namespace, prefix_reuse=step % 7 != 0)
        loads = [WorkerLoad(f"w{i}", in_flight=rng.randint(0, 3),
                            pending_prefill_tokens=rng.choice([0, 0, 64, 400]),
                            price_per_hour=1.0 + i, prefill_tokens_per_s=1000.0)
                 for i in range(3)]  # fmt: skip
        matches = {w.name: WorkerMatch(b, {rng.choice(tiers): b})
                   for w in loads if (b := rng.randint(0, n))}  # fmt: skip
        picked, scores = seen.preview(request, loads, matches)
        assert scores, f"{name} explains no scores"
        assert picked in scores
        assert seen.choose(request, loads, matches) == picked
        assert twin.choose(request, loads, matches) == picked
        if name == "tenant_isolated" and request.namespace == "t":
            assert set(scores) == {"w0", "w2"}
