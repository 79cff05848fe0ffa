"""`warply bench replay`: command line, reports, and the baseline strategies."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import warply.common.loading as loading
from replay.__main__ import DEFAULT_STRATEGIES, UsageError, main, parse_strategy
from replay.baselines import DynamoKv, LlmdPrecise, SglangCacheAware
from router.index import WorkerMatch
from router.strategies import RequestView, RoundRobin, WorkerLoad

GSP = Path(__file__).parents[1] / "../shared/traces/sglang_gsp/gsp_default_blk16.jsonl"


def _trace_file(tmp_path: Path) -> Path:
    lines = [
        {
            "timestamp": 10 * i,
            "input_length": 1200,
            "output_length": 8,
            "hash_ids": [0, 1 + i % 3, 4 + i % 3],
        }
        for i in range(12)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _warply(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "warply", *args], capture_output=True, text=True, timeout=120
    )


def test_warply_bench_help_runs_the_replayer_in_a_subprocess() -> None:
    top = _warply("bench", "--help")
    assert top.returncode == 0 and "replay" in top.stdout
    sub = _warply("bench", "replay", "--help")
    assert sub.returncode == 0 and "--workers" in sub.stdout and "simulated" in sub.stdout
    live = _warply("bench", "live", "--help")
    assert live.returncode == 0 and "--speedup" in live.stdout


def test_warply_bench_replay_end_to_end(tmp_path: Path) -> None:
    trace = _trace_file(tmp_path)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    run = _warply(
        "bench", "replay", str(trace), "--trace-block", "512", "--workers", "2",
        "-s", "round_robin", "-s", 'pa=prefix_affinity:{"balance_abs": 2}',
        "--json", str(out), "--plot", str(png), "--quiet",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "infinite cache (bound)" in run.stdout and "pa" in run.stdout
    report = json.loads(out.read_text())
    assert [r["strategy"] for r in report["results"]] == ["round_robin", "pa"]
    assert report["engine"]["simulator"] and report["speedup"] == 1.0
    assert report["reuse_references"]["infinite cache (bound)"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_tier_policy_by_path_runs_in_the_replay(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    policy = "examples.tier_policies:KeepConversations"
    args = ["replay", str(_trace_file(tmp_path)), "--trace-block", "512", "--workers", "2",
            "-s", "prefix_affinity", "--quiet", "--host-blocks", "1024", "--speedup", "0.001",
            "--tier-interval-s", "1", "--tier-policy", policy, "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["tiering"]["policy"]["name"] == policy  # requests 10 simulated s apart
    (row,) = report["results"]
    assert row["tiering"]["policy"] == "keep_conversations" and row["tiering"]["rounds"] >= 100
    assert row["tiering"]["directives"]["pin"]["applied"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-s", "nope"], "unknown strategy 'nope'"),
        (["-s", 'prefix_affinity:{"balance_abs": -1}'], "knobs.balance_abs: Input should be"),
        (["-s", 'prefix_affinity:{"nope": 1}'], "knobs.nope: Extra inputs"),
        (["-s", 'prefix_affinity:{"nope":'], "knobs for prefix_affinity are not JSON"),
        (["--workers", "four"], "argument --workers: 'four' is not an integer"),
        (["--num-blocks", "0"], "bad engine settings:\n  num_blocks: Input should be greater"),
        (["--trace-block", "16"], "wrong --trace-block"),
        (["--cost-model", "nowhere:Model"], "cannot load cost model"),
        (["--tier-policy", "nope"], "unknown tier policy 'nope'"),
        (["--tier-policy", 'hot_prefix_pin:{"k": 0}'], "tiering.policy.knobs.k"),
        (["--tier-policy", 'hot_prefix_pin:{"k":'], "--tier-policy knobs are not JSON"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    try:  # refused at the flags (argparse) or after them (`UsageError`): exit code 2 either way
        code = main(["replay", str(_trace_file(tmp_path)), "--quiet", *args])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_missing_trace_and_bad_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "/nonexistent/trace.jsonl", "--quiet"]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", "t.jsonl", "--limit", "-3"])
    assert "'-3' must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", "t.jsonl", "--jobs", "two"])
    assert "'two' is not an integer" in capsys.readouterr().err
    for mode in (["replay"], ["live", "--url", "http://127.0.0.1:1"]):  # no abbreviations:
        with pytest.raises(SystemExit):  # --trace was taken for --trace-block
            main([*mode, "--trace", "t.jsonl"])
        assert "unrecognized arguments: --trace" in capsys.readouterr().err


def test_an_output_that_cannot_be_written_is_refused_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(_trace_file(tmp_path))
    for flag, path, message in [
        ("--json", tmp_path / "missing" / "r.json", "there is no folder"),
        ("--plot", tmp_path / "missing" / "r.png", "there is no folder"),
        ("--json", tmp_path, "is a folder, not a file"),
    ]:
        with pytest.raises(SystemExit):
            main(["replay", trace, "--quiet", "-s", "round_robin", flag, str(path)])
        err = capsys.readouterr().err
        assert f"argument {flag}" in err and message in err, err


class Sticky(RoundRobin):
    """A user strategy, found by `module:Class` path or entry point like the router finds it."""

    name = "sticky"

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        return candidates[0].name


def test_strategy_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_strategy('pa8=prefix_affinity:{"balance_abs": 8}')
    assert spec.label == "pa8" and spec.build().knobs.balance_abs == 8  # type: ignore[attr-defined]
    # What a router config takes (bench/router_vs_sglang.py starts routers from specs).
    assert spec.name == "prefix_affinity"
    assert spec.knobs.model_dump(exclude_unset=True) == {"balance_abs": 8}
    assert parse_strategy("dynamo_kv").label == "dynamo_kv"
    # User strategies replay too: by `module:Class` path (knobs after it) and by entry point.
    assert parse_strategy(f"{__name__}:Sticky").cls is Sticky
    assert parse_strategy(f"s={__name__}:Sticky:{{}}").label == "s"
    ep = EntryPoint("sticky", f"{__name__}:Sticky", "warply.strategies")
    monkeypatch.setattr(
        loading, "entry_points", lambda **kw: [ep] if kw.get("name") == "sticky" else []
    )
    assert parse_strategy("sticky").cls is Sticky
    with pytest.raises(UsageError, match="not a router.strategies.Strategy subclass"):
        parse_strategy("pathlib:Path")


def test_engine_block_follows_the_trace_block(tmp_path: Path) -> None:
    line = {"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [1, 2, 3, 4]}
    trace = tmp_path / "t16.jsonl"
    trace.write_text(json.dumps(line) + "\n")
    out = tmp_path / "r.json"
    args = ["replay", str(trace), "--trace-block", "16", "--quiet", "-s", "round_robin"]
    assert main([*args, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["engine"]["block_size"] == 16
    assert main([*args, "--block-size", "32", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["engine"]["block_size"] == 32


def test_speedup_compresses_arrivals(tmp_path: Path) -> None:
    # Two unrelated 8k-token prompts 400 ms apart on one worker: alone each prefills in ~170 ms;
    # 100x faster arrivals make the second wait behind the first.
    lines = [
        {"timestamp": 400 * i, "input_length": 8192, "output_length": 1,
         "hash_ids": list(range(16 * i, 16 * i + 16))}
        for i in range(2)
    ]  # fmt: skip
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ttft = {}
    for speedup in ("1", "100"):
        out = tmp_path / f"r{speedup}.json"
        args = ["replay", str(trace), "--workers", "1", "--quiet", "-s", "round_robin"]
        assert main([*args, "--speedup", speedup, "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["speedup"] == float(speedup)
        ttft[speedup] = report["results"][0]["ttft_mean_ms"]
    assert ttft["1"] == pytest.approx(169.1, abs=0.5)
    assert ttft["100"] > 1.4 * ttft["1"]


def test_gsp_slice_runs_all_default_strategies(tmp_path: Path) -> None:
    if not GSP.exists():
        pytest.skip("shared traces not present")
    out = tmp_path / "gsp.json"
    assert main(["replay", str(GSP), "--trace-block", "16", "--limit", "128", "--quiet",
                 "--json", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["results"]
    assert [r["strategy"] for r in rows] == list(DEFAULT_STRATEGIES)
    assert all(r["requests"] == 128 for r in rows)


# ---- baselines -----------------------------------------------------------------------------
def _view(blocks: int, bs: int = 64) -> RequestView:
    return RequestView(list(range(blocks)), blocks * bs, bs)


def test_dynamo_cost_prefers_cached_blocks_minus_load() -> None:
    loads = [
        WorkerLoad("a", in_flight_tokens=640, pending_prefill_tokens=0),
        WorkerLoad("b", in_flight_tokens=0, pending_prefill_tokens=0),
    ]
    # a: max(0, 10 - 8) + 10 = 12;  b: 10 + 0 = 10  -> b
    assert DynamoKv().choose(_view(10), loads, {"a": WorkerMatch(8, {})}) == "b"
    # a: max(0, 10 - 10) + 10 = 10 ... ties break at random between a and b
    picks = {DynamoKv().choose(_view(10), loads, {"a": WorkerMatch(10, {})}) for _ in range(1)}
    assert picks <= {"a", "b"}
    loads[1].pending_prefill_tokens = 64 * 5  # b: 15
    assert DynamoKv().choose(_view(10), loads, {"a": WorkerMatch(10, {})}) == "a"


def test_sglang_cache_aware_follows_its_own_tree_and_guards_imbalance() -> None:
    s = SglangCacheAware()
    idle = [WorkerLoad("a"), WorkerLoad("b")]
    first = s.choose(_view(10), idle, {})
    assert s.choose(_view(10), idle, {}) == first  # matched in the router's own tree
    other = "b" if first == "a" else "a"
    assert s.choose(RequestView(list(range(100, 110)), 640, 64), idle, {}) == other  # smallest
    busy = [WorkerLoad(first, in_flight=100), WorkerLoad(other, in_flight=1)]
    assert s.choose(_view(10), busy, {}) == other  # imbalance guard


def test_llmd_scores_prefix_queue_and_kv_usage() -> None:
    loads = [WorkerLoad("a", engine_waiting=0, kv_usage=0.9), WorkerLoad("b", kv_usage=0.1)]
    assert LlmdPrecise().choose(_view(10), loads, {"a": WorkerMatch(10, {})}) == "a"  # 3+2+0.2
    loads[0].engine_waiting = 5  # a: 3 + 0 + 0.2 = 3.2; b: 0 + 2 + 1.8 = 3.8
    assert LlmdPrecise().choose(_view(10), loads, {"a": WorkerMatch(10, {})}) == "b"
