"""The router's index and placement at 64 and 256 workers, in replay: the in-memory store
against the shared store (a redis-server started on 127.0.0.1, stopped by PID).

The workload grows with the fleet: the first `--per-worker` x 8 requests of the conversation
trace are what 8 workers serve; for W workers the bench lays W / 8 copies of them over the same
time span (each copy's trace blocks distinct, its arrivals shifted by a fraction of the mean
gap), so the arrival rate is W / 8 times the trace's and every worker gets about the same work.
The replay is the router's real `PrefixIndex` and `Placement` (default strategy) over
simulated engines (`replay.sim`), with the index on a `MemoryStore` (driven synchronously) or a
`RedisStore` (driven by an event loop, the workers' events sent concurrently as the router's
feed does). Printed per (W, store): entries, index memory (memory store: the Python objects it
holds; Redis: the server's used_memory growth) and per entry, decision latency p50 / p99
(key chain + match + strategy, one round trip to the server for Redis), ingestion rate
(blocks stored or removed per second spent applying the engines' events) and wall time; then
the shared store's figures as ratios of the memory store's. No assertions.

    nice -n 10 .venvs/core/bin/python bench/replay_scale.py [--workers 64 256] [--per-worker 16]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import redis
from _percentiles import percentiles

from replay.engine import EngineConfig
from replay.sim import ReplayResult, SimPool, simulate_pools
from replay.trace import ExpandedTrace, TraceRequest, exiting_on_bad_trace, read_trace
from router.config import StrategyConfig
from router.index import IndexStore, MemoryStore, completed
from router.index.redis import RedisStore
from router.strategies import make_strategy
from warply.common.argtypes import positive
from warply.launch import RedisServer, exit_on_termination

TRACE = Path(__file__).resolve().parents[1] / "../shared/traces/mooncake/conversation_trace.jsonl"
BASE_WORKERS = 8


def _tiled(base: list[TraceRequest], copies: int) -> list[TraceRequest]:
    """`copies` copies of `base` with distinct blocks, interleaved over the same time span."""
    span = base[-1].arrival_ms - base[0].arrival_ms
    gap = span / max(1, len(base) - 1)
    out = [
        TraceRequest(
            r.arrival_ms + gap * j / copies,
            r.input_length,
            r.output_length,
            tuple(h * copies + j for h in r.hash_ids),
        )
        for j in range(copies)
        for r in base
    ]
    return sorted(out, key=lambda r: r.arrival_ms)


def _deep_size(root: object) -> int:
    """Bytes of `root` and every container, int and string it reaches (each counted once)."""
    seen: set[int] = set()
    stack: list[Any] = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        children: Iterable[Any] = ()
        if isinstance(obj, dict):
            children = [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = obj
        elif hasattr(obj, "__dict__"):
            children = vars(obj).values()
        stack.extend(c for c in children if not isinstance(c, type))
    return total


def _replay(trace: ExpandedTrace, workers: int, store: IndexStore, loop: Any) -> ReplayResult:
    strategy = make_strategy(StrategyConfig())
    pool = SimPool("w", "both", workers, strategy)
    drive = completed if loop is None else loop.run_until_complete
    return simulate_pools(trace, [pool], "scale", EngineConfig(), store=store, drive=drive)


def _q(xs: list[float], q: int) -> float:
    return percentiles(xs)[q - 1] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE, help="request trace (Mooncake JSONL)")
    ap.add_argument("--workers", type=positive(int), nargs="+", default=[64, 256],
                    help="fleet sizes")
    ap.add_argument("--per-worker", type=positive(int), default=16, help="requests per worker")
    ap.add_argument("--trace-block", type=positive(int), default=512,
                    help="tokens per trace hash id")
    a = ap.parse_args()
    exit_on_termination()
    with exiting_on_bad_trace(ap.prog):
        base = read_trace(a.trace, limit=a.per_worker * BASE_WORKERS)
    block = EngineConfig().block_size
    with tempfile.TemporaryDirectory() as tmp, RedisServer(log_path=Path(tmp) / "r.log") as srv:
        srv.wait_ready()
        client = redis.Redis.from_url(srv.url)
        print(f"redis-server pid {srv.pid}; {a.per_worker} requests per worker from "
              f"{a.trace.name}, engine block {block}")
        print(f"{'W':>4} {'store':>6} {'requests':>8} {'rate/s':>7} {'entries':>9} "
              f"{'index MiB':>9} {'B/entry':>7} {'decision p50/p99 ms':>20} "
              f"{'ingest k blocks/s':>17} {'wall s':>7}")
        for workers in a.workers:
            copies = max(1, workers // BASE_WORKERS)
            reqs = _tiled(base, copies)
            trace = ExpandedTrace(reqs, a.trace_block, block)
            rate = len(reqs) / max(1e-9, (reqs[-1].arrival_ms - reqs[0].arrival_ms) / 1e3)
            rows = {}
            for name in ("memory", "redis"):
                loop = None
                store: IndexStore = MemoryStore()
                if name == "redis":
                    client.flushall()
                    before = float(client.info("memory")["used_memory"])
                    loop = asyncio.new_event_loop()
                    store = RedisStore(srv.url, f"scale{workers}", timeout_s=10)
                t0 = time.perf_counter()
                res = _replay(trace, workers, store, loop)
                wall = time.perf_counter() - t0
                if loop is None:
                    entries = completed(store.stats()).entries
                    size = float(_deep_size(store))
                else:
                    entries = loop.run_until_complete(store.stats()).entries
                    size = float(client.info("memory")["used_memory"]) - before
                    loop.run_until_complete(store.close())
                    loop.close()
                ingest = res.ingested_blocks / max(1e-9, res.ingest_s)
                rows[name] = (size, res.decision_s, ingest)
                print(f"{workers:>4} {name:>6} {len(reqs):>8} {rate:>7.1f} {entries:>9} "
                      f"{size / 2**20:>9.1f} {size / max(1, entries):>7.0f} "
                      f"{_q(res.decision_s, 50):>9.3f} / {_q(res.decision_s, 99):<8.3f} "
                      f"{ingest / 1e3:>17.0f} {wall:>7.1f}")
            (ms, md, mi), (rs, rd, ri) = rows["memory"], rows["redis"]
            print(f"{'':>4} redis / memory: index memory {rs / ms:.2f}, decision p50 "
                  f"{_q(rd, 50) / _q(md, 50):.1f} p99 {_q(rd, 99) / _q(md, 99):.1f}, "
                  f"ingestion {ri / mi:.2f}")
        client.close()


if __name__ == "__main__":
    main()
