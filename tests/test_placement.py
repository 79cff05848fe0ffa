"""Placement across pools (aggregated, and prefill / decode pairs with conditional
disaggregation) and the per-attempt load bookings, without HTTP (over the memory store nothing
suspends, so `completed` drives the coroutines)."""

from __future__ import annotations

import random

import pytest

from router import placement as placement_module
from router.config import IndexConfig, RouterConfig
from router.index import MemoryStore, PrefixIndex, completed
from router.index_health import IndexHealth
from router.metrics import RequestRecord
from router.placement import Placement
from router.strategies import NoCandidate
from router.token_cache import Lineage
from router.workers import Workers
from warply.protocol import BlockStored, prefix_keys

MODEL = "m"
TOKENS = list(range(100, 140))  # 40 tokens: 10 blocks of 4, 5 of 8


def _placement(**extra: object) -> tuple[Placement, PrefixIndex, Workers]:
    """Two pools with different block sizes, one worker each: a (4 tokens), b (8 tokens);
    `extra` sets fields of both pools (a's value, b's value) or of the router."""
    pools = [
        {"name": "p4", "block_size": 4, "workers": [{"name": "a", "url": "http://a"}]},
        {"name": "p8", "block_size": 8, "workers": [{"name": "b", "url": "http://b"}]},
    ]
    top = {}
    for key, value in extra.items():
        if isinstance(value, tuple):
            pools[0][key], pools[1][key] = value
        else:
            top[key] = value
    config = RouterConfig.model_validate(
        {"model": MODEL, "tokenizer": "/unused", "pools": pools, **top}
    )
    index = PrefixIndex(MODEL, MemoryStore())
    workers = Workers(config.pools)
    for w in workers.values():
        w.healthy = True
    return Placement(config, index, workers), index, workers


def _hold(index: PrefixIndex, worker: str, block_size: int, blocks: int, first: int) -> None:
    hashes = list(range(first, first + blocks))
    stored = BlockStored(hashes, None, TOKENS[: blocks * block_size], block_size)
    completed(index.apply(worker, [stored]))


def test_the_pool_whose_pick_holds_most_cached_tokens_wins() -> None:
    placement, index, _ = _placement()
    _hold(index, "a", 4, 2, 1)  # 8 tokens
    _hold(index, "b", 8, 2, 100)  # 16 tokens
    d = completed(placement.choose(TOKENS))
    assert (d.worker.name, d.matched_blocks, d.predicted_cached) == ("b", 2, 16)
    _hold(index, "a", 4, 6, 1)  # now 24 tokens, in 4-token blocks
    d = completed(placement.choose(TOKENS))
    assert (d.worker.name, d.matched_blocks, d.predicted_cached) == ("a", 6, 24)
    assert len(d.keys) == 10, "the key chain is the winning pool's (block size 4)"


def test_cost_aware_prefers_the_cheap_pool_until_its_queue_or_a_dear_hit_outweighs() -> None:
    """a costs 1/h, b 3/h, both prefill 1000 tokens/s; 40-token prompts."""
    placement, index, workers = _placement(
        strategy={"name": "cost_aware"}, price_per_hour=(1.0, 3.0),
        prefill_tokens_per_s=(1000.0, 1000.0),
    )  # fmt: skip
    assert completed(placement.choose(TOKENS)).worker.name == "a"
    workers["a"].load.pending_prefill_tokens = 200  # the cheap worker's queue: b is worth it
    assert completed(placement.choose(TOKENS)).worker.name == "b"
    workers["a"].load.pending_prefill_tokens = 0
    _hold(index, "b", 8, 4, 100)  # b holds 32 of 40 tokens: little compute left there
    d = completed(placement.choose(TOKENS))
    assert (d.worker.name, d.predicted_cached) == ("b", 32)
    assert completed(placement.choose(TOKENS, prefix_reuse=False)).worker.name == "a"


def test_cost_aware_needs_each_pools_prefill_speed() -> None:
    with pytest.raises(ValueError, match=r"pools.1.prefill_tokens_per_s: pool 'p8' needs it"):
        _placement(strategy={"name": "cost_aware"}, prefill_tokens_per_s=(1000.0, None))
    with pytest.raises(ValueError, match=r"pools.0.prefill_tokens_per_s"):  # a pool's own
        _placement(strategy=({"name": "cost_aware"}, None), prefill_tokens_per_s=(None, 9.0))


def test_equal_cached_tokens_go_to_the_lower_load() -> None:
    placement, index, workers = _placement()
    _hold(index, "a", 4, 4, 1)  # 16 tokens
    _hold(index, "b", 8, 2, 100)  # 16 tokens
    workers["a"].load.in_flight = 1
    assert completed(placement.choose(TOKENS)).worker.name == "b"
    workers["a"].load.in_flight = 0
    workers["b"].load.engine_waiting = 2
    assert completed(placement.choose(TOKENS)).worker.name == "a"


