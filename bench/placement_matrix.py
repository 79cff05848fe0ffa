"""The placement matrix: every workload × fleet size × arrival rate, the default strategy against
the modelled baselines (and our other cache-aware strategies), in simulated time.

Workloads (Mooncake JSONL; the generated ones are written to --out by `replay.workloads`):
  conversation  the shared Mooncake conversation trace, first --conversation-limit requests
                (default 3,000 of 12,031: ~880 s of the trace, 32 % of it prefix-reusable)
  gsp           the shared SGLang generated-shared-prefix trace (1,024 requests, 16-token blocks)
  agent, rag, unique   generated with seed --seed, --requests each (replay/workloads.py)
Each runs at --workers (default 4,8,32) and --rates (arrival-rate multipliers, default 1,2,4)
under the reference engine model (docs/replay.md), with the default strategy, `sglang_cache_aware`,
`dynamo_kv`, `llmd_precise` and --extra strategies (default kv-reuse, prefix_affinity).

A cell's verdict compares the default with the best baseline on each metric, with tolerances
0.005 reuse and 2 % TTFT (mean and p99): `ok` when it is at least as good on all three, else
the metrics it loses and to whom. Prints progress on stderr, the table on stdout, and writes
--out/matrix.json and --out/matrix.md.

    .venvs/core/bin/python bench/placement_matrix.py --out /tmp/matrix [--jobs 2]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from replay.__main__ import parse_strategy, strategy_arg
from replay.engine import EngineConfig
from replay.report import summarize
from replay.sim import simulate
from replay.trace import ExpandedTrace, read_trace
from replay.workloads import GENERATORS, write
from warply.common.argtypes import choice_list, non_negative, number_list, output_folder, positive

TRACES = Path(__file__).resolve().parents[1] / "../shared/traces"
SHARED = {
    "conversation": (TRACES / "mooncake/conversation_trace.jsonl", 512),
    "gsp": (TRACES / "sglang_gsp/gsp_default_blk16.jsonl", 16),
}
DEFAULT = "adaptive"
BASELINES = ("sglang_cache_aware", "dynamo_kv", "llmd_precise")
EXTRA = (
    "kv-reuse",
    "prefix_affinity",
    'fixed3=adaptive:{"adapt": false, "duplicate_floor": 3}',
    'fixed16=adaptive:{"adapt": false, "duplicate_floor": 16}',
)
REUSE_TOL, TTFT_TOL = 0.005, 0.02
_TRACES: dict[tuple[str, float], ExpandedTrace] = {}


def _expand(path: Path, block: int, limit: int | None) -> ExpandedTrace:
    return ExpandedTrace(read_trace(path, limit), block, 64 if block % 64 == 0 else block)


def _at_rate(trace: ExpandedTrace, rate: float) -> ExpandedTrace:
    """The same requests and keys, arrivals divided by `rate`."""
    scaled = copy.copy(trace)
    scaled.requests = [
        dataclasses.replace(r, arrival_ms=r.arrival_ms / rate) for r in trace.requests
    ]
    return scaled


def _run(job: tuple[str, float, int, str]) -> tuple[tuple[str, float, int, str], dict[str, Any]]:
    workload, rate, workers, spec = job
    trace = _TRACES[(workload, rate)]
    s = parse_strategy(spec)
    row = summarize(simulate(trace, s.build(), workers, s.label, EngineConfig(
        block_size=trace.block_size)))
    return job, row


def _verdict(rows: dict[str, dict[str, Any]]) -> tuple[str, dict[str, bool]]:
    """Whether the default holds each metric against every baseline (within tolerance)."""
    ours = rows[DEFAULT]
    lost: list[str] = []
    held = {"reuse": True, "mean": True, "p99": True}
    for b in BASELINES:
        r = rows[b]
        if ours["reuse"] < r["reuse"] - REUSE_TOL:
            held["reuse"] = False
            lost.append(f"reuse {ours['reuse'] - r['reuse']:+.3f} vs {b}")
        for metric, key in (("mean", "ttft_mean_ms"), ("p99", "ttft_p99_ms")):
            if ours[key] > r[key] * (1 + TTFT_TOL):
                held[metric] = False
                lost.append(f"{metric} {ours[key] / r[key] - 1:+.1%} vs {b}")
    return ("ok" if not lost else "; ".join(lost)), held


def _label(spec: str) -> str:
    return parse_strategy(spec).label


def _cell(row: dict[str, Any]) -> str:
    return f"{row['reuse']:.3f} / {row['ttft_mean_ms']:.0f} / {row['ttft_p99_ms']:.0f}"


def report(results: dict[tuple[str, float, int, str], dict[str, Any]], labels: list[str]) -> str:
    cells = sorted({(w, r, n) for w, r, n, _ in results}, key=lambda c: (c[0], c[2], c[1]))
    order = [DEFAULT, *BASELINES, *[x for x in labels if x not in (DEFAULT, *BASELINES)]]
    lines = [
        "reuse / TTFT mean ms / TTFT p99 ms per strategy; verdict: the default against every "
        f"baseline (tolerance {REUSE_TOL} reuse, {TTFT_TOL:.0%} TTFT)",
        "",
        "| workload | N | rate | " + " | ".join(_label(x) for x in order) + " | verdict |",
        "|---|---|---|" + "---|" * len(order) + "---|",
    ]
    held_all = {m: 0 for m in ("reuse", "mean", "p99", "all")}
    others = [s for s in order if s != DEFAULT]
    per_base = {b: {"reuse": 0, "mean": 0, "p99": 0, "all": 0} for b in others}
    best = {s: {"reuse": 0, "mean": 0, "p99": 0} for s in order}
    for w, rate, n in cells:
        rows = {s: results[(w, rate, n, s)] for s in order if (w, rate, n, s) in results}
        verdict, held = _verdict(rows)
        for m, ok in held.items():
            held_all[m] += ok
        held_all["all"] += all(held.values())
        ours = rows[DEFAULT]
        for b in others:
            r = rows[b]
            ok = {
                "reuse": ours["reuse"] >= r["reuse"] - REUSE_TOL,
                "mean": ours["ttft_mean_ms"] <= r["ttft_mean_ms"] * (1 + TTFT_TOL),
                "p99": ours["ttft_p99_ms"] <= r["ttft_p99_ms"] * (1 + TTFT_TOL),
            }
            for m, v in ok.items():
                per_base[b][m] += v
            per_base[b]["all"] += all(ok.values())
        top_reuse = max(r["reuse"] for r in rows.values())
        top_mean = min(r["ttft_mean_ms"] for r in rows.values())
        top_p99 = min(r["ttft_p99_ms"] for r in rows.values())
        for s, r in rows.items():
            best[s]["reuse"] += r["reuse"] >= top_reuse - 1e-9
            best[s]["mean"] += r["ttft_mean_ms"] <= top_mean + 1e-9
            best[s]["p99"] += r["ttft_p99_ms"] <= top_p99 + 1e-9
        lines.append(
            f"| {w} | {n} | {rate:g}× | "
            + " | ".join(_cell(rows[s]) if s in rows else "-" for s in order)
            + f" | {verdict} |"
        )
    total = len(cells)
    lines += [
        "",
        f"The default holds against every baseline in {held_all['all']}/{total} cells "
        f"(reuse {held_all['reuse']}, TTFT mean {held_all['mean']}, p99 {held_all['p99']}).",
        "",
        "The default against each strategy (same tolerances):",
        "",
        "| the default against | reuse ≥ | TTFT mean ≤ | TTFT p99 ≤ | all three |",
        "|---|---|---|---|---|",
    ]
    for b, c in per_base.items():
        lines.append(
            f"| {_label(b)} | {c['reuse']}/{total} | {c['mean']}/{total} | "
            f"{c['p99']}/{total} | {c['all']}/{total} |"
        )
    lines += [
        "",
        "Cells where each strategy is the best of all (ties count for each):",
        "",
        "| strategy | best reuse | best TTFT mean | best TTFT p99 |",
        "|---|---|---|---|",
    ]
    for s, c in best.items():
        lines.append(f"| {_label(s)} | {c['reuse']} | {c['mean']} | {c['p99']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--out", required=True, type=output_folder, help="work folder (traces, results)"
    )
    ap.add_argument("--jobs", type=positive(int), default=2, help="replays in parallel (default 2)")
    ap.add_argument("--workers", type=number_list(int), default="4,8,32", help="fleet sizes")
    ap.add_argument("--rates", type=number_list(float), default="1,2,4",
                    help="arrival-rate multipliers")
    ap.add_argument("--workloads", type=choice_list([*SHARED, *GENERATORS]),
                    default="conversation,gsp,agent,rag,unique",
                    help="workloads, comma-separated (default: all five)")
    ap.add_argument("--conversation-limit", type=positive(int), default=3000,
                    help="requests of the conversation trace")
    ap.add_argument("--requests", type=positive(int), default=3000,
                    help="requests per generated workload")
    ap.add_argument("--seed", type=non_negative(int), default=0,
                    help="seed of the generated workloads")
    ap.add_argument(
        "--extra",
        action="append",
        type=strategy_arg,
        help="more strategies to show (repeatable; default: kv-reuse, prefix_affinity, and the "
        "default with fixed knobs: fixed3, fixed16)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workloads, workers, rates = args.workloads, args.workers, args.rates
    labels = [DEFAULT, *BASELINES, *(args.extra or EXTRA)]
    t0 = time.perf_counter()
    for w in workloads:
        if w in SHARED:
            path, block = SHARED[w]
            limit = args.conversation_limit if w == "conversation" else None
        else:
            path, block, limit = args.out / f"{w}.jsonl", 512, None
            write(path, GENERATORS[w](args.requests, args.seed))
        base = _expand(path, block, limit)
        for rate in rates:
            _TRACES[(w, rate)] = _at_rate(base, rate)
        print(f"[{time.perf_counter() - t0:5.0f}s] {w}: {len(base)} requests", file=sys.stderr)
    # The biggest fleets first, so that the two workers finish together.
    jobs = sorted(
        ((w, r, n, s) for w in workloads for r in rates for n in workers for s in labels),
        key=lambda j: -j[2],
    )
    results: dict[tuple[str, float, int, str], dict[str, Any]] = {}
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("fork")) as pool:
        futures = [pool.submit(_run, job) for job in jobs]
        for done, fut in enumerate(as_completed(futures), 1):
            job, row = fut.result()
            results[job] = row
            elapsed = time.perf_counter() - t0
            print(
                f"[{elapsed:5.0f}s] {done}/{len(jobs)} {job[0]} ×{job[1]:g} N={job[2]} "
                f"{_label(job[3])}: "
                f"{_cell(row)}",
                file=sys.stderr,
            )
    text = report(results, labels)
    print(text)
    (args.out / "matrix.md").write_text(text + "\n", encoding="utf-8")
    (args.out / "matrix.json").write_text(
        json.dumps(
            [
                {"workload": w, "rate": r, "workers": n, **row, "strategy": _label(s)}
                for (w, r, n, s), row in sorted(results.items())
            ],
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )
    print(f"wall {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
