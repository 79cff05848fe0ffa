"""Workload shift: the arrival rate multiplies by --factor from the middle of a trace on; the
adaptive default against the same cost with fixed knobs (no adaptation: X = duplicate_floor,
for several floors), our other strategies and the modelled baselines, in simulated time.

The trace is the shared conversation trace (first --limit requests) with the gaps from the
--at fraction of requests to the --until fraction divided by --factor (`python -m
replay.workloads shift`).
Reports, per strategy: reuse, TTFT mean and p99 before and after the shift, and the mean TTFT
per --window-s of arrival time from two windows before it (how fast and how far each recovers);
for the adaptive default, its gauges (eviction loss π, duplication price, queue depth) at the
end of each window.

    .venvs/core/bin/python bench/shift_replay.py [--workers 8] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from replay.__main__ import parse_strategy, strategy_arg
from replay.engine import EngineConfig
from replay.sim import simulate
from replay.trace import ExpandedTrace, read_trace
from replay.workloads import add_shift_flags, check_shift_flags, shift
from warply.common.argtypes import output_file, positive

TRACE = Path(__file__).resolve().parents[1] / "../shared/traces/mooncake/conversation_trace.jsonl"
STRATEGIES = (
    "adaptive",
    'fixed3=adaptive:{"adapt": false, "duplicate_floor": 3}',
    'fixed8=adaptive:{"adapt": false, "duplicate_floor": 8}',
    'fixed16=adaptive:{"adapt": false, "duplicate_floor": 16}',
    "kv-reuse",
    "prefix_affinity",
    "sglang_cache_aware",
    "dynamo_kv",
    "llmd_precise",
)
_SHARED: dict[str, Any] = {}


def _stats(reqs: list[Any]) -> dict[str, float]:
    ttft = np.array([r.first_token - r.arrival for r in reqs])
    prompt = sum(r.prompt for r in reqs)
    return {
        "reuse": sum(r.cached_tokens for r in reqs) / prompt if prompt else 0.0,
        "ttft_mean_ms": float(ttft.mean()) if len(ttft) else 0.0,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) if len(ttft) else 0.0,
    }


def _run(spec: str) -> dict[str, Any]:
    trace: ExpandedTrace = _SHARED["trace"]
    pivot, window, workers = _SHARED["pivot"], _SHARED["window"], _SHARED["workers"]
    s = parse_strategy(spec)
    strategy = s.build()
    samples: list[tuple[float, dict[str, float]]] = []
    choose = strategy.choose
    arrivals = [r.arrival_ms for r in trace.requests]

    def traced(request: Any, candidates: Any, matches: Any) -> str:
        name = choose(request, candidates, matches)
        samples.append((arrivals[len(samples)], strategy.gauges()))
        return name

    strategy.choose = traced  # type: ignore[method-assign]
    result = simulate(trace, strategy, workers, s.label, EngineConfig(block_size=64))
    before = [r for r in result.requests if r.arrival < pivot]
    after = [r for r in result.requests if r.arrival >= pivot]
    end = max(r.arrival for r in result.requests)
    series = []
    t = pivot - 2 * window
    while t < end:
        win = [r for r in result.requests if t <= r.arrival < t + window]
        gauges = [g for at, g in samples if at < t + window]
        series.append(
            {
                "from_s": (t - pivot) / 1000,
                **_stats(win),
                "gauges": gauges[-1] if gauges else {},
            }
        )
        t += window
    return {
        "strategy": s.label,
        "before": _stats(before),
        "after": _stats(after),
        "windows": series,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--limit", type=positive(int), default=3000, help="requests of the trace")
    add_shift_flags(ap)
    ap.add_argument("--workers", type=positive(int), default=8, help="simulated workers")
    ap.add_argument("--window-s", type=positive(float), default=30.0,
                    help="window after the shift, s")
    ap.add_argument("--jobs", type=positive(int), default=2, help="replays in parallel")
    ap.add_argument("--json", type=output_file, help="write the results here")
    ap.add_argument("-s", "--strategy", action="append", type=strategy_arg,
                    help="strategies (default: see source)")
    args = ap.parse_args()
    check_shift_flags(ap, args)
    t0 = time.perf_counter()
    requests = shift(read_trace(TRACE, args.limit), args.at, args.factor, args.until)
    pivot = requests[int(len(requests) * args.at)].arrival_ms
    _SHARED.update(
        trace=ExpandedTrace(requests, 512, 64),
        pivot=pivot,
        window=args.window_s * 1000,
        workers=args.workers,
    )
    specs = args.strategy or list(STRATEGIES)
    print(
        f"{len(requests)} requests, shift ×{args.factor:g} at {pivot / 1000:.0f} s, "
        f"N={args.workers}",
        file=sys.stderr,
    )
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("fork")) as pool:
        rows = []
        for row in pool.map(_run, specs):
            rows.append(row)
            print(f"[{time.perf_counter() - t0:4.0f}s] {row['strategy']} done", file=sys.stderr)
    windows = len(rows[0]["windows"])
    head = " ".join(f"{w['from_s']:+.0f}s" for w in rows[0]["windows"])
    print(f"| strategy | before: reuse / mean / p99 | after: reuse / mean / p99 | "
          f"mean TTFT ms per {args.window_s:g} s window from the shift ({head}) |")
    print("|---|---|---|---|")
    for row in rows:
        b, a = row["before"], row["after"]
        series = " ".join(f"{w['ttft_mean_ms']:.0f}" for w in row["windows"][:windows])
        print(
            f"| {row['strategy']} | {b['reuse']:.3f} / {b['ttft_mean_ms']:.0f} / "
            f"{b['ttft_p99_ms']:.0f} | {a['reuse']:.3f} / {a['ttft_mean_ms']:.0f} / "
            f"{a['ttft_p99_ms']:.0f} | {series} |"
        )
    adaptive = next((r for r in rows if r["strategy"] == "adaptive"), None)
    if adaptive:
        print("\nadaptive gauges at the end of each window (π, duplication price, queue depth):")
        cells = []
        for w in adaptive["windows"]:
            g = w["gauges"]
            cells.append(
                f"{w['from_s']:+.0f}s: {g.get('eviction_loss', 0):.2f}/"
                f"{g.get('duplicate_price', 0):.1f}/{g.get('queue_depth', 0):.1f}"
            )
        print("  " + "  ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    print(f"wall {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
