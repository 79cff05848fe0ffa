"""The shared index store (`RedisStore`) against a real `redis-server` on 127.0.0.1: the store
contract, its cap and recency, namespaces, warm start of a second router, and placement while
the server is down.

`scripts/test.sh` installs redis-server; without it these tests fail (they never skip)."""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path

import pytest
from index_contract import check_store_contract

from router.config import ConfigError, IndexConfig, RouterConfig
from router.index import (
    MemoryStore,
    PrefixIndex,
    StoreUnavailable,
    WorkerMatch,
    open_store,
)
from router.index.redis import RedisStore
from router.placement import Placement
from router.workers import Workers
from warply.launch import RedisServer, free_port
from warply.protocol import BlockRemoved, BlockStored, Tier, prefix_keys

MODEL = "m"
BS = 4
GPU, CPU = Tier.GPU, Tier.CPU


_prefixes = itertools.count()


def _store(srv: RedisServer, max_entries: int = 4_000_000, prefix: str = "") -> RedisStore:
    """A store under a prefix no other test uses (an empty index), unless one is given."""
    return RedisStore(srv.url, prefix or f"t{next(_prefixes)}", max_entries, timeout_s=5)


def _stored(tokens: list[int], first_hash: int, parent: int | None = None) -> BlockStored:
    n = len(tokens) // BS
    return BlockStored(list(range(first_hash, first_hash + n)), parent, tokens, BS, GPU)


def test_redis_store_keeps_the_store_contract(redis_server: RedisServer) -> None:
    asyncio.run(check_store_contract(lambda: _store(redis_server)))


def test_cap_evicts_least_recently_used_blocks(redis_server: RedisServer) -> None:
    async def run() -> None:
        store = _store(redis_server, max_entries=4)
        await store.add("a", GPU, [1, 2])
        await store.add("b", GPU, [3, 4])
        await store.match([1, 2], ["a"])  # a match is a use: 3 and 4 are now the oldest
        await store.remove("a", CPU, [1])  # removing (nothing) and moving are not uses
        await store.move("b", GPU, CPU, [3])
        await store.add("a", GPU, [5])
        stats = await store.stats()
        assert (stats.entries, stats.evictions) == (4, 1)
        assert (await store.match([3], ["b"]))["b"].blocks == 0  # 3 went first
        await store.add("c", GPU, [4])  # an add is a use: 4 is the newest, 1 goes
        assert (await store.match([1], ["a"]))["a"].blocks == 0
        assert (await store.match([4], ["b", "c"])) == {
            "b": WorkerMatch(1, {GPU: 1}),
            "c": WorkerMatch(1, {GPU: 1}),
        }
        await store.add("c", GPU, [6, 7, 8])  # a shared block goes with all its holders
        stats = await store.stats()
        assert (stats.entries, stats.evictions) == (3, 6)
        assert stats.entries_by_worker_tier == {("c", GPU): 3}
        await store.close()

    asyncio.run(run())


def test_replicas_share_a_prefix_and_deployments_do_not(redis_server: RedisServer) -> None:
    async def run() -> None:
        one, two = _store(redis_server, prefix="d1"), _store(redis_server, prefix="d1")
        other = _store(redis_server, prefix="d2")
        await one.add("a", GPU, [1, 2, 3])
        await two.add("b", CPU, [1])
        assert await two.match([1, 2, 3], ["a", "b"]) == {
            "a": WorkerMatch(3, {GPU: 3}),
            "b": WorkerMatch(1, {CPU: 1}),
        }
        assert (await other.match([1, 2, 3], ["a"]))["a"].blocks == 0
        assert (await other.stats()).entries == 0
        await two.drop_worker("a", [])  # the store knows a's entries, whoever added them
        assert (await one.match([1], ["a"]))["a"].blocks == 0
        for store in (one, two, other):
            await store.close()

    asyncio.run(run())


def test_a_new_router_matches_what_another_ingested(redis_server: RedisServer) -> None:
    """Warm start: a second `PrefixIndex` on the same store (fresh ingestion state) places from
    the first request. Removals of engine hashes it never saw are counted, not applied: the
    router that saw the block stored applies them (the shared entries stay right)."""

    async def run() -> None:
        first = PrefixIndex(MODEL, _store(redis_server, prefix="warm"))
        prompt = list(range(24))
        await first.apply("a", [_stored(prompt[:16], 1)])
        await first.apply("a", [_stored(prompt[16:], 5, parent=4)])
        second = PrefixIndex(MODEL, _store(redis_server, prefix="warm"))
        keys = prefix_keys(prompt, BS, MODEL)
        assert (await second.match(keys, ["a"]))["a"] == WorkerMatch(6, {GPU: 6})
        await second.apply("a", [BlockRemoved([6], GPU)])  # stored before it started
        assert (await second.stats()).skipped == {"unknown_block": 1}
        assert (await second.match(keys, ["a"]))["a"].blocks == 6
        await first.apply("a", [BlockRemoved([6], GPU)])
        assert (await second.match(keys, ["a"]))["a"].blocks == 5
        await first.store.close()
        await second.store.close()

    asyncio.run(run())


