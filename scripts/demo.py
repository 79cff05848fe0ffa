"""Warply's main job on this machine: two real vLLM CPU engines behind `warply-router`.

Starts two `vllm serve` processes (one per core, stock KV-event streams), then for each strategy
(adaptive, prefix_affinity, round_robin by default) starts `warply-router` in front of them,
clears both engines' prefix caches, and replays a multi-turn workload derived from the Mooncake
conversation trace (scripts/data/mooncake_conversations.jsonl, shipped here). Prompts are
texts built from each request's `hash_ids` (one seeded line of words per id), so equal hash
chains are equal token prefixes, as in the trace. Ends with the routers' /warply/cache_stats
side by side.

    .venvs/core/bin/python scripts/demo.py --vllm .venvs/vllm/bin/vllm --model DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from replay.trace import exiting_on_bad_trace, read_trace
from replay.workloads import as_record
from warply.common.argtypes import output_folder, positive
from warply.launch import (
    KvEvents,
    RouterServer,
    VllmServer,
    exit_on_termination,
    free_port,
    http_json,
    kv_event_engines,
)

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "scripts" / "data" / "mooncake_conversations.jsonl"
"""The demo's workload: conversations from the Mooncake trace, shipped with the project."""
MODEL_NAME = "tiny"
BLOCK_SIZE = 32  # vLLM 0.32 CPU attention needs a multiple of 32
TOKEN = "demo-admin"
STRATEGIES = ("adaptive", "prefix_affinity", "round_robin")
# Every trace request shares hash id 0 (a system prompt): a request whose cached prefix is under
# 5 % of its blocks starts a conversation (spread evenly over the workers) instead of following
# that one block; longer shared prefixes, such as a few ids common to two conversations, bind.
KNOBS = {"prefix_affinity": {"min_match_ratio": 0.05}}


def _log(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an which you not "
    "have can all one cache block prefix token model request user system assistant please answer "
    "question data value time page memory"
).split()


def conversation_groups(rows: list[dict[str, Any]]) -> list[list[int]]:
    """Row indices of each multi-turn conversation (≥ 2 requests), in trace order.

    A conversation is the requests sharing their first two hash ids (id 0 is the trace's shared
    system prompt)."""
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        ids = row["hash_ids"]
        if len(ids) > 1:
            groups[(ids[0], ids[1])].append(i)
    return [g for g in groups.values() if len(g) >= 2]


def workload(
    trace: Path, conversations: int, turns: int, words_per_id: int, max_ids: int
) -> list[dict[str, Any]]:
    """The first `conversations` multi-turn chains of the trace (≥ 2 turns), in trace order.

    A conversation is the requests sharing their first two hash ids (id 0 is the trace's shared
    system prompt). Each hash id becomes one line of `words_per_id` words drawn by a generator
    seeded with the id, so equal hash chains are equal texts; each line ends in a newline, which
    the byte-level pre-tokenizer always splits off, so equal chains are equal token prefixes too.
    """
    rows = [as_record(r) for r in read_trace(trace)]  # a bad line is a TraceError naming it
    chosen = [g[:turns] for g in conversation_groups(rows)][:conversations]
    order = sorted((i, conv) for conv, idxs in enumerate(chosen) for i in idxs)
    lines: dict[int, str] = {}
    out = []
    for i, conv in order:
        for h in rows[i]["hash_ids"][:max_ids]:
            if h not in lines:
                rng = random.Random(h)
                lines[h] = " ".join(rng.choice(WORDS) for _ in range(words_per_id)) + ".\n"
        prompt = "".join(lines[h] for h in rows[i]["hash_ids"][:max_ids])
        out.append({"conversation": conv, "prompt": prompt,
                    "max_tokens": max(1, min(16, rows[i]["output_length"]))})
    return out


