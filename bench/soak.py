"""Soak: many concurrent streaming chat clients against the real router over simulated workers.

Starts `--workers` simulated workers (`replay.serve`, a simulator; spread over
`--sim-processes` processes) and `python -m router` in front of them (one pool, the default
strategy unless `--strategy`), all on 127.0.0.1, then runs `--clients` client tasks for
`--duration` seconds. Each client holds multi-turn conversations (one of `--systems` shared
system prompts, `--turns` turns of random user text, the streamed answer appended as the
assistant's message, `--think` seconds between turns), so where a conversation lands matters.
Every request streams (`stream_options.include_usage`).

Reported (stdout, and `--json`): requests sent / completed, errors by kind (HTTP status, error
event in the stream, stream without [DONE], fewer tokens than asked, timeout, connection), the
router's RSS (its process group) every `--rss-interval` seconds with the slope of a linear fit
after `--warmup` (bytes per minute), also of RSS less the tokenizer cache (chunks and remembered
prompts, from /metrics) and of RSS from when the chunk cache is full (`--tokenizer-cache-mib`:
the router's bounded structures fill at the rate of new prompt text; once full, a slope is
growth they do not explain), router CPU, client TTFT, the simulator's own TTFT (from
its usage chunk) and the router-added latency per request (client TTFT minus the simulator's;
an upper bound: it also holds both loopback hops and any lag of the simulator's event loop
before its handler runs), streams in flight, hit rates, and the router's /metrics request count
set against the clients' count. The load average is printed beside the figures.

Bounded: clients start no request after `--duration`, every request has a timeout, the whole
client phase a hard limit; every process is stopped by its PID's process group.

    .venvs/core/bin/python bench/soak.py                      # 600 s, 500 clients, 32 workers
    .venvs/core/bin/python bench/soak.py --duration 60 --json /tmp/soak.json   # a dry run
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from _models import newest_tiny
from prometheus_client.parser import text_string_to_metric_families

from router.config import RouterConfig
from warply.common.argtypes import non_negative, output_file, output_folder, positive
from warply.launch import EngineProcess, RouterServer, SimWorkers, exit_on_termination, free_port

MODEL = "tiny"
WORDS = (
    "cache prefix block token router engine worker request stream answer question tenant "
    "memory eviction latency throughput batch decode prefill schedule queue policy index"
).split()


def _log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def _pair(kind: type) -> Any:
    def parse(text: str) -> tuple[Any, Any]:
        lo, _, hi = text.partition(",")
        a, b = kind(lo), kind(hi or lo)
        if not 0 <= a <= b:
            raise argparse.ArgumentTypeError(f"want LO,HI with 0 <= LO <= HI, got {text!r}")
        return a, b

    return parse


def _knobs(text: str) -> dict[str, Any]:
    try:
        knobs = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(knobs, dict):
        raise argparse.ArgumentTypeError("want a JSON object")
    return knobs


@dataclass
class Tally:
    """What the clients saw (bounded: one float per completed request in each list)."""

    sent: int = 0
    completed: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    in_flight: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    sim_ttft_ms: list[float] = field(default_factory=list)
    added_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_tokens: int = 0
    loop_lag_ms: list[float] = field(default_factory=list)
    """How late the clients' own event loop woke for a 1 s timer (their share of CPU)."""
    metrics_failures: int = 0
    """RSS samples whose /metrics read failed or took over `--rss-interval` (the tokenizer
    cache's bytes carried over from the sample before)."""


@dataclass
class Outcome:
    error: str = ""
    text: str = ""


def _user_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) + "?"


