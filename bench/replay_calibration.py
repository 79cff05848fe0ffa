"""Replay calibration and targets (issue 5), on the shared traces, in simulated time.

Checks, under the reference engine model:
  calibration  round_robin on the conversation trace: reuse within ±0.01 and mean TTFT within
               10 % of N=4: 0.082 / 516 ms, N=8: 0.082 / 321 ms; dynamo_kv against the
               reference KV router figures N=4: 0.133 / 462 ms, N=8: 0.201 / 277 ms
  targets      conversation N=8: reuse ≥ 0.25 and mean TTFT ≤ 250 ms (best of ours);
               GSP N=8: reuse ≥ 0.85 and mean TTFT ≤ 35 ms
Prints each replay's row, then PASS/FAIL per check; exits 1 if any check fails.

    .venvs/core/bin/python bench/replay_calibration.py [--jobs 2] [--ours SPEC ...]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from replay.__main__ import parse_strategy, strategy_arg
from replay.report import summarize
from replay.sim import simulate
from replay.trace import ExpandedTrace, read_trace
from warply.common.argtypes import positive

TRACES = Path(__file__).resolve().parents[1] / "../shared/traces"
CONVERSATION = (TRACES / "mooncake/conversation_trace.jsonl", 512)
GSP = (TRACES / "sglang_gsp/gsp_default_blk16.jsonl", 16)
REFERENCE = {  # (strategy, workers) -> (reuse, mean TTFT ms), ENGINES.md
    ("round_robin", 4): (0.082, 516.0),
    ("round_robin", 8): (0.082, 321.0),
    ("dynamo_kv", 4): (0.133, 462.0),
    ("dynamo_kv", 8): (0.201, 277.0),
}
_TRACES: dict[str, ExpandedTrace] = {}


def _run(job: tuple[str, str, int]) -> dict[str, Any]:
    name, spec, workers = job
    s = parse_strategy(spec)
    return summarize(simulate(_TRACES[name], s.build(), workers, s.label))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--jobs", type=positive(int), default=1, help="replays in parallel")
    ap.add_argument(
        "--ours",
        action="append",
        type=strategy_arg,
        help="our strategies to check (default: prefix_affinity, kv-reuse)",
    )
    args = ap.parse_args()
    ours = args.ours or [
        "prefix_affinity",
        'pa_abs2_rel1=prefix_affinity:{"balance_abs":2,"balance_rel":1.0}',
    ]
    for name, (path, block) in (("conversation", CONVERSATION), ("gsp", GSP)):
        _TRACES[name] = ExpandedTrace(read_trace(path), block, 64)
    jobs = [("conversation", s, n) for (s, n) in REFERENCE]
    jobs += [("conversation", s, 8) for s in ours] + [("gsp", s, 8) for s in ours]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("fork")) as pool:
        rows = list(pool.map(_run, jobs))
    checks: list[tuple[str, bool]] = []
    for (trace, _, n), row in zip(jobs, rows, strict=True):
        print(
            f"{trace:12s} {row['strategy']:28s} N={n}  reuse {row['reuse']:.3f}  "
            f"TTFT mean {row['ttft_mean_ms']:.1f} ms  p99 {row['ttft_p99_ms']:.0f} ms  "
            f"(sim CPU {row['cpu_s']:.1f} s)"
        )
        ref = REFERENCE.get((row["strategy"], n))
        if trace == "conversation" and ref:
            ok = abs(row["reuse"] - ref[0]) <= 0.01 and abs(row["ttft_mean_ms"] / ref[1] - 1) <= 0.1
            checks.append((f"calibration {row['strategy']} N={n} vs {ref}", ok))
    conv = [
        r
        for (t, _, _), r in zip(jobs, rows, strict=True)
        if t == "conversation" and r["strategy"] not in ("round_robin", "dynamo_kv")
    ]
    gsp = [r for (t, _, _), r in zip(jobs, rows, strict=True) if t == "gsp"]
    checks.append(
        (
            "conversation N=8: some strategy of ours reuse >= 0.25, TTFT <= 250 ms",
            any(r["reuse"] >= 0.25 and r["ttft_mean_ms"] <= 250 for r in conv),
        )
    )
    checks.append(
        (
            "GSP N=8: some strategy of ours reuse >= 0.85, TTFT <= 35 ms",
            any(r["reuse"] >= 0.85 and r["ttft_mean_ms"] <= 35 for r in gsp),
        )
    )
    for label, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {label}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
