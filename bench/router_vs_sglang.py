"""Side by side on two real vLLM CPU engines: warply-router vs sglang-router 0.3.2 vs an oracle.

One run, one pair of engines, one multi-turn workload (the demo's: conversation chains from the
Mooncake trace as text prompts), prefix caches reset before every row, then one warm-up request
per engine through the row's path and a pause (`--settle-s`), so a router just started serves
the timed requests settled, as a long-running one would. Rows:

  * sticky oracle       each conversation pinned to one engine, conversations alternated over
                        the two engines in order of first appearance; the client sends straight
                        to the engines (no router in the path)
  * warply round_robin  `python -m router`, the demo's config
  * warply STRATEGY    each `--strategy` (default: the router's default, adaptive), written as
                        the replayer's `[LABEL=]NAME[:JSON_KNOBS]`, e.g.
                        `floor16=adaptive:{"duplicate_floor": 16}`
  * sglang cache_aware  sglang-router 0.3.2 defaults (cache 0.3, balance abs 64, rel 1.5)
  * sglang cache_aware  with its balance thresholds tuned (`--sglang-tuned ABS,REL`, repeatable)

The engines get a KV cache smaller than the workload's distinct context
(`--num-gpu-blocks-override` = `--kv-fraction` x the distinct full blocks of all prompts, counted
with the model's tokenizer), so where a conversation lands decides whether its prefix survives.

Per row: engine-reported hit rate, twice (usage.prompt_tokens_details.cached_tokens over
prompt_tokens as the client got them; vLLM's own vllm:prefix_cache_hits/queries counters),
client TTFT p50/p90/mean, wall time, requests per engine (vllm:request_success), prefill
tokens per engine (vllm:prefix_cache_queries - hits: the tokens each computed), the mean count
of other requests in flight on a request's engine when it was sent (`co-run`), and the
client-minus-engine TTFT gap (client mean TTFT - vllm:time_to_first_token_seconds mean) and
`router+` = gap - the oracle's gap (its path has no router); under load this also holds the
engines' API-server queueing, which depends on placement. Warply rows also show the router's
own overhead p50 (/warply/cache_stats). After the rows, what each router adds with nothing
queued: sub-block requests one at a time, alternating direct and routed (`--latency-samples`).
Then the target checks for each warply cache-aware row.

sglang-router 0.3.2 runs from the project's SGLang venv (`bash scripts/setup_envs.sh sglang`
makes .venvs/sglang; `--sglang-router ''` skips its rows). Bounded: a fixed request list, a
per-row timeout and a whole-run `--deadline`; every process is stopped by its PID's process
group; everything binds 127.0.0.1.

    .venvs/core/bin/python bench/router_vs_sglang.py --vllm .venvs/vllm/bin/vllm \\
        --model $(.venvs/vllm/bin/python scripts/tiny_model.py --size tiny | tail -1)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import demo  # noqa: E402  (the demo's engines, workload and client; not a package)

from replay.__main__ import StrategySpec, parse_strategy, strategy_arg  # noqa: E402
from warply.common.argtypes import non_negative, output_folder, positive  # noqa: E402
from warply.launch import (  # noqa: E402
    HOST,
    EngineProcess,
    KvEvents,
    VllmServer,
    exit_on_termination,
    free_port,
    http_json,
    sglang_router_cmd,
)

Engines = list[tuple[VllmServer, KvEvents]]
ORACLE = "sticky oracle"
RR = "warply round_robin"


def _abs_rel(text: str) -> tuple[str, str]:
    """An --sglang-tuned value, ABS,REL: an integer >= 0 and a number > 0, kept as written."""
    abs_, comma, rel = text.partition(",")
    if not comma:
        raise argparse.ArgumentTypeError(f"{text!r} is not ABS,REL")
    non_negative(int)(abs_)
    positive(float)(rel)
    return abs_, rel


def _log(msg: str) -> None:
    print(f"[router-vs-sglang] {msg}", file=sys.stderr, flush=True)


def _sglang(python: str, engines: Engines, workdir: Path, tag: str,
            extra: list[str]) -> EngineProcess:
    port = free_port()
    cmd = sglang_router_cmd(python, port, [e.url for e, _ in engines], *extra)
    return EngineProcess(cmd, url=f"http://{HOST}:{port}", log_path=workdir / f"sgl-{tag}.log")


def _wait_registered(router: EngineProcess, engines: Engines) -> None:
    """sglang-router adds its workers after /health answers: wait until /workers lists both."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status, body = http_json("GET", router.url + "/workers", timeout=5)
        if status == 200 and all(e.url in json.dumps(body) for e, _ in engines):
            return
        time.sleep(0.5)
    raise TimeoutError("sglang-router did not register both workers in 120 s")