async def _request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], tally: Tally
) -> Outcome:
    """One streamed chat request; its outcome (an error kind, or the answer's text)."""
    tally.sent += 1
    tally.in_flight += 1
    start = time.monotonic()
    first = -1.0
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    sim: dict[str, Any] = {}
    done = False
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return Outcome(f"http_{resp.status}")
            predicted = int(resp.headers.get("X-Warply-Predicted-Cached", 0))
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                if first < 0:
                    first = time.monotonic()
                if line == b"data: [DONE]":
                    done = True  # read on to the end: the connection goes back to the pool
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(f"stream_error_{chunk['error'].get('code', '')}")
                for choice in chunk.get("choices") or ():
                    if content := choice.get("delta", {}).get("content"):
                        pieces.append(content)
                if chunk.get("usage"):
                    usage, sim = chunk["usage"], chunk.get("simulator") or {}
    except TimeoutError:
        return Outcome("timeout")
    except aiohttp.ClientError as exc:
        return Outcome(f"connection_{type(exc).__name__}")
    except ValueError:
        return Outcome("bad_json")
    finally:
        tally.in_flight -= 1
    if not done:
        return Outcome("no_done")
    if usage is None:
        return Outcome("no_usage")
    if len(pieces) != body["max_tokens"]:
        return Outcome("short_stream")
    tally.completed += 1
    ttft = (first - start) * 1000
    tally.ttft_ms.append(ttft)
    if "ttft_ms" in sim:
        tally.sim_ttft_ms.append(sim["ttft_ms"])
        tally.added_ms.append(ttft - sim["ttft_ms"])
    tally.prompt_tokens += usage["prompt_tokens"]
    tally.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    tally.predicted_tokens += predicted
    return Outcome(text="".join(pieces))


async def _client(
    i: int,
    args: argparse.Namespace,
    url: str,
    session: aiohttp.ClientSession,
    tally: Tally,
    systems: list[str],
    deadline: float,
) -> None:
    rng = random.Random(args.seed * 1_000_003 + i)
    await asyncio.sleep(rng.uniform(0, args.ramp))
    while time.monotonic() < deadline:
        messages = [{"role": "system", "content": rng.choice(systems)}]
        for _ in range(rng.randint(*args.turns)):
            if time.monotonic() >= deadline:
                return
            messages.append({"role": "user", "content": _user_text(rng)})
            body = {
                "model": MODEL,
                "messages": messages,
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": rng.randint(*args.max_tokens),
            }
            out = await _request(session, url, body, tally)
            if out.error:
                tally.errors[out.error] += 1
                break  # a new conversation
            messages.append({"role": "assistant", "content": out.text})
            await asyncio.sleep(rng.uniform(*args.think))


def _group_stats(pgid: int) -> tuple[int, float]:
    """(RSS bytes, CPU seconds) summed over the processes of one process group."""
    rss, cpu = 0, 0.0
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # pgrp
            cpu += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            rss += int(fields[21]) * page
    return rss, cpu


async def _sample(
    session: aiohttp.ClientSession,
    router: EngineProcess,
    interval: float,
    stop: asyncio.Event,
    out: list[Sample],
    tally: Tally,
    flights: list[tuple[float, int]],
) -> None:
    t0 = time.monotonic()
    next_rss = 0.0
    while not stop.is_set():
        now = time.monotonic() - t0
        flights.append((now, tally.in_flight))
        if now >= next_rss:
            rss, cpu = _group_stats(router.pid)
            chunks, texts = out[-1][3:] if out else (0.0, 0.0)
            try:  # a starved router may be slow to answer: the RSS sample stands regardless
                m = await asyncio.wait_for(_metrics(session, router.url), interval)
                chunks, texts = m.get(_TOK_BYTES, 0.0), m.get(_TOK_TEXTS, 0.0)
            except (TimeoutError, aiohttp.ClientError):
                tally.metrics_failures += 1
            out.append((now, rss, cpu, chunks, texts))
            next_rss = now + interval
        due = time.monotonic() + 1.0
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            tally.loop_lag_ms.append((time.monotonic() - due) * 1000)