async def send(session: aiohttp.ClientSession, url: str, item: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion; returns TTFT and cached tokens as the client sees them, the
    router's worker and predicted cached tokens (-1 without a Warply router), and when it was
    sent and when it ended (`time.perf_counter()` seconds: what was in flight at once)."""
    body = {"model": MODEL_NAME, "prompt": item["prompt"], "max_tokens": item["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {await r.text()}")
        async for line in r.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft, "cached": details.get("cached_tokens") or 0,
            "prompt": usage.get("prompt_tokens") or 0,
            "worker": r.headers.get("X-Warply-Worker", "?"),
            "predicted": int(r.headers.get("X-Warply-Predicted-Cached", -1)),
            "sent_s": t0, "ended_s": time.perf_counter()}


async def replay(
    route: Callable[[dict[str, Any]], str], items: list[dict[str, Any]], in_flight: int
) -> tuple[float, list[Any]]:
    """Send each item to `route(item)`, in order, at most `in_flight` at once; a conversation's
    turns never overlap. Returns the wall time and each request's `send()` result."""
    sem = asyncio.Semaphore(in_flight)
    last: dict[int, asyncio.Task[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:

        async def run(
            item: dict[str, Any], before: asyncio.Task[dict[str, Any]] | None
        ) -> dict[str, Any]:
            if before is not None:
                await before
            async with sem:
                return await send(session, route(item), item)

        tasks = []
        for item in items:
            task = asyncio.create_task(run(item, last.get(item["conversation"])))
            last[item["conversation"]] = task
            tasks.append(task)
        done = await asyncio.gather(*tasks)
    return time.perf_counter() - t0, done


def engine_pair(
    vllm: str, model: str, workdir: Path, extra_args: Sequence[str] = ()
) -> list[tuple[VllmServer, KvEvents]]:
    """Two vLLM CPU engines (cores 0 and 1) with KV-event streams.

    `extra_args` go last on each `vllm serve` line (a repeated flag overrides the default)."""
    args = ["--block-size", str(BLOCK_SIZE), "--max-model-len", "4096", "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--seed", "0", *extra_args]  # fmt: skip
    return kv_event_engines(vllm, model, workdir, served_name=MODEL_NAME, args=args,
                            env={"VLLM_SERVER_DEV_MODE": "1"})  # fmt: skip


def router_process(
    strategy: str,
    engines: list[tuple[VllmServer, KvEvents]],
    model: str,
    workdir: Path,
    knobs: dict[str, Any] | None = None,
    label: str | None = None,
) -> RouterServer:
    """`warply-router` over the engines with `strategy` and its `knobs` (default: the demo's);
    `label` names its log and config files (default: the strategy's name)."""
    workers = [events.worker(f"engine-{i}", e.url) for i, (e, events) in enumerate(engines)]
    knobs = KNOBS.get(strategy, {}) if knobs is None else knobs
    config = {
        "model": MODEL_NAME, "tokenizer": model, "port": free_port(), "auth_token": TOKEN,
        "strategy": {"name": strategy, "knobs": knobs},
        "pools": [{"name": "cpu", "block_size": BLOCK_SIZE, "workers": workers}],
    }  # fmt: skip
    return RouterServer(config, workdir, name=f"router-{label or strategy}")


def reset_caches(engines: list[tuple[VllmServer, KvEvents]]) -> None:
    """Empty both engines' prefix caches (VLLM_SERVER_DEV_MODE), so each run starts cold.

    vLLM 0.32 publishes the reset's AllBlocksCleared event only from its next scheduler step, so
    each engine then serves one sub-block request (nothing cached): a router subscribing next
    sees the caches empty instead of the previous run's blocks."""
    for engine, _ in engines:
        status, body = http_json("POST", engine.url + "/reset_prefix_cache")
        if status != 200:
            raise RuntimeError(f"reset_prefix_cache on {engine.url}: {status} {body}")
        status, body = http_json("POST", engine.url + "/v1/completions", {
            "model": MODEL_NAME, "prompt": "warm up.\n", "max_tokens": 1})
        if status != 200:
            raise RuntimeError(f"warm-up on {engine.url}: {status} {body}")


async def _run(args: argparse.Namespace, workdir: Path, items: list[dict[str, Any]]) -> int:
    chars = sum(len(i["prompt"]) for i in items)
    _log(f"workload: {len(items)} requests in {args.conversations} conversations, "
         f"{chars} prompt characters, from {args.trace}")
    engines = engine_pair(args.vllm, args.model, workdir)
    results: dict[str, dict[str, Any]] = {}
    try:
        for engine, _ in engines:
            engine.start()
            _log(f"starting vLLM (pid {engine.pid}, log {engine.log_path})")
        for engine, _ in engines:
            _log(f"vLLM {engine.url} healthy after {engine.wait_healthy():.0f}s")
        # vLLM's first prefills of each length run slower (CPU kernels warming up): one untimed
        # pass straight to the engines, so the first strategy measured does not pay for it.
        _log("warm-up pass straight to the engines (not measured) ...")
        urls = [engine.url for engine, _ in engines]
        await replay(lambda item: urls[item["conversation"] % len(urls)], items, args.in_flight)
        for strategy in args.strategy or STRATEGIES:
            reset_caches(engines)
            with router_process(strategy, engines, args.model, workdir) as router:
                router.wait_healthy(60)
                _log(f"router ({strategy}, pid {router.pid}) up; replaying ...")
                wall, _ = await replay(lambda _, u=router.url: u, items, args.in_flight)
                await asyncio.sleep(0.5)
                req = aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"})
                async with req, req.get(router.url + "/warply/cache_stats") as r:
                    stats = await r.json()
                stats["wall_s"] = wall
                results[strategy] = stats
    finally:
        for engine, _ in engines:
            engine.stop()
    _print(results)
    return 0


def _fmt(x: float | None, scale: float = 1.0, spec: str = ".3f") -> str:
    return "-" if x is None else format(x * scale, spec)


def _print(results: dict[str, dict[str, Any]]) -> None:
    rows = [
        ("requests", lambda s: str(s["requests"])),
        ("prompt tokens", lambda s: str(s["prompt_tokens"])),
        ("engine cached tokens", lambda s: str(s["engine_cached_tokens"])),
        ("hit rate (engine-reported)", lambda s: _fmt(s["hit_rate"]["engine"])),
        ("hit rate (router-predicted)", lambda s: _fmt(s["hit_rate"]["predicted"])),
        ("TTFT p50 ms (at router)", lambda s: _fmt(s["ttft_s"]["p50"], 1e3, ".1f")),
        ("TTFT p99 ms (at router)", lambda s: _fmt(s["ttft_s"]["p99"], 1e3, ".1f")),
        ("router overhead p50 ms", lambda s: _fmt(s["overhead_s"]["p50"], 1e3, ".2f")),
        ("requests per worker", lambda s: "/".join(
            str(w.get("requests", 0)) for w in s["workers"].values())),
        ("wall time s", lambda s: _fmt(s["wall_s"], 1.0, ".1f")),
    ]
    names = list(results)
    print(f"\n{'cache_stats':30s}" + "".join(f"{n:>18s}" for n in names))
    for label, get in rows:
        print(f"{label:30s}" + "".join(f"{get(results[n]):>18s}" for n in names))


def add_workload_flags(ap: argparse.ArgumentParser, conversations: int) -> None:
    """The flags of the conversation workload (`workload`, sent by `replay`), shared with the
    bench that sends the same workload through other routers."""
    ap.add_argument("--trace", type=Path, default=TRACE, help="conversation trace (JSONL)")
    ap.add_argument("--conversations", type=positive(int), default=conversations,
                    help="conversations sent")
    ap.add_argument("--turns", type=positive(int), default=4, help="turns kept per conversation")
    ap.add_argument("--words-per-id", type=positive(int), default=24,
                    help="words per trace hash id")
    ap.add_argument("--max-ids", type=positive(int), default=48, help="hash ids kept per prompt")
    ap.add_argument("--in-flight", type=positive(int), default=4, help="requests open at once")


def flagged_workload(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The `workload` its flags (`add_workload_flags`) describe; a trace that cannot be read
    ends the program with one line naming it (exit 2), before anything starts."""
    with exiting_on_bad_trace(ap.prog):
        return workload(args.trace, args.conversations, args.turns, args.words_per_id, args.max_ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm", required=True, help="the vllm CLI of the engine venv")
    ap.add_argument("--model", required=True, help="model folder (scripts/tiny_model.py)")
    add_workload_flags(ap, conversations=16)
    ap.add_argument(
        "--strategy",
        action="append",
        help=f"router strategy to run, in turn (repeatable; default: {', '.join(STRATEGIES)})",
    )
    ap.add_argument("--workdir", type=output_folder, help="where logs go (default: a temp folder)")
    args = ap.parse_args()
    exit_on_termination()
    items = flagged_workload(ap, args)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="warply-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return asyncio.run(_run(args, workdir, items))
    except (RuntimeError, TimeoutError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