def test_marks_keep_each_workers_newest_batch_until_it_is_dropped(
    redis_server: RedisServer,
) -> None:
    """Every replica marks the batches it applies: the newest by the publisher's time stays
    (a replica taking the history again never moves it back, a restarted publisher's lower
    numbers do), exactly as published; `drop_worker` clears it; the memory store keeps none."""

    async def run() -> None:
        store, memory = _store(redis_server), MemoryStore()
        ts = 1_764_900_000.123_456_7
        await store.mark("a", 7, ts)
        await store.mark("a", 3, ts - 1)  # an older batch applied again
        await store.mark("a", 7, ts)
        await store.mark("a", 2, float("nan"))  # no usable time: not marked
        await store.mark("b", 1, 5.0)
        assert (await store.marked("a"), await store.marked("b")) == ((7, ts), (1, 5.0))
        await store.mark("a", 0, ts + 1)  # the publisher restarted: its first batch is newer
        assert await store.marked("a") == (0, ts + 1)
        await store.add("a", GPU, [1, 2])
        await store.drop_worker("a", [1, 2])
        assert (await store.marked("a"), await store.marked("b")) == (None, (1, 5.0))
        assert await store.marked("never-seen") is None
        await memory.mark("a", 7, ts)
        assert await memory.marked("a") is None
        await store.close()

    asyncio.run(run())


def test_open_store_reaches_the_server_or_fails_at_start_up(redis_server: RedisServer) -> None:
    assert isinstance(open_store(IndexConfig()), MemoryStore)
    store = open_store(IndexConfig(store="redis", url=redis_server.url, prefix="open"))
    assert isinstance(store, RedisStore)
    asyncio.run(store.close())
    with pytest.raises(StoreUnavailable, match="refused"):
        open_store(IndexConfig(store="redis", url=f"redis://127.0.0.1:{free_port()}/0"))


def test_a_redis_store_without_its_client_package_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An install without the `redis` extra names the missing package, no traceback."""
    monkeypatch.delitem(sys.modules, "router.index.redis", raising=False)
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` fails as if not installed
    config = IndexConfig(store="redis", url="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError, match=r"needs the `redis` package \(pip install"):
        open_store(config)


def test_placement_keeps_serving_while_the_store_is_down(tmp_path: Path) -> None:
    """The server stops mid-run: decisions go on by load (no matches), the failures are
    counted; it comes back (same port): matches return."""
    config = RouterConfig.model_validate(
        {
            "model": MODEL,
            "tokenizer": "/unused",
            "pools": [
                {
                    "name": "p",
                    "block_size": BS,
                    "workers": [{"name": n, "url": f"http://{n}.invalid"} for n in ("a", "b")],
                }
            ],
        }
    )
    workers = Workers(config.pools)
    for w in workers.values():
        w.healthy = True
    port = free_port()
    prompt = list(range(16))

    async def place(index: PrefixIndex) -> str:
        return (await Placement(config, index, workers).choose(prompt)).worker.name

    async def run(srv: RedisServer) -> None:
        index = PrefixIndex(MODEL, RedisStore(srv.url, "down", timeout_s=0.2))
        await index.apply("b", [_stored(prompt, 1)])
        assert await place(index) == "b"
        srv.stop()
        assert await place(index) in ("a", "b")  # no error: placed without matches
        stats = await index.stats()  # no error either: no entries while unreachable
        assert stats.store_failures == {"match": 1, "stats": 1} and stats.entries == 0
        with RedisServer(log_path=tmp_path / "again.log", port=port) as again:
            again.wait_ready()
            await index.apply("b", [_stored(prompt, 1)])  # the stream rebuilds it
            assert await place(index) == "b" and not index.outage.down
        await index.store.close()

    with RedisServer(log_path=tmp_path / "redis.log", port=port) as srv:
        srv.wait_ready()
        asyncio.run(run(srv))