Sample = tuple[float, int, float, float, float]
"""Seconds since the start, router RSS bytes, router CPU seconds, tokenizer chunk cache bytes,
its remembered texts' bytes."""
_TOK_BYTES = "warply_router_tokenizer_cache_bytes"
_TOK_TEXTS = "warply_router_tokenizer_texts_bytes"
_FULL = 0.95
"""The chunk cache counts as full from this fraction of its budget on."""
_SUMMED = (
    "warply_router_overhead_seconds_sum",
    "warply_router_overhead_seconds_count",
    "warply_index_entries",
    _TOK_BYTES,
    _TOK_TEXTS,
)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "warply_router_requests_total":
                out[f"requests_{s.labels.get('status', '')}"] += s.value
                out["requests"] += s.value
            elif s.name in _SUMMED:
                out[s.name] += s.value
    return dict(out)


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _drive(
    args: argparse.Namespace, router: EngineProcess, sims: list[SimWorkers]
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    systems = [
        f"System {k}: you are assistant {k} of a fleet. " + _user_text(rng) * 4
        for k in range(args.systems)
    ]
    tally = Tally()
    samples: list[Sample] = []
    flights: list[tuple[float, int]] = []
    stop = asyncio.Event()
    url = router.url + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_read=30)
    connector = aiohttp.TCPConnector(limit=0)
    load_before = os.getloadavg()
    cpu0 = (_own_cpu(), sum(_group_stats(s.pid)[1] for s in sims))
    t0 = time.monotonic()
    deadline = t0 + args.duration
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        sampler = asyncio.create_task(
            _sample(session, router, args.rss_interval, stop, samples, tally, flights)
        )
        before = await _metrics(session, router.url)
        clients = [
            asyncio.create_task(_client(i, args, url, session, tally, systems, deadline))
            for i in range(args.clients)
        ]
        progress = asyncio.create_task(_progress(tally, samples, t0))
        _, late = await asyncio.wait(clients, timeout=args.duration + args.request_timeout + 30)
        for task in late:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        wall = time.monotonic() - t0
        cpu1 = (_own_cpu(), sum(_group_stats(s.pid)[1] for s in sims))
        progress.cancel()
        stop.set()
        await sampler
        after = await _metrics(session, router.url)
        async with session.get(router.url + "/warply/cache_stats") as r:
            stats = await r.json()
    report = _report(
        args, tally, samples, flights, before, after, stats, wall, len(late), load_before
    )
    report["clients_cpu_cores"] = round((cpu1[0] - cpu0[0]) / wall, 2)
    report["simulators_cpu_cores"] = round((cpu1[1] - cpu0[1]) / wall, 2)
    return report


async def _progress(
    tally: Tally, samples: list[Sample], t0: float
) -> None:
    while True:
        await asyncio.sleep(30)
        rss = samples[-1][1] / 2**20 if samples else float("nan")
        _log(
            f"t={time.monotonic() - t0:.0f}s sent={tally.sent} ok={tally.completed} "
            f"errors={sum(tally.errors.values())} in_flight={tally.in_flight} "
            f"router_rss={rss:.1f} MiB load={os.getloadavg()[0]:.1f}"
        )


def _slopes(samples: list[Sample], after: float) -> tuple[float, float]:
    """Bytes per minute of a least-squares line through the RSS samples from `after` seconds
    on, and through RSS less the tokenizer cache (chunks and texts); NaN with under 3."""
    fit = np.array([x for x in samples if x[0] >= after], dtype=float).reshape(-1, 5)
    if len(fit) < 3:
        return float("nan"), float("nan")
    t, rss = fit[:, 0], fit[:, 1]
    rest = rss - fit[:, 3] - fit[:, 4]
    return float(np.polyfit(t, rss, 1)[0]) * 60, float(np.polyfit(t, rest, 1)[0]) * 60


def _round(x: float | None) -> int | None:
    return None if x is None or x != x else round(x)