def test_an_unavailable_pool_is_skipped() -> None:
    placement, index, workers = _placement()
    _hold(index, "b", 8, 4, 100)
    workers["b"].enabled = False  # drained
    assert completed(placement.choose(TOKENS)).worker.name == "a"


def test_a_booking_gives_back_exactly_what_it_took() -> None:
    _, _, workers = _placement()
    a = workers["a"]
    streamed = a.book(prompt_tokens=40, prefill_tokens=24)
    whole = a.book(prompt_tokens=10, prefill_tokens=10)
    assert (a.load.in_flight, a.load.in_flight_tokens, a.load.pending_prefill_tokens) == (2, 50, 34)
    streamed.progressed(1)  # first token: its prefill is done
    streamed.progressed(1)
    assert (a.load.in_flight_tokens, a.load.pending_prefill_tokens) == (52, 10)
    streamed.release()
    streamed.release()  # a second release changes nothing
    whole.release()
    assert (a.load.in_flight, a.load.in_flight_tokens, a.load.pending_prefill_tokens) == (0, 0, 0)


PD_TOKENS = list(range(100, 164))  # 64 tokens: 16 blocks of 4


def _pd_placement(
    threshold: int, both: bool = False, local_by: str = "threshold", **pd: object
) -> tuple[Placement, PrefixIndex, Workers]:
    pools = [
        {"name": "pre", "role": "prefill", "block_size": 4,
         "workers": [{"name": "p0", "url": "http://p0"}, {"name": "p1", "url": "http://p1"}]},
        {"name": "dec", "role": "decode", "block_size": 4,
         "workers": [{"name": "d0", "url": "http://d0"}, {"name": "d1", "url": "http://d1"}]},
    ]  # fmt: skip
    if both:
        pools.append({"name": "agg", "block_size": 4, "workers": [{"name": "a", "url": "http://a"}]})
    config = RouterConfig.model_validate(
        {"model": "m", "tokenizer": "/unused", "pools": pools,
         "pd": {"local_prefill_tokens": threshold, "local_prefill_by": local_by, **pd}}
    )  # fmt: skip
    index = PrefixIndex("m", MemoryStore())
    workers = Workers(config.pools)
    for w in workers.values():
        w.healthy = True
    return Placement(config, index, workers), index, workers


def _pd_hold(index: PrefixIndex, worker: str, blocks: int, first: int) -> None:
    stored = BlockStored(list(range(first, first + blocks)), None, PD_TOKENS[: blocks * 4], 4)
    completed(index.apply(worker, [stored]))


def test_prefill_by_cached_prefix_and_decode_by_what_it_holds() -> None:
    placement, index, _ = _pd_placement(threshold=16)
    _pd_hold(index, "p1", 10, 1)  # p1 holds 40 tokens of the prompt
    _pd_hold(index, "d1", 4, 100)  # d1 holds 16 tokens
    d = completed(placement.choose(PD_TOKENS))
    assert d.mode == "remote" and d.worker.name == "d1" and d.prefill is not None
    assert d.prefill.worker.name == "p1" and d.prefill.predicted_cached == 40
    assert d.predicted_cached == 16 and d.missing_tokens == 48
    assert d.reported_cached == 40, "the client's cached tokens: what no engine computed"
    assert d.prefill_tokens == 0 and d.prefill.prefill_tokens == 24
    # a later turn that d1 holds nearly whole is prefilled there (conditional disaggregation)
    _pd_hold(index, "d1", 13, 100)  # 52 tokens held, 12 missing < 16
    d = completed(placement.choose(PD_TOKENS))
    assert (d.mode, d.local_reason, d.worker.name) == ("local", "below_threshold", "d1")
    assert d.prefill is None and d.prefill_tokens == 12 and d.reported_cached == 52


def test_cost_prefills_on_decode_when_its_first_token_comes_sooner() -> None:
    """`local_prefill_by: cost`: local when decode's queued prefill + missing tokens is no more
    than the prefill pick's queued prefill + its missing tokens (transfer weights 0 here)."""
    placement, index, workers = _pd_placement(threshold=0, local_by="cost")
    _pd_hold(index, "p1", 10, 1)  # p1 misses 24 tokens
    _pd_hold(index, "d1", 4, 100)  # d1 misses 48
    d = completed(placement.choose(PD_TOKENS))
    assert (d.mode, d.worker.name) == ("remote", "d1") and d.prefill is not None
    assert d.prefill.worker.name == "p1"
    workers["p1"].load.pending_prefill_tokens = 30  # p1's first token: 30 + 24 > 48
    d = completed(placement.choose(PD_TOKENS))
    assert (d.mode, d.local_reason, d.worker.name) == ("local", "cheaper_local", "d1")
    assert d.prefill_tokens == 48 and d.reported_cached == 16
    workers["d1"].load.pending_prefill_tokens = 10  # now 10 + 48 > 54: handed off again
    assert completed(placement.choose(PD_TOKENS)).mode == "remote"


