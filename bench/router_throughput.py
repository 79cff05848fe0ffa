"""Router throughput and added latency on one core, against sglang-router in the same run.

Processes (all on 127.0.0.1, each stopped by its PID's process group at the end):

* fake upstreams: `--upstreams` OpenAI-shaped servers in one process (this script with
  `--serve`), answering instantly (a JSON completion, or an SSE stream of a few events and a
  usage chunk), pinned to the last core with the client;
* warply-router, pinned to core 0 (`taskset -c 0`), one pool over those upstreams, the default
  strategy, no event streams (the index stays empty: placement still keys, matches and picks);
* sglang-router 0.3.2 (`--sglang-python`, its venv's interpreter), pinned to core 0 as well,
  `--policy cache_aware` (its default); skipped with `--sglang-python ''`;
* "relay" (this script with `--relay`), pinned to core 0 as well: warply-router's HTTP stack
  alone, the same aiohttp server on uvloop and the same upstream client (`router.upstream`),
  relaying bodies round-robin with no routing at all. warply's CPU per request minus relay's
  is what its routing costs (parse, tokenize, place, account, metrics); skipped with
  `--no-relay`.

Closed-loop clients (one keep-alive connection per stream, raw HTTP/1.1 on uvloop) send
/v1/completions with ~150-token prompts from 64 conversations, at each of `--streams`, for
`--seconds` (after `--warmup` seconds), to the upstreams directly, through warply and through
sglang-router, one target after the other. Per row: requests/s, client latency p50/p99, and
the router-added latency: the row's quantile minus the direct row's at the same concurrency
(same run), and the router process's CPU µs per request (all its threads, from /proc: on a
machine shared with other work, the figure its load changes least). Ratios are warply /
sglang-router.

    nice -n 10 .venvs/core/bin/python bench/router_throughput.py [--seconds 5] \\
        [--streams 1 64 100] [--modes json stream] [--paced 500] [--profile FILE]

`--paced R` adds rows at the largest stream count with the clients paced to R requests/s in
all (below saturation: added latency without the queue a saturated router builds).

`--profile FILE` runs warply-router under cProfile (slower; for finding hot spots, not for
figures) and writes its stats to FILE when the router stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _models import newest_tiny

from warply.common.argtypes import non_negative, output_file, positive
from warply.launch import (
    HOST,
    EngineProcess,
    exit_on_termination,
    free_port,
    http_json,
    sglang_router_cmd,
)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench"
_CONTENT_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)
_CHUNKED = re.compile(rb"transfer-encoding:\s*chunked", re.IGNORECASE)
_POST_HEADERS = {"Content-Type": "application/json"}


# -- fake upstream ---------------------------------------------------------------------------


def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 4,
        "total_tokens": prompt_tokens + 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _json_answer() -> bytes:
    body = json.dumps({
        "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "text": " a b c d", "finish_reason": "length",
                     "logprobs": None}],
        "usage": _usage(150),
    }).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _stream_answer() -> bytes:
    events = []
    for text in (" a", " b", " c", " d"):
        chunk = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
                 "choices": [{"index": 0, "text": text, "finish_reason": None}]}
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    last = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [], "usage": _usage(150)}
    events.append(b"data: " + json.dumps(last).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunks)


def _get_answer(path: bytes) -> bytes:
    if path.startswith(b"/v1/models"):
        body = json.dumps({"object": "list", "data": [
            {"id": MODEL, "object": "model", "max_model_len": 32768}]}).encode()
    else:  # /health, sglang-router's /get_server_info, /get_model_info, ...
        body = b"{}"
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


class _Upstream(asyncio.Protocol):
    """An OpenAI-shaped server that answers every request at once (HTTP/1.1 keep-alive)."""

    JSON = _json_answer()
    STREAM = _stream_answer()

    def __init__(self) -> None:
        self._buf = b""
        self._transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # uvloop's transports are not asyncio.Transport instances

    def data_received(self, data: bytes) -> None:
        self._buf += data
        assert self._transport is not None
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buf[:end]
            m = _CONTENT_LENGTH.search(head)
            size = int(m.group(1)) if m else 0
            if len(self._buf) < end + 4 + size:
                return
            body = self._buf[end + 4: end + 4 + size]
            self._buf = self._buf[end + 4 + size:]
            if head.startswith(b"GET"):
                self._transport.write(_get_answer(head.split(b" ", 2)[1]))
            elif re.search(rb'"stream"\s*:\s*true', body):
                self._transport.write(self.STREAM)
            else:
                self._transport.write(self.JSON)


async def _until_stopped() -> None:
    """Return on SIGINT or SIGTERM (the bench stops its helper processes that way)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