def _report(
    args: argparse.Namespace,
    tally: Tally,
    samples: list[Sample],
    flights: list[tuple[float, int]],
    before: dict[str, float],
    after: dict[str, float],
    stats: dict[str, Any],
    wall: float,
    cancelled: int,
    load_before: tuple[float, ...],
) -> dict[str, Any]:
    cap = args.tokenizer_cache_mib << 20
    full_at = next((x[0] for x in samples if x[3] >= _FULL * cap), None)
    slope, rest_slope = _slopes(samples, args.warmup)
    full_slope = _slopes(samples, max(args.warmup, full_at))[0] if full_at is not None else None
    routed = after.get("requests", 0) - before.get("requests", 0)
    overhead_n = after.get("warply_router_overhead_seconds_count", 0) - before.get(
        "warply_router_overhead_seconds_count", 0
    )
    overhead_s = after.get("warply_router_overhead_seconds_sum", 0) - before.get(
        "warply_router_overhead_seconds_sum", 0
    )
    live = [n for t, n in flights if args.warmup <= t <= args.duration]
    rss = [x[1] for x in samples]
    cpu = samples[-1][2] - samples[0][2] if len(samples) > 1 else float("nan")
    span = samples[-1][0] - samples[0][0] if len(samples) > 1 else float("nan")
    return {
        "duration_s": args.duration,
        "wall_s": round(wall, 1),
        "clients": args.clients,
        "workers": args.workers,
        "sent": tally.sent,
        "completed": tally.completed,
        "errors": dict(tally.errors),
        "cancelled_clients": cancelled,
        "requests_per_s": round(tally.completed / wall, 1),
        "in_flight_mean": round(statistics.fmean(live), 1) if live else None,
        "in_flight_max": max(live) if live else None,
        "router_requests_metric": routed,
        "router_requests_by_status": {
            k[len("requests_") :]: after[k] - before.get(k, 0)
            for k in after
            if k.startswith("requests_")
        },
        "router_count_matches_clients": routed == tally.sent,
        "router_rss_mib": {
            "start": round(rss[0] / 2**20, 1) if rss else None,
            "end": round(rss[-1] / 2**20, 1) if rss else None,
            "max": round(max(rss) / 2**20, 1) if rss else None,
            "samples": len(rss),
            "metrics_failures": tally.metrics_failures,
        },
        "router_rss_slope_bytes_per_min": _round(slope),
        "router_rss_less_tokenizer_cache_slope_bytes_per_min": _round(rest_slope),
        "router_tokenizer_cache_full_at_s": full_at,
        "router_rss_slope_after_full_bytes_per_min": _round(full_slope),
        "router_index_entries": after.get("warply_index_entries"),
        "router_tokenizer_cache_mib": round(after.get(_TOK_BYTES, 0) / 2**20, 1),
        "router_tokenizer_texts_mib": round(after.get(_TOK_TEXTS, 0) / 2**20, 1),
        "router_tokenizer_cache_cap_mib": args.tokenizer_cache_mib,
        "router_cpu_cores": round(cpu / span, 2) if span == span and span > 0 else None,
        "router_overhead_mean_ms": round(overhead_s / overhead_n * 1000, 3) if overhead_n else None,
        "ttft_ms": {"p50": _pct(tally.ttft_ms, 50), "p99": _pct(tally.ttft_ms, 99)},
        "sim_ttft_ms": {"p50": _pct(tally.sim_ttft_ms, 50), "p99": _pct(tally.sim_ttft_ms, 99)},
        "router_added_ms": {"p50": _pct(tally.added_ms, 50), "p99": _pct(tally.added_ms, 99)},
        "client_loop_lag_ms": {
            "p50": _pct(tally.loop_lag_ms, 50),
            "p99": _pct(tally.loop_lag_ms, 99),
        },
        "hit_rate_engine": tally.cached_tokens / max(1, tally.prompt_tokens),
        "hit_rate_predicted": tally.predicted_tokens / max(1, tally.prompt_tokens),
        "router_cache_stats_hit_rate": stats.get("hit_rate"),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def _start(args: argparse.Namespace, workdir: Path, sims: list[SimWorkers]) -> EngineProcess:
    """Start the simulated workers (appended to `sims` as they start) and configure the router."""
    split = [
        args.workers // args.sim_processes + (p < args.workers % args.sim_processes)
        for p in range(args.sim_processes)
    ]
    for p, n in enumerate(split):
        sims.append(
            SimWorkers(
                sys.executable,
                MODEL,
                args.tokenizer,
                workers=n,
                log_path=workdir / f"sim{p}.log",
                args=[
                    "--name-prefix",
                    f"p{p}-sim",
                    "--block-size",
                    str(args.block_size),
                    "--speed",
                    str(args.speed),
                    "--time-scale",
                    str(args.time_scale),
                    "--num-blocks",
                    str(args.num_blocks),
                ],
            ).start()
        )
    workers = [w for s in sims for w in s.wait_ready()]
    port = free_port()
    config: dict[str, Any] = {
        "model": MODEL,
        "tokenizer": str(args.tokenizer),
        "port": port,
        "pools": [{"name": "sim", "block_size": args.block_size, "workers": workers}],
    }
    if args.strategy or args.knobs:
        config["strategy"] = {"name": args.strategy or "adaptive", "knobs": args.knobs or {}}
    config["tokenizer_cache_mib"] = args.tokenizer_cache_mib
    return RouterServer(config, workdir)


def _print(report: dict[str, Any]) -> None:
    r = report
    print(
        f"soak: {r['clients']} clients, {r['workers']} simulated workers, "
        f"{r['duration_s']} s (wall {r['wall_s']} s); load average before "
        f"{r['load_average_before']}, after {r['load_average_after']}"
    )
    print(
        f"  requests: sent {r['sent']}, completed {r['completed']} "
        f"({r['requests_per_s']}/s), errors {r['errors'] or 'none'}; streams in flight "
        f"mean {r['in_flight_mean']} max {r['in_flight_max']}"
    )
    print(
        f"  router /metrics requests {r['router_requests_metric']:.0f} "
        f"{r['router_requests_by_status']} vs clients' {r['sent']}: "
        f"{'match' if r['router_count_matches_clients'] else 'MISMATCH'}"
    )
    rss = r["router_rss_mib"]
    print(
        f"  router RSS MiB start {rss['start']} end {rss['end']} max {rss['max']} "
        f"({rss['samples']} samples, {rss['metrics_failures']} without /metrics); slope after "
        "warm-up "
        f"{r['router_rss_slope_bytes_per_min']} B/min (less the tokenizer cache "
        f"{r['router_rss_less_tokenizer_cache_slope_bytes_per_min']}); CPU cores: router "
        f"{r['router_cpu_cores']}, simulators {r['simulators_cpu_cores']}, clients "
        f"{r['clients_cpu_cores']}"
    )
    full = r["router_tokenizer_cache_full_at_s"]
    print(
        f"  tokenizer chunk cache full ({_FULL:.0%} of {r['router_tokenizer_cache_cap_mib']} MiB) "
        + (
            f"at {full:.0f} s; RSS slope after that and the warm-up "
            f"{r['router_rss_slope_after_full_bytes_per_min']} B/min"
            if full is not None
            else "never in this run"
        )
    )
    for key in ("ttft_ms", "sim_ttft_ms", "router_added_ms", "client_loop_lag_ms"):
        print(f"  {key}: p50 {r[key]['p50']:.2f} p99 {r[key]['p99']:.2f}")
    print(
        f"  router index entries {r['router_index_entries']}, tokenizer cache "
        f"{r['router_tokenizer_cache_mib']} MiB of chunks + {r['router_tokenizer_texts_mib']} "
        "MiB of remembered prompts (all bounded; at the end)"
    )
    print(
        f"  router overhead (its own histogram) mean {r['router_overhead_mean_ms']} ms; "
        f"hit rate engine {r['hit_rate_engine']:.3f} predicted {r['hit_rate_predicted']:.3f}"
    )


def _loop_factory() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=positive(float), default=600.0,
                    help="seconds of load (default 600)")
    ap.add_argument("--clients", type=positive(int), default=500,
                    help="concurrent clients (default 500)")
    ap.add_argument("--workers", type=positive(int), default=32,
                    help="simulated workers (default 32)")
    ap.add_argument("--sim-processes", type=positive(int), default=2,
                    help="processes for the workers")
    ap.add_argument(
        "--tokenizer",
        type=Path,
        default=newest_tiny(),
        help="model folder (default: the newest tiny model in the cache)",
    )
    ap.add_argument("--block-size", type=positive(int), default=16, help="simulated KV block size")
    ap.add_argument(
        "--speed",
        type=positive(float),
        default=0.25,
        help="simulated engine speed vs the reference model (0.25: ~25 ms/token)",
    )
    ap.add_argument("--time-scale", type=positive(float), default=1.0,
                    help="simulated s per real s")
    ap.add_argument(
        "--num-blocks",
        type=positive(int),
        default=2048,
        help="KV blocks per simulated worker (small: the fleet's caches, and so the router's "
        "index, fill during the warm-up)",
    )
    ap.add_argument("--strategy", help="router strategy (default: the router's)")
    ap.add_argument(
        "--knobs",
        type=_knobs,
        help="its knobs as a JSON object, e.g. '{\"memory\": 8192}' (adaptive: prefixes kept)",
    )
    ap.add_argument(
        "--tokenizer-cache-mib",
        type=positive(int),
        default=RouterConfig.model_fields["tokenizer_cache_mib"].default,
        help="the router's tokenizer_cache_mib (default: the router's); the report fits the RSS "
        "slope again from when the chunk cache is full",
    )
    ap.add_argument("--turns", type=_pair(int), default=(2, 8), help="turns per conversation")
    ap.add_argument(
        "--think", type=_pair(float), default=(1.0, 4.0), help="seconds between turns, LO,HI"
    )
    ap.add_argument("--max-tokens", type=_pair(int), default=(16, 64), help="LO,HI")
    ap.add_argument("--systems", type=positive(int), default=16, help="distinct system prompts")
    ap.add_argument("--ramp", type=non_negative(float), default=10.0,
                    help="seconds over which clients start")
    ap.add_argument("--warmup", type=non_negative(float),
                    help="seconds before the RSS fit (default: 1/5)")
    ap.add_argument("--rss-interval", type=positive(float), default=5.0,
                    help="seconds between RSS samples")
    ap.add_argument("--request-timeout", type=positive(float), default=120.0,
                    help="per request, seconds")
    ap.add_argument("--seed", type=non_negative(int), default=0, help="seed of the conversations")
    ap.add_argument("--json", type=output_file, help="write the report here")
    ap.add_argument(
        "--workdir", type=output_folder, help="logs and config (default: a temp folder)"
    )
    args = ap.parse_args()
    exit_on_termination()
    if args.tokenizer is None or not (args.tokenizer / "tokenizer.json").is_file():
        ap.error(
            "--tokenizer: no model folder with tokenizer.json (build one with "
            ".venvs/vllm/bin/python scripts/tiny_model.py --size tiny)"
        )
    if args.sim_processes > args.workers:
        ap.error("--sim-processes must not exceed --workers")
    args.warmup = args.duration / 5 if args.warmup is None else args.warmup
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="warply-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    _log(f"logs in {workdir}")
    sims: list[SimWorkers] = []
    router: EngineProcess | None = None
    try:
        router = _start(args, workdir, sims)
        router.start()
        router.wait_healthy(120)
        _log(f"router {router.url} (pid {router.pid}) over {args.workers} simulated workers")
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            report = runner.run(_drive(args, router, sims))
    finally:
        if router is not None:
            router.stop()
        for s in sims:
            s.stop()
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
