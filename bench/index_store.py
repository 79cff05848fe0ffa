"""The index stores side by side: the in-process `MemoryStore` and the shared `RedisStore` on a
`redis-server` this bench starts on 127.0.0.1 (stopped by PID at the end), same data.

Per store: ingestion rate (`BlockStored` events of 32 blocks of 16 tokens through
`PrefixIndex.apply`, one worker's calls in order; "sequential" awaits one call at a time
across all workers, "per-worker tasks" runs one task per worker as the router's feed does, so
the shared store's round trips overlap), the routing decision at 1k / 8k / 32k-token prompts
(`Placement.choose`: key chain + one `match` + the strategy; half of each prompt cached on one
worker, so the walk goes deep), and bytes per (block, worker) entry (memory store: traced
Python allocations; Redis: the server's `used_memory` growth, and `MEMORY USAGE` of sample
keys). No timed assertions; targets for the shared store printed beside the numbers: ingestion
>= 100 k blocks/s, decision p99 <= 3 ms at 8k tokens.

    python bench/index_store.py [--entries 1000000] [--workers 8] [--samples 200]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import tempfile
import time
import tracemalloc
from array import array
from collections.abc import Callable
from pathlib import Path

import _one_pool
import redis
from _percentiles import percentiles

from router.index import IndexStore, MemoryStore, PrefixIndex
from router.index.redis import RedisStore
from warply.common.argtypes import positive
from warply.launch import RedisServer, exit_on_termination
from warply.protocol import BlockStored, chain_keys, root_seed

BS = 16
PER_EVENT = 32
MODEL = "bench"


def _events(entries: int, workers: int, seed: int) -> list[tuple[str, BlockStored]]:
    """Chains of PER_EVENT blocks, each stored by one random worker, `entries` blocks in all."""
    rng = random.Random(seed)
    out = []
    for i in range(entries // PER_EVENT):
        tokens = [rng.randrange(50_000) for _ in range(PER_EVENT * BS)]
        hashes = list(range(i * PER_EVENT, (i + 1) * PER_EVENT))
        out.append((f"w{rng.randrange(workers)}", BlockStored(hashes, None, tokens, BS)))
    return out


async def _ingest(index: PrefixIndex, events: list[tuple[str, BlockStored]], tasks: bool) -> float:
    """Seconds to apply every event (one task per worker when `tasks`)."""
    t0 = time.perf_counter()
    if tasks:
        by_worker: dict[str, list[BlockStored]] = {}
        for worker, ev in events:
            by_worker.setdefault(worker, []).append(ev)

        async def feed(worker: str, evs: list[BlockStored]) -> None:
            for ev in evs:
                await index.apply(worker, [ev])

        await asyncio.gather(*(feed(w, evs) for w, evs in by_worker.items()))
    else:
        for worker, ev in events:
            await index.apply(worker, [ev])
    return time.perf_counter() - t0


async def _decisions(
    index: PrefixIndex, workers: int, samples: int, rng: random.Random
) -> dict[int, list[float]]:
    """Decision seconds per prompt length; half of each prompt cached on one worker."""
    placement = _one_pool.placement(_one_pool.config(MODEL, BS, workers), index)
    out: dict[int, list[float]] = {}
    for n_tokens in (1024, 8192, 32768):
        prompts = []
        for i in range(samples):
            tokens = array("I", [rng.randrange(8000) for _ in range(n_tokens)])
            held = n_tokens // 2 // BS * BS
            first = 10**9 + n_tokens * 10**4 + i * 10**3
            hashes = list(range(first, first + held // BS))
            stored = BlockStored(hashes, None, list(tokens[:held]), BS)
            await index.apply(f"w{i % workers}", [stored])
            prompts.append(tokens)
        times = []
        for tokens in prompts:
            t = time.perf_counter()
            await placement.choose(tokens)
            times.append(time.perf_counter() - t)
        out[n_tokens] = times
    return out


def _q(samples: list[float]) -> tuple[float, float]:
    q = percentiles(samples)
    return q[49] * 1e3, q[98] * 1e3


async def _run_store(
    name: str,
    make: Callable[[], IndexStore],
    events: list[tuple[str, BlockStored]],
    args: argparse.Namespace,
) -> tuple[dict[bool, float], dict[int, list[float]]]:
    """Ingestion rates (by: one task per worker) and decision times (by prompt tokens)."""
    n = len(events) * PER_EVENT
    rates = {}
    for tasks in (False, True):
        index = PrefixIndex(MODEL, make())
        rates[tasks] = n / await _ingest(index, events, tasks)
        if not tasks:
            await index.store.close()
    entries = (await index.stats()).entries
    gc.freeze()
    decisions = await _decisions(index, args.workers, args.samples, random.Random(1))
    await index.store.close()
    print(f"\n{name}: {entries} entries over {args.workers} workers")
    print(f"  ingestion, sequential        {rates[False] / 1e3:8.0f} k blocks/s")
    print(f"  ingestion, per-worker tasks  {rates[True] / 1e3:8.0f} k blocks/s")
    for n_tokens, times in decisions.items():
        p50, p99 = _q(times)
        print(f"  decision {n_tokens:6d} tokens     p50 {p50:7.3f} ms  p99 {p99:7.3f} ms")
    return rates, decisions


def _memory_bytes(events: list[tuple[str, BlockStored]]) -> float:
    """Traced Python bytes per entry of a `MemoryStore` filled with `events` (ingestion's maps
    excluded: every store has them)."""
    gc.collect()
    tracemalloc.start()
    store = MemoryStore(max_entries=10 * len(events) * PER_EVENT)
    asyncio.run(_fill_store(store, events))
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return used / asyncio.run(store.stats()).entries


async def _fill_store(store: IndexStore, events: list[tuple[str, BlockStored]]) -> None:
    """Add the events' keys straight to a store (no ingestion maps)."""
    seed = root_seed(MODEL)
    for worker, ev in events:
        await store.add(worker, ev.tier, chain_keys(ev.token_ids, BS, seed))
    await store.close()