async def _serve(ports: list[int]) -> None:
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(_Upstream, HOST, p, backlog=1024) for p in ports]
    await _until_stopped()
    for s in servers:
        s.close()


async def _relay(port: int, upstreams: list[str]) -> None:
    """The "relay" target: warply-router's HTTP stack (aiohttp on uvloop, `router.upstream`)
    with no routing; bodies and answers pass as they are."""
    from aiohttp import web

    from router.upstream import Timeouts, Upstream

    client = Upstream()
    timeouts = Timeouts(60.0)
    turn = itertools.cycle(upstreams)

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        up = await client.post(next(turn) + request.path, body, _POST_HEADERS, timeouts)
        try:
            if up.content_type != "text/event-stream":
                return web.Response(body=await up.read(), status=up.status,
                                    content_type=up.content_type)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            async for chunk in up.chunks():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        finally:
            up.release()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/v1/completions", relay), web.get("/health", health)])
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, HOST, port, backlog=4096).start()
    await _until_stopped()
    await runner.cleanup()
    client.close()


# -- client ----------------------------------------------------------------------------------


def _prompts(n: int) -> list[str]:
    """~150-token prompts: 64 conversations of a shared system text and their own turns."""
    rng = random.Random(0)
    words = "the cache holds a prefix of tokens for each request and block router".split()
    system = "You are a helpful assistant. " + " ".join(rng.choice(words) for _ in range(60))
    convs = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(64)]
    return [f"{system}\n{convs[i % 64]}\nturn {i}: " + " ".join(
        rng.choice(words) for _ in range(20)) for i in range(n)]


def _request(port: int, prompt: str, stream: bool) -> bytes:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4,
                       "stream": stream}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    req: bytes) -> bool:
    """One request on a keep-alive connection; True when it answered 200."""
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    ok = head.startswith(b"HTTP/1.1 200")
    m = _CONTENT_LENGTH.search(head)
    if m is not None:
        await reader.readexactly(int(m.group(1)))
    elif _CHUNKED.search(head):
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        raise RuntimeError(f"response without a length: {head[:200]!r}")
    return ok