_COUNTERS = {
    "served": "vllm:request_success_total",
    "pc_queries": "vllm:prefix_cache_queries_total",
    "pc_hits": "vllm:prefix_cache_hits_total",
    "ttft_sum": "vllm:time_to_first_token_seconds_sum",
    "ttft_count": "vllm:time_to_first_token_seconds_count",
}


def _metrics(engine: VllmServer) -> dict[str, float]:
    """The engine's own counters we read (summed over label sets)."""
    got = engine.metrics(*_COUNTERS.values())
    return {key: got[name] for key, name in _COUNTERS.items()}


def _admin(url: str) -> dict[str, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {demo.TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def _distinct_blocks(items: list[dict[str, Any]], model: str, block: int) -> tuple[int, int]:
    """(distinct full KV blocks over all prompts, longest prompt in tokens), vLLM's tokenization
    for completions (special tokens added)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    seen: set[int] = set()
    longest = 0
    for item in items:
        ids = tok.encode(item["prompt"]).ids
        longest = max(longest, len(ids))
        key = 0
        for i in range(len(ids) // block):
            key = hash((key, tuple(ids[i * block:(i + 1) * block])))
            seen.add(key)
    return len(seen), longest


async def _added_latency(router: str, engines: list[str], samples: int) -> dict[str, float]:
    """What the router path adds with nothing queued: sub-block prompts (nothing cached), one at
    a time, alternating direct to an engine and through the router; TTFT differences in ms."""
    item = {"conversation": 0, "prompt": "warm up.\n", "max_tokens": 1}
    diffs = []
    async with aiohttp.ClientSession() as session:
        for i in range(samples):
            direct = await demo.send(session, engines[i % len(engines)], item)
            routed = await demo.send(session, router, item)
            diffs.append((routed["ttft_s"] - direct["ttft_s"]) * 1e3)
    return {"mean": statistics.fmean(diffs), "p50": statistics.median(diffs)}


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _co_running(done: list[dict[str, Any]], engines: list[str] | None) -> float | None:
    """Mean count of other requests in flight on a request's engine when it was sent (None
    where the row does not say which engine served each request)."""
    if engines is None:
        return None
    total = 0
    for i, d in enumerate(done):
        t = d["sent_s"]
        total += sum(1 for j, o in enumerate(done)
                     if j != i and engines[j] == engines[i] and o["sent_s"] < t < o["ended_s"])
    return total / len(done)


def _row(wall: float, done: list[dict[str, Any]], before: list[dict[str, float]],
         after: list[dict[str, float]]) -> dict[str, Any]:
    ttft = [d["ttft_s"] for d in done]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    served = [d["served"] for d in delta]
    computed = [d["pc_queries"] - d["pc_hits"] for d in delta]  # prefill each engine did
    q, h = sum(d["pc_queries"] for d in delta), sum(d["pc_hits"] for d in delta)
    n_eng = sum(d["ttft_count"] for d in delta)
    eng_ttft = sum(d["ttft_sum"] for d in delta) / n_eng if n_eng else float("nan")
    mean = statistics.fmean(ttft)
    return {
        "hit": sum(d["cached"] for d in done) / max(1, sum(d["prompt"] for d in done)),
        "hit_usage_missing": sum(1 for d in done if not d["prompt"]),
        "hit_counters": h / q if q else float("nan"),
        "p50": _quantile(ttft, 0.5) * 1e3,
        "p90": _quantile(ttft, 0.9) * 1e3,
        "mean": mean * 1e3,
        "gap": (mean - eng_ttft) * 1e3,
        "wall": wall,
        "served": served,
        "max_share": max(served) / max(1.0, sum(served)),
        "computed": computed,
        "max_computed_share": max(computed) / max(1.0, sum(computed)),
    }


async def _main(args: argparse.Namespace, workdir: Path, items: list[dict[str, Any]]) -> int:
    distinct, longest = _distinct_blocks(items, args.model, demo.BLOCK_SIZE)
    max_len = -(-(longest + 32) // 256) * 256
    min_blocks = -(-max_len // demo.BLOCK_SIZE) + 1
    blocks = args.num_blocks or max(min_blocks, int(args.kv_fraction * distinct))
    prompt_tokens = None
    _log(f"workload: {len(items)} requests, {len({i['conversation'] for i in items})} "
         f"conversations, {distinct} distinct full blocks of {demo.BLOCK_SIZE} tokens, longest "
         f"prompt {longest} tokens; KV cache {blocks} blocks per engine, max-model-len {max_len}")
    if blocks >= distinct:
        _log(f"warning: {blocks} KV blocks per engine hold the whole distinct context ({distinct})")
    engines = demo.engine_pair(args.vllm, args.model, workdir, [
        "--max-model-len", str(max_len), "--num-gpu-blocks-override", str(blocks)])
    conv_order = list(dict.fromkeys(i["conversation"] for i in items))
    pin = {c: engines[k % 2][0].url for k, c in enumerate(conv_order)}

    def warply(spec: StrategySpec) -> Callable[[], EngineProcess]:
        knobs = spec.knobs.model_dump(exclude_unset=True) or None  # None: the demo's knobs
        label = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec.label).strip("_")
        return lambda: demo.router_process(spec.name, engines, args.model, workdir, knobs, label)

    def sgl(tag: str, extra: list[str]) -> Callable[[], EngineProcess]:
        return lambda: _sglang(args.sglang_router, engines, workdir, tag, extra)

    rr = parse_strategy("round_robin")
    rows: dict[str, Callable[[], EngineProcess] | None] = {ORACLE: None, RR: warply(rr)}
    for spec in args.specs:
        rows[f"warply {spec.label}"] = warply(spec)
    if args.sglang_router:
        rows["sglang cache_aware default"] = sgl("default", [])
        for a, r in args.sglang_tuned:
            rows[f"sglang cache_aware abs={a} rel={r}"] = sgl(
                f"abs{a}-rel{r}",
                ["--balance-abs-threshold", a, "--balance-rel-threshold", r])
    runs: dict[str, list[dict[str, Any]]] = {}
    dump: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    added: dict[str, dict[str, float]] = {}
    try:
        for e, _ in engines:
            e.start()
            _log(f"vLLM pid {e.pid} starting (log {e.log_path})")
        for e, _ in engines:
            _log(f"vLLM {e.url} healthy after {e.wait_healthy(300):.0f}s")
        # Warm-up, before every row: one short request (under one KV block, so nothing is
        # cached) per engine through the row's path, so no row pays for a cold client/router.
        warm = [{"conversation": -1 - k, "prompt": "warm up.\n", "max_tokens": 1}
                for k in range(2)]
        for rep in range(args.repeats):
            for name, make in rows.items():
                if name in errors:
                    continue
                demo.reset_caches(engines)
                overhead = predicted = None
                try:
                    if make is None:
                        own = [e.url for e, _ in engines]
                        await demo.replay(lambda it, o=own: o[-1 - it["conversation"]], warm, 1)
                        await asyncio.sleep(args.settle_s)
                        before = [_metrics(e) for e, _ in engines]
                        wall, done = await asyncio.wait_for(
                            demo.replay(lambda it: pin[it["conversation"]], items, args.in_flight),
                            args.timeout_s)
                    else:
                        with make() as router:
                            router.wait_healthy(120, path="/v1/models")
                            if name.startswith("sglang"):
                                _wait_registered(router, engines)
                            _log(f"{name} (pid {router.pid}) up; replaying")
                            await demo.replay(lambda it, u=router.url: u, warm, 1)
                            await asyncio.sleep(args.settle_s)
                            before = [_metrics(e) for e, _ in engines]
                            wall, done = await asyncio.wait_for(
                                demo.replay(lambda it, u=router.url: u, items, args.in_flight),
                                args.timeout_s)
                            if name.startswith("warply"):
                                await asyncio.sleep(0.5)
                                stats = _admin(router.url + "/warply/cache_stats")
                                overhead = stats["overhead_s"]["p50"]
                                predicted = stats["hit_rate"]["predicted"]
                except (RuntimeError, TimeoutError, OSError, aiohttp.ClientError) as exc:
                    errors[name] = f"{type(exc).__name__}: {exc}"[:300]
                    _log(f"{name} failed: {errors[name]}")
                    continue
                await asyncio.sleep(0.5)  # let the engines' counters settle
                after = [_metrics(e) for e, _ in engines]
                row = _row(wall, done, before, after)
                served_by: list[str] | None = None  # sglang-router names no engine
                if make is None:
                    served_by = [pin[it["conversation"]] for it in items]
                elif name.startswith("warply"):
                    served_by = [d["worker"] for d in done]
                row["co_running"] = _co_running(done, served_by)
                row["overhead"] = None if overhead is None else overhead * 1e3
                row["predicted"] = predicted
                prompt_tokens = sum(d["prompt"] for d in done)
                runs.setdefault(name, []).append(row)
                dump.append({"row": name, "round": rep, "summary": row, "requests": [
                    dict(d, conversation=it["conversation"]) for d, it in zip(done, items,
                                                                              strict=True)]})
                (workdir / "results.json").write_text(json.dumps(dump, indent=1))
                _log(f"round {rep + 1} {name}: hit {row['hit']:.3f}, TTFT mean "
                     f"{row['mean']:.1f} ms, wall {row['wall']:.1f} s")
        urls = [e.url for e, _ in engines]
        for name, make in (("warply-router (round_robin)", warply(rr)),
                           ("sglang-router (cache_aware)", sgl("added", []))):
            if args.latency_samples <= 0 or (name.startswith("sglang") and not args.sglang_router):
                continue
            with make() as router:
                router.wait_healthy(120, path="/v1/models")
                if name.startswith("sglang"):
                    _wait_registered(router, engines)
                added[name] = await _added_latency(router.url, urls, args.latency_samples)
                _log(f"{name}: adds {added[name]['mean']:.1f} ms mean at 1 in flight")
    finally:
        for e, _ in engines:
            e.stop()
    _print(args, items, prompt_tokens, distinct, blocks, runs, errors, added)
    return 0 if not errors else 1


def _mean(rs: list[dict[str, Any]], k: str) -> Any:
    vals = [r[k] for r in rs]
    if vals[0] is None:
        return None
    if isinstance(vals[0], list):
        return [statistics.fmean(v) for v in zip(*vals, strict=True)]
    return statistics.fmean(vals)


def _print(args: argparse.Namespace, items: list[dict[str, Any]], prompt_tokens: int | None,
           distinct: int, blocks: int, runs: dict[str, list[dict[str, Any]]],
           errors: dict[str, str], added: dict[str, dict[str, float]]) -> None:
    agg = {n: {k: _mean(rs, k) for k in rs[0]} for n, rs in runs.items()}
    print(f"\n{len(items)} requests in {args.conversations} conversations, {prompt_tokens} "
          f"prompt tokens, {distinct} distinct {demo.BLOCK_SIZE}-token blocks; KV cache "
          f"{blocks} blocks per engine ({blocks / distinct:.2f} of the distinct context); "
          f"{args.in_flight} in flight; mean of {args.repeats} run(s)")
    head = (f"{'row':34s}{'hit':>7s}{'hit ctr':>8s}{'p50 ms':>8s}{'p90 ms':>8s}{'mean ms':>8s}"
            f"{'wall s':>7s}{'req/engine':>11s}{'prefill/engine':>15s}{'co-run':>7s}"
            f"{'gap ms':>7s}{'router+':>8s}{'ovh p50':>8s}{'pred':>6s}")
    print(head)
    oracle_gap = agg.get(ORACLE, {}).get("gap")
    for n, r in agg.items():
        plus = "-" if oracle_gap is None or n == ORACLE else f"{r['gap'] - oracle_gap:+.1f}"
        ovh = "-" if r["overhead"] is None else f"{r['overhead']:.2f}"
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.3f}"
        split = "/".join(f"{x:.0f}" for x in r["served"])
        work = "/".join(f"{x:.0f}" for x in r["computed"])
        co = "-" if r["co_running"] is None else f"{r['co_running']:.2f}"
        print(f"{n:34s}{r['hit']:7.3f}{r['hit_counters']:8.3f}{r['p50']:8.1f}{r['p90']:8.1f}"
              f"{r['mean']:8.1f}{r['wall']:7.1f}{split:>11s}{work:>15s}{co:>7s}{r['gap']:7.1f}"
              f"{plus:>8s}{ovh:>8s}{pred:>6s}")
    for n, msg in errors.items():
        print(f"{n:34s} FAILED: {msg}")
    print("hit: engine-reported cached_tokens / prompt_tokens (usage); hit ctr: vLLM "
          "prefix_cache hits/queries; prefill/engine: prompt tokens each engine computed "
          "(prefix_cache queries - hits); co-run: other requests in flight on a request's engine "
          "when it was sent, mean; gap: client mean TTFT - engine mean TTFT; router+: gap - "
          "oracle gap; ovh p50: warply's own receipt->upstream overhead; pred: warply's "
          "router-predicted hit rate (its index's view when it placed)")
    if added:
        print(f"\nrouter-added TTFT with nothing queued ({args.latency_samples} sub-block "
              "requests, alternating direct and routed, one at a time):")
        for n, a in added.items():
            print(f"  {n:30s} mean {a['mean']:+6.1f} ms  p50 {a['p50']:+6.1f} ms")
    missing = {n: r["hit_usage_missing"] for n, r in agg.items() if r["hit_usage_missing"]}
    if missing:
        print(f"note: requests without usage (hit undercounted there): {missing}")
    sgl = {n: r for n, r in agg.items() if n.startswith("sglang")}
    rr = agg.get(RR)
    oracle = agg.get(ORACLE)
    print("\ntarget checks")
    all_ok = True
    if rr is not None and len(runs[RR]) > 1:
        means = [r["mean"] for r in runs[RR]]
        hits = [r["hit"] for r in runs[RR]]
        print(f"round_robin's own spread over {len(means)} rounds: TTFT mean "
              f"{min(means):.1f}-{max(means):.1f} ms ({max(means) / min(means) - 1:.1%} max/min), "
              f"hit {min(hits):.3f}-{max(hits):.3f}")
    for spec in args.specs:
        n = f"warply {spec.label}"
        if n not in agg:
            print(f"  {n}: no result")
            all_ok = False
            continue
        r = agg[n]
        checks = []
        if oracle is not None:
            checks.append((f"hit {r['hit']:.3f} >= sticky oracle {oracle['hit']:.3f}",
                           r["hit"] >= oracle["hit"]))
        for m, x in sgl.items():
            checks.append((f"hit {r['hit']:.3f} >= {m} {x['hit']:.3f}", r["hit"] >= x["hit"]))
        if rr is not None:
            checks.append((f"TTFT mean {r['mean']:.1f} <= 0.9 x round_robin "
                           f"{0.9 * rr['mean']:.1f} ms", r["mean"] <= 0.9 * rr["mean"]))
            worst = max(x["mean"] for x in runs[n])
            best_rr = min(x["mean"] for x in runs[RR])
            checks.append((f"slowest round {worst:.1f} < round_robin's fastest {best_rr:.1f} ms",
                           worst < best_rr))
        checks.append((f"busiest engine {r['max_share']:.0%} <= 60% of requests (prefill "
                       f"tokens: {r['max_computed_share']:.0%} on the busiest)",
                       r["max_share"] <= 0.6))
        for text, ok in checks:
            all_ok = all_ok and ok
            print(f"  {n}: {'PASS' if ok else 'FAIL'}  {text}")
    if errors or sgl == {} or oracle is None or rr is None:
        all_ok = False
    print(f"all targets {'met' if all_ok else 'NOT met'}")


class Deadline(Exception):
    """The whole-run --deadline passed (not caught per row)."""


def _alarm(signum: int, frame: Any) -> None:
    raise Deadline("whole-run --deadline reached")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm", required=True, help="the vllm CLI of the engine venv")
    ap.add_argument("--model", required=True,
                    help="model folder: scripts/tiny_model.py --size tiny (default) or small")
    ap.add_argument("--strategy", action="append", type=strategy_arg,
                    help="warply strategy row (repeatable; default: adaptive, the default)")
    ap.add_argument("--sglang-router", default=str(ROOT / ".venvs" / "sglang" / "bin" / "python"),
                    help="python of a venv with sglang-router 0.3.2 (default: the project's "
                    "SGLang venv; '' skips its rows)")
    ap.add_argument("--sglang-tuned", action="append", type=_abs_rel, metavar="ABS,REL",
                    help="cache_aware with --balance-abs-threshold ABS --balance-rel-threshold "
                    "REL (repeatable; default: 1,1.2 and 2,1.1)")
    demo.add_workload_flags(ap, conversations=32)
    ap.add_argument("--kv-fraction", type=positive(float), default=0.55,
                    help="KV blocks per engine as a fraction of the distinct context")
    ap.add_argument("--num-blocks", type=non_negative(int), default=0,
                    help="KV blocks per engine (overrides)")
    ap.add_argument("--repeats", type=positive(int), default=3,
                    help="rounds of every row, averaged")
    ap.add_argument("--settle-s", type=non_negative(float), default=3.0,
                    help="pause after each row's warm-up, before its timed requests (default 3)")
    ap.add_argument("--latency-samples", type=non_negative(int), default=40,
                    help="pairs for the router-added latency at 1 in flight (0: skip)")
    ap.add_argument("--timeout-s", type=positive(float), default=300, help="per row")
    ap.add_argument("--deadline", type=positive(float), default=1500, help="whole run, seconds")
    ap.add_argument(
        "--workdir", type=output_folder, help="logs and configs (default: a temp folder)"
    )
    args = ap.parse_args()
    if args.sglang_tuned is None:
        args.sglang_tuned = [("1", "1.2"), ("2", "1.1")]
    args.specs = [parse_strategy(s) for s in args.strategy or ["adaptive"]]
    items = demo.flagged_workload(ap, args)
    if args.sglang_router and not Path(args.sglang_router).is_file():
        ap.error(f"no python at --sglang-router {args.sglang_router}: run `bash "
                 "scripts/setup_envs.sh sglang`, or pass --sglang-router '' to skip its rows")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="warply-vs-sglang-"))
    workdir.mkdir(parents=True, exist_ok=True)
    _log(f"logs in {workdir}")
    signal.signal(signal.SIGALRM, _alarm)
    exit_on_termination()
    signal.alarm(int(args.deadline))
    try:
        return asyncio.run(_main(args, workdir, items))
    except (RuntimeError, TimeoutError, Deadline) as exc:
        print(f"router_vs_sglang failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)


if __name__ == "__main__":
    sys.exit(main())
