"""P/D pools in the replay: the router's placement over prefill and decode engines, the KV
transfer, decode's own cache, conditional disaggregation, and the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest

from replay.__main__ import main
from replay.costmodel import ReferenceModel
from replay.pd import PdSettings
from replay.references import lru_reuse, pd_lru_reuse
from replay.sim import ReplayResult, SimPool, simulate_pools
from replay.trace import ExpandedTrace, TraceRequest
from router.config import PoolConfig, RouterConfig, WorkerConfig
from router.index import MemoryStore, PrefixIndex, completed
from router.placement import Placement
from router.strategies import CostAware, PrefixAffinity, RoundRobin, Strategy
from router.workers import Workers
from warply.protocol import BlockStored, prefix_keys

_KV = 1000  # bytes per token in these tests
_BLOCK = 512  # trace block (tokens per hash id)


def _turns(*blocks: int, gap_ms: float = 5000.0) -> ExpandedTrace:
    """One conversation: turn i has the first `blocks[i]` trace blocks of one chain."""
    reqs = [
        TraceRequest(i * gap_ms, n * _BLOCK, 4, tuple(range(1, n + 1)))
        for i, n in enumerate(blocks)
    ]
    return ExpandedTrace(reqs, _BLOCK, 64)


def _pd(
    trace: ExpandedTrace,
    threshold: int,
    prefill: Strategy | None = None,
    prefill_workers: int = 1,
    decode_workers: int = 2,
    bandwidth_gbps: float = 1.0,
    local_by: Literal["threshold", "cost"] = "threshold",
    drop_pulled: bool = False,
    prefill_answers: bool = False,
) -> ReplayResult:
    pools = [
        SimPool("p", "prefill", prefill_workers, prefill or PrefixAffinity()),
        SimPool("d", "decode", decode_workers, PrefixAffinity()),
    ]
    settings = PdSettings(
        local_prefill_tokens=threshold,
        local_prefill_by=local_by,
        drop_pulled=drop_pulled,
        prefill_answers=prefill_answers,
        bandwidth_gbps=bandwidth_gbps,
        kv_bytes_per_token=_KV,
    )
    return simulate_pools(trace, pools, "pd", pd=settings)


@pytest.mark.parametrize("block", [16, 64])
def test_placement_computes_the_traces_keys(block: int) -> None:
    reqs = [TraceRequest(0.0, 1300, 1, (5, 6, 7)), TraceRequest(1.0, 700, 1, (5, 9))]
    trace = ExpandedTrace(reqs, _BLOCK, block)
    for i in range(len(trace)):
        assert prefix_keys(trace.tokens(i), block, trace.model) == trace.keys[i]
    # Through the router's placement: a worker holding request 0's blocks matches all of them.
    pool = PoolConfig(
        name="w", block_size=block, workers=[WorkerConfig(name="w0", url="http://x")]
    )
    config = RouterConfig(model=trace.model, tokenizer=Path("."), pools=[pool])
    workers = Workers(config.pools)
    workers["w0"].set_health(True)
    index = PrefixIndex(trace.model, MemoryStore())
    n = len(trace.keys[0])
    tokens = [int(t) for t in trace.tokens(0, 0, n * block)]
    completed(index.apply("w0", [BlockStored(trace.keys[0], None, tokens, block)]))
    decision = completed(Placement(config, index, workers).choose(trace.tokens(0).tolist()))
    assert list(decision.keys) == trace.keys[0] and decision.matched_blocks == n


def test_a_later_turn_goes_back_to_its_decode_worker_and_moves_fewer_bytes() -> None:
    result = _pd(_turns(3, 5), threshold=0)
    first, second = result.served[0], result.served[1]
    assert (first.mode, second.mode) == ("remote", "remote")
    assert second.worker == first.worker  # the decode worker holding the conversation
    # Turn 1: decode holds nothing; turn 2: decode holds turn 1's 1,536 tokens.
    assert (first.moved_tokens, second.moved_tokens) == (1536, 2560 - 1536)
    assert (first.bytes_moved, second.bytes_moved) == (1536 * _KV, 1024 * _KV)
    # The client is told the prefill engine's reuse (turn 2 hits turn 1 there).
    req = {r.index: r for r in result.requests}
    assert (req[0].cached_tokens, req[1].cached_tokens) == (0, 1536)
    assert result.engines[first.worker].stats.prefill_tokens == 2  # one token per join


def test_remote_ttft_is_prefill_plus_transfer_plus_the_first_decode_step() -> None:
    result = _pd(_turns(3), threshold=0, bandwidth_gbps=1.0)
    (req,) = result.requests
    model, settings = ReferenceModel(), PdSettings()
    transfer = 1536 * _KV * 8 / 1e6 + settings.latency_ms  # ms at 1 Gbit/s
    expected = model.prefill_ms(1536) + transfer + model.prefill_ms(1)
    assert req.first_token - req.arrival == pytest.approx(expected)


def test_the_threshold_makes_short_misses_local() -> None:
    trace = _turns(4, 5)  # turn 2 misses 512 tokens on decode
    handed = _pd(trace, threshold=0)
    assert [handed.served[i].mode for i in (0, 1)] == ["remote", "remote"]
    local = _pd(trace, threshold=1024)
    first, second = local.served[0], local.served[1]
    assert (first.mode, second.mode) == ("remote", "local")
    assert second.bytes_moved == 0 and second.prefill_worker == ""
    assert second.worker == first.worker
    # The local prefill computed only what decode missed, and reports decode's hit.
    assert {r.index: r.cached_tokens for r in local.requests}[1] == 2048
    everything = _pd(trace, threshold=10**6)
    assert {s.mode for s in everything.served.values()} == {"local"}
    assert all(e.stats.passes == 0 for n, e in everything.engines.items() if n.startswith("p"))


def test_round_robin_prefill_spreads_prefill_and_loses_reuse() -> None:
    trace = _turns(2, 3, 4, 5)
    rr = _pd(trace, threshold=0, prefill=RoundRobin(), prefill_workers=2)
    affinity = _pd(trace, threshold=0, prefill_workers=2)
    assert {s.prefill_worker for s in rr.served.values()} == {"p0", "p1"}
    assert len({s.prefill_worker for s in affinity.served.values()}) == 1

    def reuse(result: ReplayResult) -> int:
        return sum(r.cached_tokens for r in result.requests)

    assert reuse(rr) < reuse(affinity)
    # Same decode placement: the decode side moves the same bytes.
    assert [s.bytes_moved for s in rr.served.values()] == [
        s.bytes_moved for s in affinity.served.values()
    ]


def test_pool_speed_scales_pass_times_and_busy_time_is_recorded() -> None:
    trace = _turns(16)

    def ttft_and_busy(speed: float) -> tuple[float, float]:
        pool = SimPool("w", "both", 1, RoundRobin(), speed=speed)
        result = simulate_pools(trace, [pool], "s")
        (req,) = result.requests
        return req.first_token - req.arrival, result.engines["w0"].stats.busy_ms

    (slow, slow_busy), (fast, fast_busy) = ttft_and_busy(1.0), ttft_and_busy(2.0)
    assert fast == pytest.approx(slow / 2) and fast_busy == pytest.approx(slow_busy / 2)
    assert fast_busy > 0


def _trace_file(tmp_path: Path) -> Path:
    lines = [
        {"timestamp": 400 * i, "input_length": 2048, "output_length": 4,
         "hash_ids": [0, 1 + i % 3, 4 + i % 3, 7 + i]}
        for i in range(9)
    ]  # fmt: skip
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_command_line_pd_replay_and_threshold_sweep(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["replay", str(_trace_file(tmp_path)), "--quiet", "-s", "prefix_affinity"]
    by = ["--pd-local-by", "threshold"]
    assert main([*args, "--pd", "1,2", "--pd-threshold", "0,100000", *by, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    handed, local = report["results"]
    assert (handed["deployment"], handed["strategy"]) == ("1P+2D", "prefix_affinity t=0")
    assert (handed["remote"], handed["local"], local["remote"]) == (9, 0, 0)
    assert handed["bytes_moved"] == handed["moved_tokens"] * report["pd"]["kv_bytes_per_token"]
    assert handed["bytes_moved"] > 0 == local["bytes_moved"]
    assert set(handed["busy_s"]) == {"p0", "d0", "d1"}
    assert main([*args, "--pd", "1,2", "--pd-prefill-strategy", "round_robin",
                 "--json", str(out)]) == 0  # fmt: skip
    (row,) = json.loads(out.read_text())["results"]
    assert row["strategy"] == "prefix_affinity+round_robin prefill"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pd", "4"], "--pd wants two worker counts"),
        (["--pd", "a,b"], "argument --pd: 'a' is not an integer"),
        (["--pd", "0,2"], "argument --pd: '0' must be > 0"),
        (["--pd", "2,2", "--workers", "4"], "not both"),
        (["--pd-threshold", "512"], "only apply to a P/D replay"),
        (["--kv-bytes-per-token", "8"], "only apply to a P/D replay"),
        (["--pd", "2,2", "--pd-threshold", "-1"], "argument --pd-threshold: '-1' must be >= 0"),
        (["--pd", "2,2", "--pd-threshold", "many"], "argument --pd-threshold: 'many' is not"),
        (["--pd", "2,2", "--pd-latency-ms", "-1"], "bad P/D settings:\n  latency_ms: Input"),
        (["--pd", "2,2", "--pd-prefill-strategy", "nope"], "unknown strategy 'nope'"),
    ],
)
def test_bad_pd_input_is_refused_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    try:  # refused at the flags (argparse) or after them (`UsageError`): exit code 2 either way
        code = main(["replay", str(_trace_file(tmp_path)), "--quiet", *args])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_pd_flags_are_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = capsys.readouterr().out
    for flag in ("--pd P,D", "--pd-threshold", "--pd-bandwidth-gbps", "--kv-bytes-per-token"):
        assert flag in text


def test_cost_aware_moves_work_to_the_cheap_pool_as_its_knob_says() -> None:
    """Two aggregated pools, the cheap one at half speed: price alone (latency_weight 0) sends
    every new conversation there; weighing waits sends some to the fast pool; a price-blind
    strategy ignores the price."""
    reqs = [
        TraceRequest(i * 50.0, 4 * _BLOCK, 4, tuple(range(100 * i, 100 * i + 4)))
        for i in range(40)
    ]  # 40 distinct 2048-token prompts, one every 50 ms
    trace = ExpandedTrace(reqs, _BLOCK, 64)

    def cheap_share(make: type[Strategy], **knobs: float) -> float:
        def strategy() -> Strategy:
            return make(make.Knobs(**knobs))

        pools = [
            SimPool("fast", "both", 2, strategy(), price_per_hour=4.0),
            SimPool("slow", "both", 2, strategy(), speed=0.5, price_per_hour=1.0),
        ]
        ranker = strategy() if make is CostAware else None
        result = simulate_pools(trace, pools, "cost", ranker=ranker)
        served = result.served.values()
        return sum(s.worker.startswith("slow") for s in served) / len(served)

    shares = [cheap_share(CostAware, latency_weight=w) for w in (0.0, 0.5, 4.0)]
    print("cheap pool's share by latency_weight 0 / 0.5 / 4:", shares)
    assert shares[0] == 1.0 > shares[1] > shares[2]
    assert cheap_share(PrefixAffinity) < shares[1]  # price-blind: the lower load wins


def test_cost_prefills_on_decode_unless_its_queue_makes_the_hand_off_sooner() -> None:
    """`pd.local_prefill_by: cost`: an idle decode worker prefills a new prompt itself (its
    first token comes no later than the hand-off's); a second prompt arriving while it still
    prefills the first goes to the idle prefill worker."""
    reqs = [TraceRequest(0.0, 20 * _BLOCK, 4, tuple(range(1, 21))),  # two 8,192-token passes
            TraceRequest(1.0, 8 * _BLOCK, 4, tuple(range(101, 109)))]  # fmt: skip
    trace = ExpandedTrace(reqs, _BLOCK, 64)
    cost = _pd(trace, threshold=0, decode_workers=1, local_by="cost")
    assert [cost.served[i].mode for i in (0, 1)] == ["local", "remote"]
    assert cost.served[1].prefill_worker == "p0" and cost.served[0].bytes_moved == 0
    by_threshold = _pd(trace, threshold=0, decode_workers=1)
    assert [by_threshold.served[i].mode for i in (0, 1)] == ["remote", "remote"]


def test_lru_per_role_reference() -> None:
    """`pd_lru_reuse`: all on one side is one LRU; split conversations reuse more without
    duplicates than with decode keeping what it pulled."""
    chains = [tuple(range(100 * c, 100 * c + t)) for t in (1, 2, 3) for c in range(1, 9)]
    reqs = [TraceRequest(float(i), len(k) * _BLOCK, 4, k) for i, k in enumerate(chains)]
    trace = ExpandedTrace(reqs, _BLOCK, 64)
    cap = 40  # engine blocks per role: five 512-token trace blocks
    assert pd_lru_reuse(trace, cap, cap, 0.0) == lru_reuse(trace, cap)
    assert pd_lru_reuse(trace, cap, cap, 1.0) == lru_reuse(trace, cap)
    kept, ideal = (pd_lru_reuse(trace, cap, cap, 0.5, keep) for keep in (True, False))
    assert 0 < kept < ideal


def test_the_no_duplicate_ideal_evicts_pulled_blocks_first() -> None:
    """`PdSettings.drop_pulled`: once a handed-off request ends, the decode engine's blocks of
    its prompt are the first it evicts, even though a local prompt was released before them."""
    reqs = [TraceRequest(0.0, _BLOCK, 1, (201,)),  # short: prefilled on decode, done first
            TraceRequest(1.0, 8 * _BLOCK, 4, tuple(range(101, 109)))]  # fmt: skip
    trace = ExpandedTrace(reqs, _BLOCK, 64)
    kept = _pd(trace, threshold=1000, decode_workers=1)
    ideal = _pd(trace, threshold=1000, decode_workers=1, drop_pulled=True)
    for result in (kept, ideal):
        assert [result.served[i].mode for i in (0, 1)] == ["local", "remote"]
    pulled = set(trace.keys[1])
    assert set(list(ideal.engines["d0"].lru)[: len(pulled)]) == pulled
    assert set(list(kept.engines["d0"].lru)[-len(pulled) :]) == pulled  # released last


def test_a_prefill_worker_answers_whole_while_decode_is_busy_and_keeps_the_conversation() -> None:
    """`pd.prefill_answers`: with the decode worker decoding a long answer, a new conversation
    is answered whole by the idle prefill worker (nothing moves P→D), and its next turn goes
    back there, reusing the history that worker's cache kept."""
    reqs = [TraceRequest(0.0, 8 * _BLOCK, 2000, tuple(range(1, 9))),  # decodes for seconds
            TraceRequest(100.0, 4 * _BLOCK, 4, tuple(range(101, 105))),
            TraceRequest(3000.0, 6 * _BLOCK, 4, tuple(range(101, 107)))]  # fmt: skip
    trace = ExpandedTrace(reqs, _BLOCK, 64)
    on = _pd(trace, threshold=0, decode_workers=1, local_by="cost", prefill_answers=True)
    modes = [(on.served[i].mode, on.served[i].worker) for i in range(3)]
    assert modes == [("local", "d0"), ("on_prefill", "p0"), ("on_prefill", "p0")]
    assert sum(s.bytes_moved for s in on.served.values()) == 0
    req = {r.index: r for r in on.requests}
    assert sorted(req) == [0, 1, 2] and req[2].generated == 4
    assert (req[1].cached_tokens, req[2].cached_tokens) == (0, 4 * _BLOCK)
    assert req[2].first_token > req[2].arrival == 3000.0
    off = _pd(trace, threshold=0, decode_workers=1, local_by="cost")  # all on the decode worker
    assert [(off.served[i].mode, off.served[i].worker) for i in range(3)] == [("local", "d0")] * 3


def test_the_prefill_answers_flag_needs_a_pd_replay_and_reaches_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["replay", str(_trace_file(tmp_path)), "--quiet", "-s", "adaptive"]
    assert main([*args, "--pd-prefill-answers"]) == 2
    assert "--pd-prefill-answers only apply to a P/D replay" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main([*args, "--pd", "1,2", "--pd-prefill-answers", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["remote"] + row["local"] + row["on_prefill"] == row["requests"]
