"""Long ingest run: is the router's memory bounded? RSS sampled over time, its slope printed.

Simulated engines (one per worker, each a bounded cache of `--engine-blocks` blocks) store
chained blocks under ever new cache namespaces (tenants) and evict their oldest blocks with
`BlockRemoved` events, a fraction of which are lost (`--lost`, as when a stream drops messages
that no resync recovers); the index's own cap (`--max-entries`) is below what the engines hold.
Between batches the router's request side runs too: a conversation's next turn is keyed
(`Placement.keys`, extending the previous turn's chain) and matched against the index. The run
is bounded by `--seconds`; the caps are set low (flags) so that all are reached early.
Printed: RSS and the sizes of the bounded structures every `--every` seconds, and the RSS
slope (least squares) over the second half of the run, when every cap has been reached.

    nice -n 10 .venvs/core/bin/python bench/index_memory.py [--seconds 120] [--workers 8]

`--uncapped` lifts ingestion's engine-hash cap (what the index did before it had one): lost
removals then leave map entries behind for good, and RSS keeps growing.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from collections import deque
from pathlib import Path

import _one_pool

from router import placement as placement_module
from router.index import MemoryStore, PrefixIndex
from router.token_cache import Lineage
from warply.common.argtypes import fraction, positive
from warply.protocol import BlockRemoved, BlockStored

BS = 16
MODEL = "bench"


def _rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y)."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / var if var else 0.0


async def _run(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    placement_module.CHAIN_KEYS = args.chain_keys  # reached within a bounded run
    store = MemoryStore(args.max_entries)
    index = PrefixIndex(MODEL, store, 10**15 if args.uncapped else args.max_entries)
    placement = _one_pool.placement(_one_pool.config(MODEL, BS, args.workers), index)
    engines: list[deque[int]] = [deque() for _ in range(args.workers)]
    next_hash, lost, tenant, turn = 1, 0, 0, 0
    history: list[int] = []
    samples: list[tuple[float, float]] = []
    gc.freeze()
    start = last = time.perf_counter()
    print(f"{'s':>5s} {'RSS MiB':>8s} {'entries':>9s} {'hashes':>9s} {'chains':>7s} "
          f"{'lost':>8s} {'hash_cap':>9s}")
    while (now := time.perf_counter()) - start < args.seconds:
        for _ in range(200):
            w = rng.randrange(args.workers)
            tenant += rng.random() < 0.05  # new tenants keep coming
            blocks = rng.randrange(1, 33)
            tokens = [rng.randrange(50_000) for _ in range(blocks * BS)]
            hashes = list(range(next_hash, next_hash + blocks))
            next_hash += blocks
            events: list[BlockStored | BlockRemoved] = [
                BlockStored(hashes, None, tokens, BS, namespace=f"t{tenant}")]
            cache = engines[w]
            cache.extend(hashes)
            evicted = [cache.popleft() for _ in range(max(0, len(cache) - args.engine_blocks))]
            if evicted:
                if rng.random() < args.lost:
                    lost += len(evicted)
                else:
                    events.append(BlockRemoved(evicted))
            await index.apply(f"w{w}", events)
        # a conversation's next turn through the request side
        turn += 1
        shared = len(history)
        history = history[: rng.randrange(shared + 1)] if turn % 50 == 0 else history
        history += [rng.randrange(50_000) for _ in range(512)]
        if len(history) > 32_768:
            history, shared = history[-512:], 0
        keys = placement.keys(history, BS, "", Lineage(turn, turn - 1, min(shared,
                                                                         len(history))))
        await index.match(keys)
        if now - last >= args.every:
            last = now
            rss = _rss_mib()
            samples.append((now - start, rss))
            skipped = (await index.stats()).skipped
            print(f"{now - start:5.0f} {rss:8.1f} {(await index.stats()).entries:9d} "
                  f"{index.ingest.hashes():9d} {placement._chain_keys:7d} {lost:8d} "
                  f"{skipped['hash_cap']:9d}", flush=True)
    half = [p for p in samples if p[0] >= args.seconds / 2]
    if len(half) >= 2:
        slope = _slope(half)
        print(f"RSS slope over the second half: {slope * 60:+.2f} MiB/min "
              f"({'flat' if abs(slope * 60) < 1.0 else 'GROWING'}: |slope| < 1 MiB/min is flat); "
              f"{'uncapped' if args.uncapped else 'capped'} engine-hash maps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=positive(float), default=120.0, help="seconds of ingest")
    ap.add_argument("--every", type=positive(float), default=5.0, help="seconds between samples")
    ap.add_argument("--workers", type=positive(int), default=8, help="workers publishing")
    ap.add_argument("--engine-blocks", type=positive(int), default=10_000,
                    help="each engine's cache")
    ap.add_argument("--max-entries", type=positive(int), default=50_000,
                    help="the index's entry cap")
    ap.add_argument("--chain-keys", type=positive(int), default=100_000,
                    help="placement's kept chain keys (router.placement.CHAIN_KEYS)")
    ap.add_argument("--lost", type=fraction, default=0.05, help="share of removals lost")
    ap.add_argument("--uncapped", action="store_true", help="no engine-hash cap (the old way)")
    asyncio.run(_run(ap.parse_args()))


if __name__ == "__main__":
    main()