def test_a_prefill_worker_answers_whole_when_the_strategy_picks_it() -> None:
    """`pd.prefill_answers`: the prefill workers join the decode pool's candidates, so the
    strategy (the default, adaptive) weighs a prefill worker holding more of the prompt against
    the decode workers as among aggregated workers; one buried in queued prefill loses to a
    decode worker, which then hands off or prefills by the usual rule."""
    placement, index, workers = _pd_placement(threshold=0, prefill_answers=True)
    _pd_hold(index, "p1", 10, 1)  # p1 misses 24 tokens
    _pd_hold(index, "d1", 4, 100)  # d1 misses 48
    seen = completed(placement.explain(PD_TOKENS))  # the decode pool's scores name all four
    assert seen.decision is not None and seen.decision.mode == "on_prefill"
    (dec,) = [p for p in seen.pools if p.pool == "dec"]
    assert dec.pick == "p1" and set(dec.scores) == {"d0", "d1", "p0", "p1"}
    d = completed(placement.choose(PD_TOKENS))
    assert (d.mode, d.worker.name, d.prefill, d.local_reason) == ("on_prefill", "p1", None, "")
    assert d.prefill_tokens == 24 and d.reported_cached == 40
    workers["p1"].load.pending_prefill_tokens = 10_000
    d = completed(placement.choose(PD_TOKENS))
    assert (d.mode, d.worker.name) == ("remote", "d1") and d.prefill is not None
    off, index, workers = _pd_placement(threshold=0)
    _pd_hold(index, "p1", 10, 1)
    assert completed(off.choose(PD_TOKENS)).mode == "remote", "off by default"


def test_no_prefill_worker_means_local_prefill() -> None:
    placement, _, workers = _pd_placement(threshold=0)
    workers["p0"].enabled = workers["p1"].enabled = False
    d = completed(placement.choose(PD_TOKENS))
    assert (d.mode, d.local_reason) == ("local", "no_prefill_worker")
    with pytest.raises(NoCandidate):  # no decode worker: nothing answers, prefill or not
        completed(placement.choose(PD_TOKENS, exclude={"d0", "d1"}))


def test_aggregated_workers_beside_a_pd_pair() -> None:
    placement, index, workers = _pd_placement(threshold=0, both=True)
    _pd_hold(index, "a", 8, 1)  # the aggregated worker holds the most: it serves alone
    d = completed(placement.choose(PD_TOKENS))
    assert (d.mode, d.worker.name) == ("aggregated", "a")
    _pd_hold(index, "d0", 12, 100)  # now a decode worker holds more: hand-off (prefill by cache)
    d = completed(placement.choose(PD_TOKENS))
    assert (d.mode, d.worker.name) == ("remote", "d0")
    workers["d0"].enabled = workers["d1"].enabled = False
    assert completed(placement.choose(PD_TOKENS)).worker.name == "a"


def test_a_worker_is_lost_when_it_refuses_or_stays_unhealthy() -> None:
    _, _, workers = _placement()
    a = workers["a"]
    assert not a.lost(0)
    a.set_health(False)  # a probe timed out: maybe only a busy machine
    assert a.lost(0) and not a.lost(60)
    a.set_health(False, refused=True)  # nothing listens on its port: gone
    assert a.lost(60)
    a.set_health(True)
    assert not a.lost(0) and a.unhealthy_since is None and not a.refused


def test_slow_probes_take_a_worker_out_only_in_a_row() -> None:
    _, _, workers = _placement()
    a = workers["a"]
    a.probed(False, False, unhealthy_after=2)  # one slow probe: still placed
    assert a.healthy and a.failed_probes == 1
    a.probed(True, False, unhealthy_after=2)
    a.probed(False, False, unhealthy_after=2)
    assert a.healthy, "not in a row"
    a.probed(False, False, unhealthy_after=2)
    assert not a.healthy and not a.refused
    a.probed(True, False, unhealthy_after=2)
    assert a.healthy and a.failed_probes == 0
    a.probed(False, True, unhealthy_after=2)  # nothing listens: out at once
    assert not a.healthy and a.refused


