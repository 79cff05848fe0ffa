"""`cost_aware` against price-blind strategies in the replay, over two pools at different prices.

Two aggregated pools on the conversation trace (512-token trace blocks, reference engines): a
fast pool (speed 1, `--fast-price` per worker-hour) and a slow, cheap one (`--slow-speed`: its
passes take 1/speed as long; `--slow-price`). Price-blind rows (`prefix_affinity`, the default
`adaptive`) use the router's default pool comparison (most cached tokens wins); `cost_aware`
rows compare the pools by its cost, with `latency_weight` swept and a TTFT-guarded row. Per row:
reuse, TTFT mean / p99, the share of requests the cheap pool answered, and the cost per million
tokens (prompt + output) = Σ over engines price × busy time (the seconds it spent in scheduler
passes: what a pay-per-use or autoscaled pool bills) / tokens. Numbers only: nothing asserted.

    .venvs/core/bin/python bench/cost_replay.py [--limit 3000]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from replay.report import summarize
from replay.sim import SimPool, simulate_pools
from replay.trace import ExpandedTrace, exiting_on_bad_trace, read_trace
from router.config import StrategyConfig
from router.strategies import CostAware, Strategy, make_strategy
from warply.common.argtypes import output_file, positive

TRACE = Path(__file__).resolve().parents[1] / "../shared/traces/mooncake/conversation_trace.jsonl"


def _strategy(name: str, knobs: dict[str, Any]) -> Strategy:
    return make_strategy(StrategyConfig(name=name, knobs=knobs))


def _row(trace: ExpandedTrace, args: argparse.Namespace, label: str, name: str,
         knobs: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    pools = [
        SimPool("fast", "both", args.workers, _strategy(name, knobs),
                price_per_hour=args.fast_price),
        SimPool("slow", "both", args.workers, _strategy(name, knobs), speed=args.slow_speed,
                price_per_hour=args.slow_price),
    ]  # fmt: skip
    ranker = _strategy(name, knobs) if name == CostAware.name else None
    result = simulate_pools(trace, pools, label, ranker=ranker)
    row = summarize(result)
    price = {"fast": args.fast_price, "slow": args.slow_price}
    dollars = sum(price[n.rstrip("0123456789")] * s / 3600 for n, s in row["busy_s"].items())
    tokens = sum(r.prompt + r.output for r in result.requests)
    slow = sum(1 for s in result.served.values() if s.worker.startswith("slow"))
    return {
        "label": label,
        "reuse": row["reuse"],
        "ttft_mean_ms": row["ttft_mean_ms"],
        "ttft_p99_ms": row["ttft_p99_ms"],
        "slow_share": slow / max(1, len(result.served)),
        "cost_per_mtok": dollars / tokens * 1e6 if tokens else 0.0,
        "cpu_s": row["cpu_s"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE, help="request trace (Mooncake JSONL)")
    ap.add_argument("--trace-block", type=positive(int), default=512,
                    help="tokens per trace hash id")
    ap.add_argument("--limit", type=positive(int),
                    help="first N requests (default: the whole trace)")
    ap.add_argument("--workers", type=positive(int), default=4, help="workers per pool")
    ap.add_argument("--fast-price", type=positive(float), default=4.0, help="per worker-hour")
    ap.add_argument("--slow-price", type=positive(float), default=1.2, help="per worker-hour")
    ap.add_argument("--slow-speed", type=positive(float), default=0.5,
                    help="the cheap pool's speed")
    ap.add_argument("--ttft-target-ms", type=positive(float), default=1000.0,
                    help="cost_aware's TTFT target")
    ap.add_argument("--json", type=output_file, help="write the rows here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    with exiting_on_bad_trace(ap.prog):
        requests = read_trace(args.trace, args.limit)
    trace = ExpandedTrace(requests, args.trace_block, 64)
    rows_spec: list[tuple[str, str, dict[str, Any]]] = [
        ("prefix_affinity", "prefix_affinity", {}),
        ("adaptive", "adaptive", {}),
        *((f"cost_aware latency_weight={w:g}", "cost_aware", {"latency_weight": w})
          for w in (0.0, 0.25, 1.0, 4.0)),
        (f"cost_aware lw=0 ttft_target={args.ttft_target_ms:g}ms", "cost_aware",
         {"latency_weight": 0.0, "ttft_target_ms": args.ttft_target_ms}),
    ]  # fmt: skip
    print(f"{len(trace)} requests; pools: {args.workers} fast (price {args.fast_price}/h) + "
          f"{args.workers} slow (speed {args.slow_speed}, price {args.slow_price}/h)", flush=True)
    rows = []
    for label, name, knobs in rows_spec:
        rows.append(_row(trace, args, label, name, knobs))
        r = rows[-1]
        print(f"{r['label']:40s} reuse {r['reuse']:.3f}  TTFT mean {r['ttft_mean_ms']:7.1f} "
              f"p99 {r['ttft_p99_ms']:8.1f} ms  cheap pool {r['slow_share']:5.1%}  "
              f"cost/Mtok {r['cost_per_mtok']:.4f}  ({r['cpu_s']:.0f} s CPU)", flush=True)
    base = rows[0]
    print("\nratios to prefix_affinity (cost, mean TTFT):")
    for r in rows[1:]:
        print(f"  {r['label']:40s} cost x{r['cost_per_mtok'] / base['cost_per_mtok']:.3f}  "
              f"TTFT x{r['ttft_mean_ms'] / base['ttft_mean_ms']:.3f}")
    print(f"\n{time.perf_counter() - t0:.0f} s wall")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