@dataclass
class _Row:
    target: str
    mode: str
    streams: int
    rate: float = 0.0
    """Requests/s the clients are paced to in all (0: closed loop, as fast as answered)."""
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    capped: bool = False
    """The row stopped at --max-requests before its time was up (its seconds end there)."""
    cpu_s: float = float("nan")
    """CPU seconds the router process used while measured (all its threads)."""

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    @property
    def cpu_us(self) -> float:
        """The router's CPU µs per request: what a shared machine's load changes least."""
        return self.cpu_s / len(self.latencies) * 1e6 if self.latencies else float("nan")

    def q(self, p: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(p * (len(xs) - 1)))] if xs else float("nan")


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid`'s threads so far."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def _load(row: _Row, ports: list[int], seconds: float, warmup: float,
                max_requests: int, pid: int | None = None) -> None:
    """`row.streams` closed-loop clients for warmup + seconds; latencies after the warm-up;
    the CPU process `pid` used meanwhile."""
    prompts = _prompts(512)
    stream = row.mode == "stream"
    start = time.perf_counter()
    measure_from = start + warmup
    stop_at = measure_from + seconds

    interval = row.streams / row.rate if row.rate else 0.0
    ended = [stop_at]

    async def client(i: int) -> None:
        port = ports[i % len(ports)]
        reader, writer = await asyncio.open_connection(HOST, port)
        reqs = [_request(port, p, stream) for p in prompts[i % 8::8]]
        k = 0
        slot = start + interval * i / row.streams
        try:
            while (now := time.perf_counter()) < stop_at and len(row.latencies) < max_requests:
                if interval:
                    slot += interval
                    if slot > now:
                        await asyncio.sleep(slot - now)
                        now = time.perf_counter()
                try:
                    ok = await _exchange(reader, writer, reqs[k % len(reqs)])
                except (OSError, asyncio.IncompleteReadError):
                    row.errors += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection(HOST, port)
                    continue
                k += 1
                done = time.perf_counter()
                if now >= measure_from:
                    if ok:
                        row.latencies.append(done - now)
                    else:
                        row.errors += 1
                    if len(row.latencies) >= max_requests and not row.capped:
                        row.capped, ended[0] = True, done
        finally:
            writer.close()

    async def cpu() -> None:
        await asyncio.sleep(measure_from - time.perf_counter())
        assert pid is not None
        used = _cpu(pid)
        while (left := ended[0] - time.perf_counter()) > 0:
            await asyncio.sleep(min(left, 0.05))
        row.cpu_s = _cpu(pid) - used

    meter = [cpu()] if pid is not None and Path(f"/proc/{pid}").exists() else []
    await asyncio.gather(*(client(i) for i in range(row.streams)), *meter)
    row.seconds = min(time.perf_counter(), ended[0]) - measure_from


# -- processes -------------------------------------------------------------------------------


def _pinned(core: int, cmd: list[str]) -> list[str]:
    taskset = shutil.which("taskset")
    return [taskset, "-c", str(core), *cmd] if taskset else cmd


def _warply(args: argparse.Namespace, upstreams: list[str], work: Path,
            root: Path = ROOT, tag: str = "warply") -> EngineProcess:
    port = free_port()
    # -P: `root` (PYTHONPATH) is imported, not the current directory's checkout
    router = ["-P", "-m", "router"]
    if args.profile:
        router = ["-P", "-m", "cProfile", "-o", str(args.profile), "-m", "router"]
    cmd = [sys.executable, *router, "--model", MODEL, "--tokenizer", str(args.tokenizer),
           "--block-size", "16", "--port", str(port), "--log-level", "WARNING",
           *(x for u in upstreams for x in ("--worker", u))]
    env = {"PYTHONPATH": str(root)}
    return EngineProcess(_pinned(0, cmd), url=f"http://{HOST}:{port}",
                         log_path=work / f"{tag}.log", env=env)


def _sglang(python: str, upstreams: list[str], work: Path) -> EngineProcess:
    port = free_port()
    cmd = sglang_router_cmd(python, port, upstreams, "--log-level", "warn")
    return EngineProcess(_pinned(0, cmd), url=f"http://{HOST}:{port}",
                         log_path=work / "sglang.log")


def _wait_sglang(router: EngineProcess, upstreams: list[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            status, body = http_json("GET", router.url + "/workers", timeout=2)
            if status == 200 and all(u in json.dumps(body) for u in upstreams):
                return
        time.sleep(0.3)
    raise TimeoutError(f"sglang-router did not list its workers in 60 s:\n{router.log_tail()}")


@contextlib.contextmanager
def _processes(args: argparse.Namespace) -> Iterator[dict[str, tuple[list[int], int | None]]]:
    """Start the upstreams and the routers; yield target -> (ports, the router's pid); stop
    them all."""
    work = Path(tempfile.mkdtemp(prefix="warply-throughput-"))
    ports = [free_port() for _ in range(args.upstreams)]
    urls = [f"http://{HOST}:{p}" for p in ports]
    last = (os.cpu_count() or 2) - 1
    procs: list[EngineProcess] = []
    try:
        up = EngineProcess(
            _pinned(last, [sys.executable, __file__, "--serve", *map(str, ports)]),
            url=urls[0], log_path=work / "upstream.log", env={"PYTHONPATH": str(ROOT)})
        procs.append(up.start())
        up.wait_healthy(30)
        targets: dict[str, tuple[list[int], int | None]] = {"direct": (ports, None)}
        warply = _warply(args, urls, work)
        procs.append(warply.start())
        warply.wait_healthy(60)
        targets["warply"] = ([int(warply.url.rsplit(":", 1)[1])], warply.pid)
        if args.relay_target:
            port = free_port()
            relay = EngineProcess(
                _pinned(0, [sys.executable, __file__, "--relay", str(port), *urls]),
                url=f"http://{HOST}:{port}", log_path=work / "relay.log",
                env={"PYTHONPATH": str(ROOT)})
            procs.append(relay.start())
            relay.wait_healthy(30)
            targets["relay"] = ([port], relay.pid)
        if args.baseline:
            base = _warply(args, urls, work, args.baseline, "base")
            procs.append(base.start())
            base.wait_healthy(60)
            targets["base"] = ([int(base.url.rsplit(":", 1)[1])], base.pid)
        if args.sglang_python:
            sgl = _sglang(args.sglang_python, urls, work)
            procs.append(sgl.start())
            _wait_sglang(sgl, urls)
            targets["sglang"] = ([int(sgl.url.rsplit(":", 1)[1])], sgl.pid)
        yield targets
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(work, ignore_errors=True)


# -- report ----------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x * 1e3:7.3f}"


def _ratios(w: _Row, o: _Row) -> str:
    return (f"req/s {w.rps / o.rps:5.2f}x  p50 {w.q(0.5) / o.q(0.5):5.2f}x  "
            f"p99 {w.q(0.99) / o.q(0.99):5.2f}x  cpu/req {w.cpu_us / o.cpu_us:5.2f}x")


def _against(rows: list[_Row], by: dict[tuple[str, str, int, float], _Row], other: str,
             title: str, line: Callable[[_Row, _Row], str]) -> None:
    """warply's rows set against target `other`'s at the same mode, streams and pace."""
    pairs = [(w, by.get((other, w.mode, w.streams, w.rate))) for w in rows if w.target == "warply"]
    pairs = [(w, o) for w, o in pairs if o is not None and o.latencies and w.latencies]
    if not pairs:
        return
    print("\n" + title)
    for w, o in pairs:
        paced = f"@{w.rate:.0f}/s" if w.rate else ""
        print(f"{w.mode:6s} {w.streams:7d}{paced:>8s}  {line(w, o)}")


def _print(rows: list[_Row]) -> None:
    direct = {(r.mode, r.streams, r.rate): r for r in rows if r.target == "direct"}
    print(f"{'mode':6s} {'streams':>7s} {'paced':>6s} {'target':8s} {'req/s':>8s} {'p50 ms':>8s} "
          f"{'p99 ms':>8s} {'added p50':>9s} {'added p99':>9s} {'errors':>6s} {'cpu µs/req':>10s}")
    for r in rows:
        d = direct.get((r.mode, r.streams, r.rate))
        added = ("", "") if d is None or r is d else (
            _ms(r.q(0.5) - d.q(0.5)), _ms(r.q(0.99) - d.q(0.99)))
        paced = f"{r.rate:6.0f}" if r.rate else f"{'-':>6s}"
        print(f"{r.mode:6s} {r.streams:7d} {paced} {r.target:8s} {r.rps:8.0f} {_ms(r.q(0.5)):>8s} "
              f"{_ms(r.q(0.99)):>8s} {added[0]:>9s} {added[1]:>9s} {r.errors:6d} "
              f"{r.cpu_us:10.0f}{'  capped' if r.capped else ''}")
    by = {(r.target, r.mode, r.streams, r.rate): r for r in rows}
    _against(rows, by, "sglang", "warply / sglang-router (req/s ratio > 1, p99 and cpu ratios "
             "<= 1 favour warply):", _ratios)
    _against(rows, by, "relay", "warply against relay (its HTTP stack alone): routing's share "
             "of the CPU:", lambda w, r: f"req/s {w.rps / r.rps:5.2f}x  cpu/req relay "
             f"{r.cpu_us:4.0f} µs + routing {w.cpu_us - r.cpu_us:4.0f} µs")
    _against(rows, by, "base", "warply / base (the --baseline checkout):", _ratios)
    print("\ntargets (warply): added p50 <= 1 ms at 1 stream, added p99 <= 5 ms at 100 streams "
          "below saturation, req/s at 64 streams >= sglang-router's with p99 no worse")


async def _run(
    args: argparse.Namespace, targets: dict[str, tuple[list[int], int | None]]
) -> list[_Row]:
    rows = []
    plan = [(streams, 0.0) for streams in args.streams]
    if args.paced:
        plan.append((max(args.streams), args.paced))
    for mode in args.modes:
        for streams, rate in plan:
            for target, (ports, pid) in targets.items():
                row = _Row(target, mode, streams, rate)
                await _load(row, ports, args.seconds, args.warmup, args.max_requests, pid)
                rows.append(row)
                print(f"  {mode} {streams:3d} streams @{rate:.0f} {target:7s} {row.rps:7.0f} req/s "
                      f"p50 {_ms(row.q(0.5))} ms p99 {_ms(row.q(0.99))} ms "
                      f"errors {row.errors} cpu {row.cpu_us:.0f} µs/req"
                      f"{' (capped)' if row.capped else ''}", file=sys.stderr,
                      flush=True)
    return rows


def _event_loop_policy() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--serve", type=int, nargs="+", metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--relay", nargs="+", metavar="PORT_THEN_URLS", help=argparse.SUPPRESS)
    ap.add_argument("--no-relay", dest="relay_target", action="store_false",
                    help="skip the relay target (warply's HTTP stack without routing)")
    ap.add_argument("--streams", type=positive(int), nargs="+", default=[1, 64, 100],
                    help="concurrent client streams, one row each")
    ap.add_argument("--modes", nargs="+", choices=["json", "stream"], default=["json", "stream"],
                    help="JSON answers, SSE streams or both")
    ap.add_argument("--seconds", type=positive(float), default=5.0, help="measured seconds per row")
    ap.add_argument("--warmup", type=non_negative(float), default=1.0,
                    help="unmeasured seconds per row")
    ap.add_argument("--max-requests", type=positive(int), default=1_000_000,
                    help="per row, at most (a row that reaches it ends there: req/s over the "
                         "time it took, marked 'capped')")
    ap.add_argument("--upstreams", type=positive(int), default=4, help="fake upstream workers")
    ap.add_argument("--paced", type=non_negative(float), default=500.0,
                    help="req/s in all for paced rows at the largest stream count (0: none)")
    ap.add_argument("--tokenizer", type=Path, default=newest_tiny(),
                    help="model folder (default: the newest tiny model in the cache)")
    ap.add_argument("--sglang-python", default=str(ROOT / ".venvs/sglang/bin/python"),
                    help="interpreter with sglang-router installed ('' skips it)")
    ap.add_argument("--profile", type=output_file,
                    help="run warply-router under cProfile, stats here")
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="also run the router of another checkout (e.g. `git archive` of an "
                         "earlier commit) as target 'base', for before/after in one run")
    args = ap.parse_args()
    _event_loop_policy()
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    if args.relay:
        asyncio.run(_relay(int(args.relay[0]), args.relay[1:]))
        return 0
    if args.tokenizer is None:
        print("no tokenizer: build one with scripts/tiny_model.py or pass --tokenizer",
              file=sys.stderr)
        return 2
    if args.sglang_python and not Path(args.sglang_python).exists():
        print(f"no {args.sglang_python}: pass --sglang-python '' to skip sglang-router",
              file=sys.stderr)
        return 2
    exit_on_termination()
    with contextlib.suppress(AttributeError, OSError):  # the client shares the upstreams' core
        os.sched_setaffinity(0, {(os.cpu_count() or 2) - 1})
    signal.signal(signal.SIGALRM, lambda *_: sys.exit("time limit reached"))
    rows_n = len(args.modes) * (len(args.streams) + 1) * 5
    signal.alarm(int(120 + rows_n * (args.seconds + args.warmup + 10)))
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; "
          f"{args.upstreams} upstreams; {args.seconds:.0f} s per row", flush=True)
    with _processes(args) as targets:
        rows = asyncio.run(_run(args, targets))
    _print(rows)
    print(f"load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
