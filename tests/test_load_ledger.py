"""Bookings shared between router replicas (`router.load`): placement over a `RedisLedger` on a
real redis-server (127.0.0.1) adds what other replicas booked; a replica that stops writing
stops counting after its ttl; an unreachable server leaves each replica on its own figures."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

from router.config import IndexConfig, RouterConfig
from router.index import MemoryStore, PrefixIndex, StoreOutage
from router.load import LocalLedger, open_ledger
from router.load.redis import RedisLedger
from router.placement import Placement
from router.strategies import WorkerLoad
from router.workers import Booking, Workers
from warply.launch import RedisServer, free_port

MODEL = "m"
_prefixes = itertools.count()


def _config(workers: int) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": MODEL,
            "tokenizer": "/unused",
            "pools": [
                {
                    "name": "p",
                    "block_size": 4,
                    "workers": [{"name": f"w{i}", "url": f"http://w{i}"} for i in range(workers)],
                }
            ],
        }
    )


class _Replica:
    """One router's placement path: its own workers' loads, index and ledger."""

    def __init__(self, config: RouterConfig, url: str | None, prefix: str, ttl_s: float = 10):
        self.workers = Workers(config.pools)
        for w in self.workers.values():
            w.healthy = True
        self.outage = StoreOutage()
        self.ledger = (
            RedisLedger(url, prefix, ttl_s, 2.0, self.outage) if url is not None else LocalLedger()
        )
        self.workers.watch(self.ledger.changed)
        self.placement = Placement(
            config, PrefixIndex(MODEL, MemoryStore()), self.workers, ledger=self.ledger
        )

    async def place(self, tokens: list[int]) -> tuple[str, Booking]:
        """Place a new conversation and keep it booked (its prefill not started)."""
        d = await self.placement.choose(tokens)
        booking = d.worker.book(d.prompt_tokens, d.prefill_tokens)
        await self.ledger.flush()
        return d.worker.name, booking

    async def seen(self) -> dict[str, WorkerLoad]:
        """Every worker's load as this replica's placement reads it."""
        loads = await self.ledger.loads([w.load for w in self.workers.values()])
        return {w.name: w for w in loads}


async def _burst(replicas: list[_Replica], conversations: int) -> Counter[str]:
    """New conversations arriving at the replicas in turn: requests per worker."""
    per_worker: Counter[str] = Counter()
    for i in range(conversations):
        tokens = [1000 * i + t for t in range(64)]
        name, _ = await replicas[i % len(replicas)].place(tokens)
        per_worker[name] += 1
    return per_worker


def test_replicas_sharing_bookings_spread_a_burst_and_alone_they_herd(
    redis_server: RedisServer,
) -> None:
    config = _config(4)

    async def run(url: str | None) -> Counter[str]:
        prefix = f"herd{next(_prefixes)}"
        replicas = [_Replica(config, url, prefix) for _ in range(2)]
        per_worker = await _burst(replicas, 4)
        for r in replicas:
            await r.ledger.close()
        return per_worker

    shared = asyncio.run(run(redis_server.url))
    assert sorted(shared.values()) == [1, 1, 1, 1], shared
    alone = asyncio.run(run(None))
    assert max(alone.values()) == 2, alone  # both replicas picked the same "idle" workers


def test_a_replica_sees_others_bookings_until_they_end_or_expire(
    redis_server: RedisServer,
) -> None:
    config = _config(2)

    async def run() -> None:
        prefix = f"ttl{next(_prefixes)}"
        a, b = (_Replica(config, redis_server.url, prefix) for _ in range(2))
        name, booking = await a.place(list(range(64)))
        seen = (await b.seen())[name]
        assert (seen.in_flight, seen.in_flight_tokens, seen.pending_prefill_tokens) == (1, 64, 64)
        booking.progressed(1)  # first token: its prefill is done, still in flight
        await a.ledger.flush()
        seen = (await b.seen())[name]
        assert (seen.in_flight, seen.pending_prefill_tokens) == (1, 0)
        booking.release()
        await a.ledger.flush()
        assert (await b.seen())[name].in_flight == 0
        # A replica that stops writing (killed): its bookings stop counting after its ttl.
        dead = _Replica(config, redis_server.url, prefix, ttl_s=0.3)
        await dead.place(list(range(64)))
        assert sum(w.in_flight for w in (await b.seen()).values()) == 1
        await asyncio.sleep(0.5)
        assert sum(w.in_flight for w in (await b.seen()).values()) == 0
        for r in (a, b):
            await r.ledger.close()

    asyncio.run(run())


def test_a_live_replica_keeps_its_bookings_past_the_ttl_and_withdraws_them_on_close(
    redis_server: RedisServer,
) -> None:
    config = _config(2)

    async def run() -> None:
        prefix = f"beat{next(_prefixes)}"
        a, b = (_Replica(config, redis_server.url, prefix, ttl_s=0.3) for _ in range(2))
        a.ledger.start(lambda: [w.load for w in a.workers.values()])
        await a.place(list(range(64)))
        await asyncio.sleep(0.6)  # two ttls: the heartbeat rewrote them
        assert sum(w.in_flight for w in (await b.seen()).values()) == 1
        await a.ledger.close()
        assert sum(w.in_flight for w in (await b.seen()).values()) == 0
        await b.ledger.close()

    asyncio.run(run())


def test_an_unreachable_server_leaves_each_replica_on_its_own_figures() -> None:
    config = _config(2)

    async def run() -> None:
        r = _Replica(config, f"redis://127.0.0.1:{free_port()}/0", "down")
        first, _ = await r.place(list(range(64)))  # placed, booked, write failed: no error
        second, _ = await r.place(list(range(100, 164)))
        assert first != second, "its own bookings still count"
        assert r.outage.failures["load_read"] == 2 and r.outage.failures["load_publish"] >= 1
        await r.ledger.close()

    asyncio.run(run())


def test_open_ledger_shares_only_over_a_shared_store() -> None:
    outage = StoreOutage()
    assert not open_ledger(IndexConfig(), outage).shared
    url = "redis://127.0.0.1:1/0"
    assert open_ledger(IndexConfig(store="redis", url=url), outage).shared
    assert not open_ledger(IndexConfig(store="redis", url=url, share_load=False), outage).shared
