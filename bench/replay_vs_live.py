"""Does the simulated replay order strategies the way real engines do? One small case, both ways.

Takes a slice of the Mooncake conversation trace (the first turns of conversations whose prompts
fit the tiny model), scales its 512-token trace blocks down to `--trace-block` tokens, and writes
it as a Mooncake JSONL file (arrivals re-spaced `--gap-ms` apart in trace order, outputs capped).
That one file is then replayed

  * simulated: `replay` (the router's real index and strategies, N=2 simulated vLLM
    engines with the real engines' block size, KV blocks, batch and sequence limits), and
  * live: `replay.live` through `python -m router` in front of two real vLLM CPU engines
    (scripts/demo.py's `engine_pair`, one core each, KV-event streams), prefix caches reset
    before every strategy,

for round_robin, prefix_affinity and kv-reuse (the demo's knobs), and prints sim reuse next to
engine-reported live reuse (usage.prompt_tokens_details.cached_tokens), TTFT and requests per
worker, then whether the reuse ordering agrees, pair by pair (a gap under `--tie` is a tie).

Bounded: fixed request counts, a whole-run `--deadline` (SIGALRM, then every process we started
is stopped by its PID's process group), loopback only.

    .venvs/core/bin/python bench/replay_vs_live.py --vllm .venvs/vllm/bin/vllm --model DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import demo  # noqa: E402  (engines, router and cache reset of the demo; not a package)

from replay.__main__ import parse_strategy  # noqa: E402
from replay.engine import EngineConfig  # noqa: E402
from replay.live import LiveConfig, run_live  # noqa: E402
from replay.references import lru_reuse  # noqa: E402
from replay.report import summarize  # noqa: E402
from replay.sim import simulate  # noqa: E402
from replay.trace import ExpandedTrace, exiting_on_bad_trace, read_trace  # noqa: E402
from replay.workloads import as_record  # noqa: E402
from warply.common.argtypes import fraction, non_negative, output_folder, positive  # noqa: E402
from warply.launch import exit_on_termination  # noqa: E402

STRATEGIES = ("round_robin", "prefix_affinity", "kv-reuse")
SOURCE_BLOCK = 512  # tokens per hash id in the Mooncake trace
VOCAB = 8192  # scripts/tiny_model.py


def _log(msg: str) -> None:
    print(f"[replay-vs-live] {msg}", file=sys.stderr, flush=True)


def make_slice(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Write the slice (Mooncake JSONL at `--trace-block`); returns what it holds."""
    rows = [as_record(r) for r in read_trace(args.trace)]  # checked: a bad line is named
    fits = [
        g[: args.turns]
        for g in demo.conversation_groups(rows)
        if len(g) >= args.min_turns
        and all(len(rows[i]["hash_ids"]) <= args.max_ids for i in g[: args.turns])
    ][: args.conversations]
    order = sorted(i for g in fits for i in g)
    with open(out, "w", encoding="utf-8") as fh:
        for rank, i in enumerate(order):
            r = rows[i]
            # ceil(L·b/512) keeps ceil(L'/b) == len(hash_ids): the last block stays partial
            length = -(-r["input_length"] * args.trace_block // SOURCE_BLOCK)
            fh.write(
                json.dumps(
                    {
                        "timestamp": rank * args.gap_ms,
                        "input_length": length,
                        "output_length": max(1, min(args.max_output, r["output_length"])),
                        "hash_ids": r["hash_ids"],
                    }
                )
                + "\n"
            )
    reqs = read_trace(out)
    unique = len({h for r in reqs for h in r.hash_ids})
    return {
        "conversations": len(fits),
        "requests": len(reqs),
        "prompt_min": min(r.input_length for r in reqs),
        "prompt_max": max(r.input_length for r in reqs),
        "prompt_tokens": sum(r.input_length for r in reqs),
        "unique_blocks": -(-unique * args.trace_block // args.block_size),
    }


def _spec(name: str) -> Any:
    knobs = demo.KNOBS.get(name)
    return parse_strategy(f"{name}:{json.dumps(knobs)}" if knobs else name)


def run_sim(args: argparse.Namespace, path: Path) -> dict[str, dict[str, Any]]:
    """The simulated replay, per strategy: summarize() row plus requests per worker."""
    cfg = EngineConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_batched_tokens=args.max_batched_tokens,
        max_seqs=args.max_seqs,
    )
    trace = ExpandedTrace(read_trace(path), args.trace_block, cfg.block_size)
    pooled = lru_reuse(trace, 2 * cfg.num_blocks)
    rows: dict[str, dict[str, Any]] = {}
    for name in STRATEGIES:
        spec = _spec(name)
        result = simulate(trace, spec.build(), 2, name, cfg, None)
        row = summarize(result, pooled)
        counts = [sum(1 for w in result.placement.values() if w == f"w{i}") for i in range(2)]
        row["per_worker"] = "/".join(map(str, counts))
        row["pooled_lru"] = pooled
        rows[name] = row
    return rows


def run_live_all(
    args: argparse.Namespace, path: Path, workdir: Path, deadline: float
) -> list[dict[str, dict[str, Any]]]:
    """The live replays (`--rounds` × strategies) on one pair of engines."""
    extra = [
        "--max-model-len",
        str(args.max_model_len),
        "--num-gpu-blocks-override",
        str(args.num_blocks),
        "--max-num-batched-tokens",
        str(args.max_batched_tokens),
        "--max-num-seqs",
        str(args.max_seqs),
    ]
    requests = read_trace(path)
    engines = demo.engine_pair(str(args.vllm), str(args.model), workdir, extra)
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        for engine, _ in engines:
            engine.start()
            _log(f"vLLM pid {engine.pid} starting (log {engine.log_path})")
        for engine, _ in engines:
            took = engine.wait_healthy(max(10.0, min(300.0, deadline - time.monotonic())))
            _log(f"vLLM {engine.url} healthy after {took:.0f}s")
        for rnd in range(args.rounds):
            results: dict[str, dict[str, Any]] = {}
            for name in STRATEGIES:
                demo.reset_caches(engines)
                router = demo.router_process(name, engines, str(args.model), workdir)
                with router:
                    router.wait_healthy(60)
                    left = deadline - time.monotonic() - 30
                    if left < 10:
                        raise TimeoutError("deadline: no time left for another live run")
                    _log(f"round {rnd + 1}: router {name} (pid {router.pid}) up; replaying")
                    cfg = LiveConfig(
                        url=router.url,
                        model=demo.MODEL_NAME,
                        speedup=args.speedup,
                        concurrency=args.concurrency,
                        timeout_s=left,
                        vocab=VOCAB,
                    )
                    row = run_live(requests, args.trace_block, cfg, quiet=True)
                    time.sleep(0.5)
                    status, stats = http_json_auth(router.url + "/warply/cache_stats")
                    if status != 200:
                        raise RuntimeError(f"cache_stats answered {status}: {stats}")
                    row["per_worker"] = "/".join(
                        str(w.get("requests", 0)) for w in stats["workers"].values()
                    )
                    row["router_engine_hit"] = stats["hit_rate"]["engine"]
                    results[name] = row
            rounds.append(results)
    finally:
        for engine, _ in engines:
            engine.stop()
    return rounds


def http_json_auth(url: str) -> tuple[int, Any]:
    """GET an admin endpoint of the router (the demo's token)."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {demo.TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, json.loads(resp.read())


def ordering(rows: dict[str, dict[str, Any]]) -> str:
    return " > ".join(sorted(rows, key=lambda n: -rows[n]["reuse"]))


def compare(sim: dict[str, dict[str, Any]], live: dict[str, dict[str, Any]], tie: float) -> bool:
    """Print the side-by-side table and the pairwise verdicts; True if no clear pair disagrees."""
    print(
        f"\n{'strategy':18s}{'sim reuse':>10s}{'live reuse':>11s}{'sim TTFT ms':>12s}"
        f"{'live TTFT ms':>13s}{'sim req/worker':>16s}{'live req/worker':>17s}{'live err':>9s}"
    )
    for n in STRATEGIES:
        s, lv = sim[n], live[n]
        print(
            f"{n:18s}{s['reuse']:10.3f}{lv['reuse']:11.3f}{s['ttft_mean_ms']:12.1f}"
            f"{lv['ttft_mean_ms']:13.1f}{s['per_worker']:>16s}{lv['per_worker']:>17s}"
            f"{lv['errors']:9d}"
        )
    print(f"sim ordering:  {ordering(sim)}\nlive ordering: {ordering(live)}")
    ok = True
    for a, b in itertools.combinations(STRATEGIES, 2):
        ds, dl = sim[a]["reuse"] - sim[b]["reuse"], live[a]["reuse"] - live[b]["reuse"]
        if abs(ds) < tie or abs(dl) < tie:
            verdict = f"tie (|gap| < {tie}) in {'sim' if abs(ds) < tie else 'live'}"
            if abs(ds) >= tie or abs(dl) >= tie:
                verdict += " only"
        elif (ds > 0) == (dl > 0):
            verdict = "agree, clearly ordered"
        else:
            verdict, ok = "DISAGREE", False
        print(f"  {a} vs {b}: sim {ds:+.3f}, live {dl:+.3f} -> {verdict}")
    return ok


def _alarm(signum: int, frame: Any) -> None:
    raise TimeoutError("whole-run --deadline reached")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--vllm",
        type=Path,
        default=ROOT / ".venvs/vllm/bin/vllm",
        help="the vllm CLI of the engine venv",
    )
    ap.add_argument("--model", type=Path, help="tiny model folder (scripts/tiny_model.py)")
    ap.add_argument("--trace", type=Path, default=demo.TRACE, help="conversation trace (JSONL)")
    ap.add_argument(
        "--conversations", type=positive(int), default=14, help="conversations of the slice"
    )
    ap.add_argument("--turns", type=positive(int), default=4, help="turns kept per conversation")
    ap.add_argument(
        "--min-turns", type=non_negative(int), default=3, help="conversations with fewer: skipped"
    )
    ap.add_argument(
        "--max-ids", type=positive(int), default=44, help="hash ids per prompt, at most"
    )
    ap.add_argument(
        "--trace-block", type=positive(int), default=32, help="tokens per hash id (was 512)"
    )
    ap.add_argument("--max-output", type=positive(int), default=8, help="output tokens per request")
    ap.add_argument(
        "--gap-ms", type=non_negative(float), default=400.0, help="arrival spacing in the slice"
    )
    ap.add_argument(
        "--speedup", type=positive(float), default=1.0, help="live: arrivals at time/speedup"
    )
    ap.add_argument(
        "--concurrency", type=positive(int), default=8, help="live: open requests at most"
    )
    ap.add_argument(
        "--block-size", type=positive(int), default=demo.BLOCK_SIZE, help="KV block size"
    )
    ap.add_argument(
        "--num-blocks",
        type=non_negative(int),
        default=0,
        help="KV blocks per worker, sim and --num-gpu-blocks-override "
        "(default: 55%% of the slice's unique blocks)",
    )
    ap.add_argument(
        "--max-model-len", type=positive(int), default=2048, help="the engines' --max-model-len"
    )
    ap.add_argument(
        "--max-batched-tokens", type=positive(int), default=2048, help="per scheduler pass"
    )
    ap.add_argument(
        "--max-seqs", type=positive(int), default=8, help="running sequences, sim and live"
    )
    ap.add_argument("--rounds", type=positive(int), default=1, help="live rounds (same engines)")
    ap.add_argument("--sim-only", action="store_true", help="skip the live part")
    ap.add_argument("--tie", type=fraction, default=0.02, help="reuse gap counted as a tie")
    ap.add_argument("--deadline", type=positive(float), default=1200.0, help="whole run, seconds")
    ap.add_argument(
        "--workdir", type=output_folder, help="slice, logs, JSON (default: a temp folder)"
    )
    args = ap.parse_args()
    exit_on_termination()
    if not args.sim_only and args.model is None:
        ap.error("--model is required unless --sim-only")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="warply-replay-vs-live-"))
    workdir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.deadline
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(args.deadline))
    path = workdir / "slice.jsonl"
    with exiting_on_bad_trace(ap.prog):
        info = make_slice(args, path)
    min_blocks = -(-args.max_model_len // args.block_size) + 1
    if not args.num_blocks:
        args.num_blocks = max(min_blocks, int(0.55 * info["unique_blocks"]))
    info["num_blocks_per_worker"] = args.num_blocks
    print(f"slice: {json.dumps(info)}\n  file {path}")
    sim = run_sim(args, path)
    print(
        f"sim (pooled-LRU reference, N=2: {sim[STRATEGIES[0]]['pooled_lru']:.3f}): "
        + ", ".join(f"{n} {r['reuse']:.3f}" for n, r in sim.items())
    )
    report: dict[str, Any] = {
        "slice": info,
        "args": {k: str(v) for k, v in vars(args).items()},
        "sim": sim,
        "live": [],
    }
    ok = True
    try:
        if not args.sim_only:
            report["live"] = run_live_all(args, path, workdir, deadline)
            for i, live in enumerate(report["live"]):
                print(
                    f"\n== round {i + 1} (N=2, {args.num_blocks} KV blocks x "
                    f"{args.block_size} tokens per worker) =="
                )
                ok = compare(sim, live, args.tie) and ok
    except (RuntimeError, TimeoutError) as exc:
        print(f"replay_vs_live failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
        (workdir / "replay_vs_live.json").write_text(json.dumps(report, indent=1, default=str))
        print(f"report: {workdir / 'replay_vs_live.json'}")
    print(f"\nreuse ordering {'AGREES' if ok else 'DISAGREES'} (clearly ordered pairs)")
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
