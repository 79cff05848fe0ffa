"""P/D pools against aggregated workers in the replay, and the conditional-disaggregation sweep.

On the conversation trace (512-token trace blocks, reference engines): N aggregated workers with
each strategy, then P prefill + D decode workers (the router's P/D placement with
`pd.local_prefill_by: cost`, each strategy choosing decode and prefill workers), the naive
baseline (the same decode placement, prefill workers in turn: the prefill pool's strategy is
round_robin), the fixed threshold alone (`local_prefill_by: threshold`), an ideal decode
engine that drops the KV it pulled once a request ends (no duplicates), and the cost rule with
`pd.prefill_answers` (a prefill worker may answer a whole request). Prints, per row,
reuse (what the router reports to clients), TTFT mean / p50 / p99, bytes moved P→D and remote /
local / on-prefill counts; the ratios P/D ÷ aggregated for reuse (target ≥ 0.90) and mean TTFT
(target ≤ 1.10); `pd.local_prefill_tokens` (the floor) swept with the first strategy; then
the pooled LRU references (`replay.references`): N and P workers' capacity, and one LRU per
role with a share of the conversations handed off, decode keeping the KV it pulled (as engines
do) or not (no duplicates). Numbers only: nothing is asserted.

    .venvs/core/bin/python bench/pd_replay.py [--limit 3000] [--jobs 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from replay.__main__ import Deployment, StrategySpec, parse_strategy, strategy_arg
from replay.engine import EngineConfig
from replay.pd import PdSettings
from replay.references import lru_reuse, pd_lru_reuse
from replay.report import summarize
from replay.sim import simulate_pools
from replay.trace import ExpandedTrace, exiting_on_bad_trace, read_trace
from router.config import PdConfig
from warply.common.argtypes import non_negative, number_list, output_file, positive

TRACE = Path(__file__).resolve().parents[1] / "../shared/traces/mooncake/conversation_trace.jsonl"
_SHARED: dict[str, Any] = {}
_FIELDS = ("reuse", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_mean_ms", "remote", "local",
           "on_prefill")  # fmt: skip


Job = tuple[str, str | None, Deployment, str]
"""Strategy, the prefill pool's own strategy, the deployment, and a variant: "" (the cost
rule), `threshold` (`pd.local_prefill_by: threshold`, the router's default), `ideal`
(the cost rule with `PdSettings.drop_pulled`) or `answers` (the cost rule with
`pd.prefill_answers`)."""
_VARIANTS: dict[str, dict[str, Any]] = {
    "": {"local_prefill_by": "cost"},
    "threshold": {"local_prefill_by": "threshold"},
    "ideal": {"local_prefill_by": "cost", "drop_pulled": True},
    "answers": {"local_prefill_by": "cost", "prefill_answers": True},
}


def _run(job: Job) -> dict[str, Any]:
    spec, prefill, where, variant = job
    s = parse_strategy(spec)
    p: StrategySpec | None = parse_strategy(prefill) if prefill else None
    pd: PdSettings = _SHARED["pd"]
    result = simulate_pools(
        _SHARED["trace"],
        where.pools(s, p),
        where.label(s, p, where.threshold is not None),
        pd=pd.model_copy(update={"local_prefill_tokens": where.threshold, **_VARIANTS[variant]}),
    )
    row = summarize(result)
    return {
        "label": row["strategy"] + (f" ({variant})" if variant else ""),
        "deployment": row["deployment"],
        "threshold": where.threshold,
        **{k: row[k] for k in _FIELDS},
        "bytes_moved": row["bytes_moved"] or 0,
        "cpu_s": row["cpu_s"],
    }


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['label']:44s} {row['deployment']:>6s}  reuse {row['reuse']:.3f}  TTFT "
        f"{row['ttft_mean_ms']:6.1f} / p50 {row['ttft_p50_ms']:6.1f} / "
        f"p99 {row['ttft_p99_ms']:7.1f} ms  ITL {row['itl_mean_ms']:5.2f}  "
        f"P→D {row['bytes_moved'] / 1e12:6.2f} TB  "
        f"remote {row['remote']:5d} local {row['local']:5d} on-prefill {row['on_prefill']:5d}  "
        f"({row['cpu_s']:.0f} s CPU)"
    )


def _references(trace: ExpandedTrace, args: argparse.Namespace) -> None:
    """Pooled LRU reuse: aggregated capacities, and one cache per role of the P/D deployment."""
    blocks = EngineConfig().num_blocks
    print("\n== pooled LRU references (requests served at arrival; not bounds) ==")
    for n in (args.workers, args.decode):
        print(f"one LRU of {n} workers' capacity: {lru_reuse(trace, n * blocks):.4f}")
    caps = (args.prefill * blocks, args.decode * blocks, args.conversation_block)
    for share in (0.25, 0.4, 0.5, 0.6, 0.75):
        kept = pd_lru_reuse(trace, caps[0], caps[1], share, True, caps[2])
        ideal = pd_lru_reuse(trace, caps[0], caps[1], share, False, caps[2])
        print(
            f"LRU per role, {share:.0%} of conversations handed off: decode keeps pulled KV "
            f"{kept:.4f}, no duplicates {ideal:.4f}",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE, help="request trace (Mooncake JSONL)")
    ap.add_argument("--trace-block", type=positive(int), default=512,
                    help="tokens per trace hash id")
    ap.add_argument("--limit", type=positive(int),
                    help="first N requests (default: the whole trace)")
    ap.add_argument("--workers", type=positive(int), default=8, help="aggregated workers")
    ap.add_argument("--prefill", type=positive(int), default=4, help="prefill workers")
    ap.add_argument("--decode", type=positive(int), default=4, help="decode workers")
    ap.add_argument("-s", "--strategy", action="append", type=strategy_arg,
                    help="default: adaptive, prefix_affinity")
    ap.add_argument("--sweep", type=number_list(int, zero=True), default="0,512,2048",
                    help="floor thresholds (tokens)")
    ap.add_argument(
        "--conversation-block",
        type=non_negative(int),
        default=8,
        help="references: the block telling conversations apart (8: the trace's second 512-token "
        "block at 64-token engine blocks; every request shares its first)",
    )
    ap.add_argument("--bandwidth-gbps", type=positive(float), default=PdSettings().bandwidth_gbps,
                    help="P→D link per decode worker, Gbit/s")
    ap.add_argument("--jobs", type=positive(int), default=1, help="replays in parallel")
    ap.add_argument("--json", type=output_file, help="write the rows here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    with exiting_on_bad_trace(ap.prog):
        requests = read_trace(args.trace, args.limit)
    trace = ExpandedTrace(requests, args.trace_block, 64)
    _SHARED.update(trace=trace, pd=PdSettings(bandwidth_gbps=args.bandwidth_gbps))
    specs = args.strategy or ["adaptive", "prefix_affinity"]
    pd = Deployment(0, args.prefill, args.decode)
    default = PdConfig().local_prefill_tokens  # the first P/D rows ran at it: not run again
    others = [Deployment(0, args.prefill, args.decode, t) for t in args.sweep if t != default]
    jobs: list[Job] = [
        *((s, None, Deployment(args.workers), "") for s in specs),
        *((s, None, pd, "") for s in specs),
        *((s, "round_robin", pd, "") for s in specs),
        *((s, None, pd, "threshold") for s in specs),
        *((s, None, pd, "ideal") for s in specs),
        *((s, None, pd, "answers") for s in specs),
        *((specs[0], None, d, "") for d in others),
    ]
    print(f"{len(trace)} requests; {len(jobs)} replays (--jobs {args.jobs})", flush=True)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("fork")) as pool:
            rows = list(pool.map(_run, jobs))
    else:
        rows = []
        for job in jobs:
            rows.append(_run(job))
            print(_line(rows[-1]), flush=True)
    n = len(specs)
    aggregated, disagg, naive = rows[:n], rows[n : 2 * n], rows[2 * n : 3 * n]
    fixed, ideal = rows[3 * n : 4 * n], rows[4 * n : 5 * n]
    answers, swept = rows[5 * n : 6 * n], rows[6 * n :]
    print("\n== P/D against aggregated (targets: reuse ratio ≥ 0.90, TTFT ratio ≤ 1.10) ==")
    for agg, pdr, rr, th, no_dup, ans in zip(
        aggregated, disagg, naive, fixed, ideal, answers, strict=True
    ):
        for row in (agg, pdr, rr, th, no_dup, ans):
            print(_line(row))
        named = (("P/D", pdr), ("round-robin prefill", rr), ("threshold alone", th),
                 ("ideal: no duplicates", no_dup), ("prefill answers", ans))  # fmt: skip
        for name, row in named:
            print(
                f"  {name:20s} reuse ratio {row['reuse'] / agg['reuse']:.3f}  "
                f"mean TTFT ratio {row['ttft_mean_ms'] / agg['ttft_mean_ms']:.3f}"
            )
    where = f"{specs[0]}, {args.prefill}P+{args.decode}D"
    print(f"\n== pd.local_prefill_tokens (the floor under cost) swept ({where}) ==")
    by_threshold = {row["threshold"]: row for row in swept}
    by_threshold[default] = disagg[0]
    for t in args.sweep:
        print(f"t={t:<5d} " + _line(by_threshold[t]))
    _references(trace, args)
    print(f"\n{time.perf_counter() - t0:.0f} s wall")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