def test_explain_shows_both_legs_of_a_handoff_and_books_nothing() -> None:
    placement, index, workers = _pd_placement(threshold=16)
    _pd_hold(index, "p1", 10, 1)
    _pd_hold(index, "d1", 4, 100)
    seen = completed(placement.explain(PD_TOKENS))
    d = seen.decision
    assert d is not None and seen.unavailable == ""
    assert (d.mode, d.worker.name, d.prefill.worker.name if d.prefill else None) == (
        "remote", "d1", "p1"
    )  # fmt: skip
    dec, pre = seen.pools  # the pools that answer clients first, then the prefill pools
    assert (pre.pool, pre.role, pre.pick, dec.pool, dec.role, dec.pick) == (
        "pre", "prefill", "p1", "dec", "decode", "d1"
    )  # fmt: skip
    assert {w: m.blocks for w, m in pre.held.items()} == {"p0": 0, "p1": 10}
    assert {w: m.blocks for w, m in dec.held.items()} == {"d0": 0, "d1": 4}
    assert set(pre.scores) == {"p0", "p1"} and set(dec.scores) == {"d0", "d1"}
    assert all(w.load.in_flight == 0 for w in workers.values())
    # the same choice, now made for real
    real = completed(placement.choose(PD_TOKENS))
    assert (real.worker.name, real.prefill.worker.name if real.prefill else None) == ("d1", "p1")


def test_explain_gives_each_pool_the_chain_of_its_block_size() -> None:
    """The chosen pool's chain is the decision's own; the other pool's is its own size's."""
    placement, index, _ = _placement()
    _hold(index, "a", 4, 6, 1)
    seen = completed(placement.explain(TOKENS))
    assert seen.decision is not None and seen.decision.worker.name == "a"
    assert [(t.pool, list(t.keys)) for t in seen.pools] == [
        ("p4", prefix_keys(TOKENS, 4, MODEL, "")), ("p8", prefix_keys(TOKENS, 8, MODEL, ""))
    ]  # fmt: skip
    assert seen.pools[0].keys is seen.decision.keys


def test_an_early_placed_prompt_made_whole_lets_the_next_turn_hash_only_new_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After an early choice from a prompt's leading part, `whole` extends its kept chains: the
    next turn's chain equals a fresh one, and hashing it covers only the tokens past the first
    prompt (the decision's own chain is left as it was)."""
    placement, _, _ = _placement()
    first, turn = TOKENS + list(range(200, 224)), TOKENS + list(range(200, 236))
    lineage = Lineage(1, 0, 0)
    early = completed(placement.choose_early(first[:12], len(first), "", True, (), lineage))
    assert early is not None and len(early.keys) == 12 // early.worker.pool.block_size
    placement.whole(first, "", lineage)
    hashed: list[int] = []
    real = placement_module.chain_keys

    def counted(tokens: list[int], block_size: int, seed: int) -> list[int]:
        hashed.append(len(tokens))
        return real(tokens, block_size, seed)

    monkeypatch.setattr(placement_module, "chain_keys", counted)
    for bs in (4, 8):
        assert placement.keys(turn, bs, "", Lineage(2, 1, len(first))) == prefix_keys(
            turn, bs, MODEL, ""
        )
    assert hashed == [len(turn) - len(first)] * 2
    assert len(early.keys) == 12 // early.worker.pool.block_size


def test_a_next_turn_extends_the_earlier_chain_and_equals_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chains extended from an earlier prompt's (any shared length, any namespace, the earlier
    chain kept or dropped) equal chains hashed from the start; kept keys stay under the cap."""
    monkeypatch.setattr(placement_module, "CHAIN_KEYS", 200)
    placement, _, _ = _placement()
    rng = random.Random(3)
    turn: list[int] = []
    common = 0  # leading tokens this turn shares with the one before
    for ident in range(1, 60):
        if not turn:
            turn = [rng.randrange(1000) for _ in range(40)]
        shared = common if rng.random() < 0.8 else rng.randrange(common + 1)
        lineage = Lineage(ident, ident - 1, shared)
        for bs in (4, 8):
            for ns in ("", "tenant"):
                want = prefix_keys(turn, bs, MODEL, ns)
                assert placement.keys(turn, bs, ns, lineage) == want
        assert placement._chain_keys <= 200
        common = rng.randrange(len(turn) + 1)
        turn = turn[:common] + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]


def test_a_decision_keeps_what_the_index_predicted_before_health_cut_it() -> None:
    """A worker whose evictions lag is placed on its cut match, and the decision keeps the
    index's own prediction beside it: the engine's report is checked against that one (the
    over-prediction counted, the shortfall measured) while the caution is on."""
    placement, index, _ = _placement()
    health = IndexHealth(IndexConfig(degraded_s=60))
    health.joined("a", has_stream=True)
    placement.health = health
    _hold(index, "a", 4, 8, 1)  # 32 tokens
    d = completed(placement.choose(TOKENS))
    assert (d.worker.name, d.predicted_cached, d.index_cached) == ("a", 32, 32)
    # a quarter held: now degraded, a quarter kept
    health.observe(RequestRecord(d, status=200, latency_s=0.01, cached=8))
    d = completed(placement.choose(TOKENS))
    assert (d.matched_blocks, d.predicted_cached, d.index_cached) == (2, 8, 32)
