"""The herd effect of router replicas, with and without shared bookings (`router.load`).

R router replicas (each its own `Workers`, `PrefixIndex` over the shared `RedisStore` and
`Placement` with the default strategy, in this process) place a burst of new conversations
that arrive at them in turn, `--gap-ms` apart, over W simulated workers (labelled simulators,
not engines: each prefills its queue in order at `--prefill-rate` tokens/s, then decodes for
`--decode-ms`; the replica that placed a request books it, marks its first token and releases
it as the router does). Prompts are new (no cached prefix anywhere) and 512..4096 tokens long.
Time is simulated (arrivals, first tokens and ends are events in order, so the figures do not
depend on how busy this machine is) and each replica's writes land before the next arrival:
sharing as it works when arrivals are further apart than one store round trip (~0.5 ms on
loopback). The decision itself is real and timed.
A redis-server is started on 127.0.0.1 and stopped by PID.

Without sharing (`LocalLedger`) each replica sees only its own bookings, so every replica
sends its first requests to the same workers it thinks idle. With sharing (`RedisLedger`)
each placement reads every replica's bookings. Printed per (R, sharing): requests per worker
(max / min), pending prefill tokens per worker when the last request arrived (max / min, and
max - min), the simulated time to first token (p50 / p99) and the real decision time (p50 /
p99), with the shared run's figures as ratios of the unshared one's. No assertions.

    nice -n 10 .venvs/core/bin/python bench/replica_herd.py [--workers 8] [--requests 32]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import _one_pool
from _percentiles import percentiles

from router.index import PrefixIndex, StoreOutage
from router.index.redis import RedisStore
from router.load import LoadLedger, LocalLedger
from router.load.redis import RedisLedger
from router.placement import Placement
from router.workers import Booking, Workers
from warply.common.argtypes import non_negative, positive
from warply.launch import RedisServer, exit_on_termination

MODEL = "bench"
BS = 16


class _SimWorker:
    """A labelled simulator of one engine: prefills in arrival order, one at a time."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.busy_until = 0.0

    def first_token_at(self, now: float, tokens: int) -> float:
        self.busy_until = max(now, self.busy_until) + tokens / self.rate
        return self.busy_until


@dataclass
class _Result:
    per_worker: list[int]
    pending: list[int]
    ttft: list[float]
    """Simulated seconds."""
    decision: list[float]
    """Real seconds per placement (the shared ledger's read included)."""


async def _run(
    url: str, prefix: str, replicas: int, shared: bool, a: argparse.Namespace
) -> _Result:
    config = _one_pool.config(MODEL, BS, a.workers)
    sims = {f"w{i}": _SimWorker(a.prefill_rate) for i in range(a.workers)}
    routers: list[tuple[Workers, Placement, LoadLedger]] = []
    for _ in range(replicas):
        workers = _one_pool.healthy_members(config)
        index = PrefixIndex(MODEL, RedisStore(url, prefix, timeout_s=5))
        ledger: LoadLedger = LocalLedger()
        if shared:
            ledger = RedisLedger(url, prefix, 10.0, 5.0, StoreOutage())
            workers.watch(ledger.changed)
            ledger.start(lambda ws=workers: [w.load for w in ws.values()])  # type: ignore[misc]
        routers.append((workers, Placement(config, index, workers, ledger=ledger), ledger))
    rng = random.Random(a.seed)
    prompts = [
        [rng.randrange(50_000) for _ in range(rng.randrange(512, 4097))] for _ in range(a.requests)
    ]
    res = _Result([], [], [], [])
    per_worker = dict.fromkeys(sims, 0)
    later: list[tuple[float, int, Booking, bool]] = []  # (when, seq, booking, True: first token)
    for i, prompt in enumerate(prompts):
        now = i * a.gap_ms / 1e3
        while later and later[0][0] <= now:
            _, _, booking, first = heapq.heappop(later)
            if first:
                booking.progressed(1)
            else:
                booking.release()
        for _, _, ledger in routers:  # every write made so far has landed
            await ledger.flush()
        workers, placement, ledger = routers[i % replicas]
        t = time.perf_counter()
        d = await placement.choose(prompt)
        res.decision.append(time.perf_counter() - t)
        booking = d.worker.book(d.prompt_tokens, d.prefill_tokens)
        per_worker[d.worker.name] += 1
        first = sims[d.worker.name].first_token_at(now, d.prefill_tokens)
        res.ttft.append(first - now)
        heapq.heappush(later, (first, 2 * i, booking, True))
        heapq.heappush(later, (first + a.decode_ms / 1e3, 2 * i + 1, booking, False))
    # The burst's end: the pending prefill every replica booked, per worker.
    res.pending = [sum(r[0][name].load.pending_prefill_tokens for r in routers) for name in sims]
    res.per_worker = list(per_worker.values())
    for _, placement, ledger in routers:
        await ledger.close()
        await placement.index.store.close()
    return res