def _redis_bytes(url: str, prefix: str, entries: int) -> dict[str, float]:
    """Server memory per entry of the index under `prefix`, and sample keys' `MEMORY USAGE`."""
    client = redis.Redis.from_url(url)
    p = f"{{{prefix}}}:".encode()
    used = float(client.info("memory")["used_memory"])
    block = next(iter(client.scan_iter(match=p + b"b*", count=1000)))
    out = {
        "used_memory": used,
        "block key": float(client.memory_usage(block) or 0),
        "lru zset": float(client.memory_usage(p + b"l") or 0) / entries,
        "worker sets": sum(
            float(client.memory_usage(k) or 0) for k in client.scan_iter(match=p + b"w*")
        )
        / entries,
    }
    client.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--entries", type=positive(int), default=1_000_000, help="blocks stored first")
    ap.add_argument("--workers", type=positive(int), default=8, help="workers holding them")
    ap.add_argument("--samples", type=positive(int), default=200, help="timed decisions")
    args = ap.parse_args()
    exit_on_termination()
    if args.entries < PER_EVENT:
        ap.error(f"--entries {args.entries} is less than one event's {PER_EVENT} blocks")
    if args.samples < 2:
        ap.error(f"--samples {args.samples}: percentiles need 2 samples or more")
    events = _events(args.entries, args.workers, seed=0)
    gc.freeze()
    cap = 10 * args.entries
    with tempfile.TemporaryDirectory() as tmp:
        srv = RedisServer(log_path=Path(tmp) / "redis.log")
        with srv:
            srv.wait_ready()
            print(f"redis-server pid {srv.pid} on {srv.url}; {len(events) * PER_EVENT} blocks in "
                  f"events of {PER_EVENT}, block size {BS}, {args.workers} workers")
            prefixes = iter(f"bench{i}" for i in range(10))
            mem = asyncio.run(_run_store("memory store", lambda: MemoryStore(cap), events, args))

            def shared() -> RedisStore:
                return RedisStore(srv.url, next(prefixes), cap, timeout_s=10)

            red = asyncio.run(_run_store("redis store", shared, events, args))
            client = redis.Redis.from_url(srv.url)
            client.flushall()
            base = float(client.info("memory")["used_memory"])
            client.close()
            asyncio.run(_fill_store(RedisStore(srv.url, "bytes", cap, timeout_s=10), events))
            n = len(events) * PER_EVENT
            sizes = _redis_bytes(srv.url, "bytes", n)
    mem_bytes = _memory_bytes(events)
    red_bytes = (sizes["used_memory"] - base) / n
    print("\nbytes per (block, worker) entry")
    print(f"  memory store  {mem_bytes:7.0f}  (traced Python allocations)")
    print(f"  redis store   {red_bytes:7.0f}  (server used_memory growth; "
          f"{red_bytes / mem_bytes:.2f}x): block key {sizes['block key']:.0f} (MEMORY USAGE of "
          f"one), LRU zset {sizes['lru zset']:.0f}, worker sets {sizes['worker sets']:.0f}")
    print("\nshared store against the memory store")
    for tasks, label in ((False, "sequential"), (True, "per-worker tasks")):
        r, m = red[0][tasks], mem[0][tasks]
        print(f"  ingestion {label:17s} {r / 1e3:6.0f} k/s = {r / m:.2f}x memory "
              f"(target >= 100 k/s: {'meets' if r >= 100e3 else 'MISSES'})")
    for n_tokens in (1024, 8192, 32768):
        rp50, rp99 = _q(red[1][n_tokens])
        mp50, mp99 = _q(mem[1][n_tokens])
        meets = "meets" if rp99 <= 3 else "MISSES"
        target = f" (target p99 <= 3 ms: {meets})" if n_tokens == 8192 else ""
        print(f"  decision {n_tokens:6d} tokens  p50 {rp50:.3f} ms = {rp50 / mp50:.1f}x, "
              f"p99 {rp99:.3f} ms = {rp99 / mp99:.1f}x memory{target}")


if __name__ == "__main__":
    main()