def _spread(xs: list[int]) -> int:
    return max(xs) - min(xs)


def _q(xs: list[float], q: int) -> float:
    return percentiles(xs)[q - 1] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=positive(int), default=8, help="workers in the pool")
    ap.add_argument("--requests", type=positive(int), default=32,
                    help="new conversations in the burst")
    ap.add_argument("--replicas", type=positive(int), nargs="+", default=[2, 3, 4],
                    help="router replicas")
    ap.add_argument("--gap-ms", type=non_negative(float), default=2.0,
                    help="between arrivals (all replicas)")
    ap.add_argument("--prefill-rate", type=positive(float), default=100_000.0,
                    help="tokens/s per worker")
    ap.add_argument("--decode-ms", type=positive(float), default=50.0,
                    help="decode time per request")
    ap.add_argument("--seed", type=non_negative(int), default=0, help="seed of the burst")
    a = ap.parse_args()
    exit_on_termination()
    if a.requests < 2:
        ap.error(f"--requests {a.requests}: percentiles need 2 requests or more")
    with tempfile.TemporaryDirectory() as tmp, RedisServer(log_path=Path(tmp) / "r.log") as srv:
        srv.wait_ready()
        print(f"redis-server pid {srv.pid} on {srv.url}; {a.workers} workers, burst of "
              f"{a.requests} new conversations {a.gap_ms} ms apart, prefill "
              f"{a.prefill_rate:.0f} tokens/s, decode {a.decode_ms} ms")
        print(f"{'replicas':>8} {'shared':>6} {'req/worker max/min':>19} "
              f"{'pending prefill max/min (spread)':>34} {'TTFT p50 / p99 ms':>19} "
              f"{'decision p50 / p99 ms':>22}")
        runs = 0
        for r in a.replicas:
            out = {}
            for shared in (False, True):
                runs += 1
                res = out[shared] = asyncio.run(_run(srv.url, f"herd{runs}", r, shared, a))
                hi, lo = max(res.pending), min(res.pending)
                pend = f"{hi}/{lo} ({hi - lo})"
                print(f"{r:>8} {'yes' if shared else 'no':>6} "
                      f"{max(res.per_worker):>10}/{min(res.per_worker):<8} {pend:>34} "
                      f"{_q(res.ttft, 50):>8.1f} / {_q(res.ttft, 99):<8.1f} "
                      f"{_q(res.decision, 50):>9.3f} / {_q(res.decision, 99):<8.3f}")
            no, yes = out[False], out[True]
            spread = _spread(yes.pending) / max(1, _spread(no.pending))
            print(f"{'':>8} shared / not: pending-prefill spread {spread:.2f}, TTFT p50 "
                  f"{_q(yes.ttft, 50) / _q(no.ttft, 50):.2f}, p99 "
                  f"{_q(yes.ttft, 99) / _q(no.ttft, 99):.2f}")


if __name__ == "__main__":
    main()
