"""The router's prefix index: the store contract (on `MemoryStore`), ingestion (canonical keys
from events, tiers, removals, resync) and the memory store's own cap and recency."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import pytest
from index_contract import check_store_contract

from router.index import (
    IndexStats,
    IndexStore,
    MemoryStore,
    PrefixIndex,
    WorkerMatch,
    completed,
)
from warply.protocol import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Tier,
    TierMoved,
    chain_keys,
    prefix_keys,
    root_seed,
)

MODEL = "m"
BS = 4


class _Index:
    """`PrefixIndex` over a `MemoryStore`, driven synchronously (its coroutines never suspend)."""

    def __init__(self, max_entries: int = 4_000_000) -> None:
        self.store = MemoryStore(max_entries)
        self.index = PrefixIndex(MODEL, self.store)

    def apply(self, worker: str, events: Iterable[Event]) -> None:
        completed(self.index.apply(worker, events))

    def drop_worker(self, worker: str) -> None:
        completed(self.index.drop_worker(worker))

    def match(self, keys: Sequence[int], workers: Collection[str] | None = None) -> Any:
        return completed(self.index.match(keys, workers))

    def stats(self) -> IndexStats:
        return completed(self.index.stats())


def _stored(
    tokens: list[int],
    first_hash: int,
    parent: int | None = None,
    tier: Tier = Tier.GPU,
    namespace: str | None = None,
) -> BlockStored:
    n = len(tokens) // BS
    hashes = list(range(first_hash, first_hash + n))
    return BlockStored(hashes, parent, tokens, BS, tier, namespace)


# -- the store contract ----------------------------------------------------------------------


def test_memory_store_keeps_the_store_contract() -> None:
    asyncio.run(check_store_contract(MemoryStore))


def test_memory_store_never_suspends() -> None:
    store = MemoryStore()
    completed(store.add("a", Tier.GPU, [1, 2]))
    assert completed(store.match([1, 2], ["a"]))["a"].blocks == 2

    async def suspends() -> None:
        await asyncio.sleep(0)

    try:
        completed(suspends())
    except RuntimeError:
        pass
    else:
        raise AssertionError("a suspending coroutine must not pass for completed")


def test_memory_store_cap_evicts_least_recently_used_blocks() -> None:
    store = MemoryStore(max_entries=4)
    completed(store.add("a", Tier.GPU, [1, 2]))
    completed(store.add("b", Tier.GPU, [3, 4]))
    completed(store.match([1, 2], ["a"]))  # a match is a use: 3 and 4 are now the oldest
    completed(store.remove("a", Tier.CPU, [1]))  # removing (nothing) and moving are not uses
    completed(store.move("b", Tier.GPU, Tier.CPU, [3]))
    completed(store.add("a", Tier.GPU, [5]))
    stats = completed(store.stats())
    assert (stats.entries, stats.evictions) == (4, 1)
    assert completed(store.match([3], ["b"]))["b"].blocks == 0  # 3 went first
    completed(store.add("c", Tier.GPU, [4]))  # an add is a use: 4 is the newest, 1 goes
    assert [(k, w) for k, w, _ in store.entries()] == [(2, "a"), (5, "a"), (4, "b"), (4, "c")]
    completed(store.add("c", Tier.GPU, [6, 7, 8]))  # a shared block goes with all its holders
    stats = completed(store.stats())
    assert (stats.entries, stats.evictions) == (3, 6)
    assert [(k, w) for k, w, _ in store.entries()] == [(6, "c"), (7, "c"), (8, "c")]


def test_memory_store_slots_reach_past_64_bits() -> None:
    store = MemoryStore()
    workers = [f"w{i}" for i in range(40)]
    for i, w in enumerate(workers):
        completed(store.add(w, list(Tier)[i % 4], list(range(1 + i % 6))))
    m = completed(store.match(list(range(6)), workers))
    assert {w: m[w].blocks for w in workers} == {w: 1 + i % 6 for i, w in enumerate(workers)}
    assert m["w7"].by_tier == {list(Tier)[3]: 2}


# -- ingestion through PrefixIndex -----------------------------------------------------------


def test_match_follows_the_longest_cached_prefix_per_worker() -> None:
    idx = _Index()
    prompt = list(range(40))
    idx.apply("a", [_stored(prompt[:16], 100, namespace="")])
    idx.apply("a", [_stored(prompt[16:24], 104, parent=103)])  # continues the chain
    idx.apply("b", [_stored(prompt[:8], 500)])
    m = idx.match(prefix_keys(prompt, BS, MODEL))
    assert (m["a"].blocks, m["b"].blocks) == (6, 2)
    assert m["a"].by_tier == {Tier.GPU: 6}


def test_namespaces_never_share_blocks() -> None:
    idx = _Index()
    prompt = list(range(16))
    idx.apply("a", [_stored(prompt, 1, namespace="tenant-a")])
    assert idx.match(prefix_keys(prompt, BS, MODEL, "tenant-b"))["a"].blocks == 0
    assert idx.match(prefix_keys(prompt, BS, MODEL))["a"].blocks == 0
    assert idx.match(prefix_keys(prompt, BS, MODEL, "tenant-a"))["a"].blocks == 4
    longer = list(range(24))  # a child event names only its parent: it stays in tenant-a
    idx.apply("a", [_stored(longer[16:], 5, parent=4)])
    assert idx.match(prefix_keys(longer, BS, MODEL, "tenant-a"))["a"].blocks == 6
    assert idx.match(prefix_keys(longer, BS, MODEL))["a"].blocks == 0


def test_removal_per_tier_and_tier_moves() -> None:
    idx = _Index()
    prompt = list(range(16))
    keys = prefix_keys(prompt, BS, MODEL)
    idx.apply("a", [_stored(prompt, 1), _stored(prompt, 1, tier=Tier.CPU)])
    idx.apply("a", [BlockRemoved([3, 4], Tier.GPU)])
    assert idx.match(keys)["a"].by_tier == {Tier.GPU: 2, Tier.CPU: 2}
    idx.apply("a", [TierMoved([1], Tier.GPU, Tier.SSD)])
    assert idx.match(keys)["a"].by_tier == {Tier.GPU: 1, Tier.CPU: 3}  # CPU beats SSD
    idx.apply("a", [BlockRemoved([2], Tier.GPU), BlockRemoved([2], Tier.CPU)])
    assert idx.match(keys)["a"].blocks == 1  # block 2 gone everywhere: the run stops there
    idx.apply("a", [AllCleared(Tier.CPU)])
    assert idx.match(keys)["a"].by_tier == {Tier.SSD: 1}
    idx.apply("a", [AllCleared()])
    assert idx.match(keys)["a"].blocks == 0 and idx.stats().entries == 0


def test_unknown_parent_and_unknown_removal_are_counted() -> None:
    idx = _Index()
    idx.apply("a", [_stored(list(range(8)), 10, parent=999), BlockRemoved([12345])])
    assert idx.stats().skipped == {"unknown_parent": 2, "unknown_block": 1}
    assert idx.stats().entries == 0


def test_engine_hashes_are_forgotten_once_the_worker_holds_the_block_nowhere() -> None:
    idx = _Index()
    idx.apply("a", [_stored(list(range(8)), 1), _stored(list(range(8)), 1, tier=Tier.CPU)])
    idx.apply("a", [BlockRemoved([1], Tier.GPU)])  # still on CPU: the hash stays known
    idx.apply("a", [TierMoved([1], Tier.CPU, Tier.SSD)])
    assert not idx.stats().skipped
    idx.apply("a", [BlockRemoved([1, 1], Tier.SSD)])  # gone: its repeat is an unknown block
    assert idx.stats().skipped == {"unknown_block": 1}
    idx.apply("a", [BlockRemoved([1], Tier.GPU), TierMoved([1, 2, 77], Tier.GPU, Tier.CPU)])
    assert idx.stats().skipped == {"unknown_block": 4}  # 1 unknown twice, 77 never known
    idx.apply("a", [_stored(list(range(8, 12)), 9, parent=1)])  # its parent was forgotten
    assert idx.stats().skipped == {"unknown_block": 4, "unknown_parent": 1}


def test_lru_cap_evicts_oldest_blocks_and_counts_them() -> None:
    idx = _Index(max_entries=8)
    old, new = list(range(16)), list(range(100, 132))
    idx.apply("a", [_stored(old, 1)])
    idx.apply("b", [_stored(new, 50)])
    stats = idx.stats()
    assert stats.entries == 8 and stats.evictions == 4
    assert idx.match(prefix_keys(old, BS, MODEL))["a"].blocks == 0
    assert idx.match(prefix_keys(new, BS, MODEL))["b"].blocks == 8


def test_a_child_of_an_evicted_block_still_chains() -> None:
    idx = _Index(max_entries=4)
    prompt = list(range(32))
    idx.apply("a", [_stored(prompt[:16], 1)])
    idx.apply("b", [_stored(list(range(100, 116)), 50)])  # evicts all of a's blocks
    idx.apply("a", [_stored(prompt[16:], 5, parent=4)])
    assert not idx.stats().skipped
    keys = prefix_keys(prompt, BS, MODEL)
    assert idx.match(keys[4:], ["a"])["a"].blocks == 4


def test_drop_worker_forgets_only_that_worker() -> None:
    idx = _Index()
    prompt = list(range(16))
    idx.apply("a", [_stored(prompt, 1)])
    idx.apply("b", [_stored(prompt, 7)])
    idx.drop_worker("a")
    m = idx.match(prefix_keys(prompt, BS, MODEL))
    assert "a" not in m and m["b"].blocks == 4 and idx.stats().entries == 4


def _random_events(idx: _Index, seed: int, steps: int = 400) -> list[tuple[str, Any]]:
    """Random stores, removals, moves, clears and drops (None) over three workers, applied to
    `idx` as they are drawn, each step checked against a full walk of its store."""
    rng = random.Random(seed)
    tiers = list(Tier)
    next_hash = 1
    stored: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    steps_out: list[tuple[str, Any]] = []
    for _ in range(steps):
        worker = rng.choice(list(stored))
        op = rng.random()
        step: Any
        if op < 0.5 or not stored[worker]:
            n = rng.randint(1, 4)
            tokens = [rng.randrange(3) for _ in range(n * BS)]  # few values: shared blocks
            step = [_stored(tokens, next_hash, tier=rng.choice(tiers))]
            stored[worker] += range(next_hash, next_hash + n)
            next_hash += n
        elif op < 0.7:
            step = [BlockRemoved(rng.sample(stored[worker], 1), rng.choice(tiers))]
        elif op < 0.85:
            src, dst = rng.sample(tiers, 2)
            step = [TierMoved(rng.sample(stored[worker], 1), src, dst)]
        elif op < 0.95:
            step = [AllCleared(rng.choice([None, *tiers]))]
        else:
            step = None
            stored[worker] = []
        steps_out.append((worker, step))
        if step is None:
            idx.drop_worker(worker)
        else:
            idx.apply(worker, step)
        walked: Counter[tuple[str, Tier]] = Counter()
        for _, w, bits in idx.store.entries():
            walked[(w, list(Tier)[(bits & -bits).bit_length() - 1])] += 1
        stats = idx.stats()
        assert stats.entries_by_worker_tier == walked
        assert stats.entries == sum(walked.values()) <= idx.store.max_entries
    return steps_out


def test_stats_counts_stay_equal_to_a_full_walk_under_random_events() -> None:
    _random_events(_Index(max_entries=60), seed=4)


class _Suspending(IndexStore):
    """A store that yields to the event loop in every call, as a network store does."""

    def __init__(self, inner: IndexStore) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    async def _hop(self, name: str) -> None:
        self.calls[name] += 1
        await asyncio.sleep(0)

    async def add(
        self, worker: str, tier: Tier, keys: Sequence[int], chain: bool = False,
        after: int | None = None,
    ) -> None:
        await self._hop("add")
        await self.inner.add(worker, tier, keys, chain, after)

    async def remove(self, worker: str, tier: Tier | None, keys: Sequence[int]) -> list[bool]:
        await self._hop("remove")
        return await self.inner.remove(worker, tier, keys)

    async def move(self, worker: str, src: Tier, dst: Tier, keys: Sequence[int]) -> int:
        await self._hop("move")
        return await self.inner.move(worker, src, dst, keys)

    async def drop_worker(self, worker: str, keys: Iterable[int]) -> None:
        await self._hop("drop_worker")
        await self.inner.drop_worker(worker, keys)

    async def match(self, keys: Sequence[int], workers: Collection[str]) -> dict[str, WorkerMatch]:
        await self._hop("match")
        return await self.inner.match(keys, workers)

    async def stats(self) -> IndexStats:
        await self._hop("stats")
        return await self.inner.stats()


def test_ingestion_speaks_only_the_contract_and_may_be_suspended() -> None:
    """The same events through a store that suspends in every call give the same index."""
    direct = _Index(max_entries=60)
    steps = _random_events(direct, seed=9)
    store = _Suspending(MemoryStore(60))
    index = PrefixIndex(MODEL, store)

    async def feed() -> tuple[IndexStats, list[tuple[int, str, int]]]:
        for worker, step in steps:
            if step is None:
                await index.drop_worker(worker)
            else:
                await index.apply(worker, step)
        assert isinstance(store.inner, MemoryStore)
        return await index.stats(), list(store.inner.entries())

    stats, entries = asyncio.run(feed())
    assert stats == direct.stats() and entries == list(direct.store.entries())
    assert set(store.calls) == {"add", "remove", "move", "drop_worker", "stats"}


def test_a_run_ends_at_a_missing_block_even_for_one_candidate() -> None:
    idx = _Index(max_entries=7)
    prompt = list(range(32))
    idx.apply("a", [_stored(prompt, 1)])  # 8 blocks, cap 7: the chain's first one is evicted
    keys = prefix_keys(prompt, BS, MODEL)
    assert idx.match(keys, ["a"])["a"].blocks == 0
    assert idx.match(keys[1:], ["a"])["a"].blocks == 7


def test_many_workers_share_blocks() -> None:
    idx = _Index()
    prompt = list(range(24))
    workers = [f"w{i}" for i in range(40)]  # slots far past 64 bits
    for i, w in enumerate(workers):
        idx.apply(w, [_stored(prompt[: BS * (1 + i % 6)], 1000 * i, tier=list(Tier)[i % 4])])
    m = idx.match(prefix_keys(prompt, BS, MODEL))
    assert {w: m[w].blocks for w in workers} == {w: 1 + i % 6 for i, w in enumerate(workers)}
    assert m["w7"].by_tier == {list(Tier)[3]: 2}
    assert idx.stats().entries == sum(1 + i % 6 for i in range(40))
    idx.drop_worker("w5")
    after = idx.match(prefix_keys(prompt, BS, MODEL), ["w5", "w11"])
    assert (after["w5"].blocks, after["w11"]) == (0, m["w11"])


def test_engine_hash_maps_stay_within_the_cap_and_the_store_follows() -> None:
    """Engines that never remove (or whose removals were lost): each worker's map keeps at
    most its share of `max_hashes`; the blocks it dropped leave the store too, so every entry
    the store holds can still be removed by the worker's events."""
    store = MemoryStore(100_000)
    index = PrefixIndex(MODEL, store, max_hashes=60)
    rng = random.Random(5)
    next_hash = 1
    for step in range(300):
        worker = f"w{step % 3}"
        tokens = [rng.randrange(1000) for _ in range(BS * rng.randrange(1, 6))]
        completed(index.apply(worker, [_stored(tokens, next_hash)]))
        next_hash += len(tokens) // BS
        assert index.ingest.hashes() <= 60 + 5
    held = Counter(worker for _, worker, _ in store.entries())
    maps = index.ingest._engine
    assert all(held[w] == len(maps[w]) <= 20 + 5 for w in maps)
    assert completed(index.stats()).skipped["hash_cap"] > 0
    for w, hashes in maps.items():  # every block still indexed can be removed
        completed(index.apply(w, [BlockRemoved(list(hashes))]))
    assert completed(index.stats()).entries == 0


# -- remembered runs: a conversation's history is skipped, never trusted stale -----------------


class _PlainStore:
    """Holders per block and the LRU order as per-block moves leave them: the reference the
    memory store's remembered runs and deferred moves must equal."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.blocks: OrderedDict[int, dict[str, set[Tier]]] = OrderedDict()

    def add(self, worker: str, tier: Tier, keys: Sequence[int]) -> None:
        known = self.blocks.keys() & set(keys)
        for k in keys:
            if k in known:
                self.blocks.move_to_end(k)
                self.blocks[k].setdefault(worker, set()).add(tier)
        for k in dict.fromkeys(k for k in keys if k not in known):
            self.blocks.setdefault(k, {}).setdefault(worker, set()).add(tier)
        while sum(len(h) for h in self.blocks.values()) > self.max_entries:
            self.blocks.popitem(last=False)

    def change(
        self, worker: str, keys: Sequence[int], drop: Tier | None, gain: Tier | None
    ) -> None:
        """`worker`'s blocks lose `drop` (None: every tier) and gain `gain` where held."""
        for k in keys:
            held = self.blocks.get(k, {}).get(worker)
            if not held:
                continue
            held -= set(Tier) if drop is None else {drop}
            if gain is not None:
                held.add(gain)
            if not held:
                del self.blocks[k][worker]
                if not self.blocks[k]:
                    del self.blocks[k]

    def match(self, keys: Sequence[int], workers: Collection[str]) -> dict[str, WorkerMatch]:
        out = {}
        for w in workers:
            run = 0
            while run < len(keys) and w in self.blocks.get(keys[run], {}):
                run += 1
            fastest = Counter(min(self.blocks[k][w], key=list(Tier).index) for k in keys[:run])
            out[w] = WorkerMatch(run, dict(fastest))
        for k in keys[: max((m.blocks for m in out.values()), default=0)]:
            self.blocks.move_to_end(k)
        return out

    def order(self) -> list[tuple[int, frozenset[str]]]:
        return [(k, frozenset(h)) for k, h in self.blocks.items()]


def _order(store: MemoryStore) -> list[tuple[int, frozenset[str]]]:
    by_key: dict[int, set[str]] = {}
    for k, w, _ in store.entries():
        by_key.setdefault(k, set()).add(w)
    return [(k, frozenset(ws)) for k, ws in by_key.items()]


@pytest.mark.parametrize(
    ("log", "changes"), [(None, True), (16, True), (None, False), (16, False)]
)
def test_remembered_runs_match_and_order_like_a_block_walk_under_random_conversations(
    log: int | None, changes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Conversations that grow turn by turn, stored in chained runs on three workers, with
    removals, tier moves, new tiers, drops and cap evictions between matches: every match and
    the LRU order equal a store that walks and moves block by block (also with a change log
    so short that it is trimmed over and over, and with cap evictions the only changes, which
    runs settle by their LRU bound)."""
    from router.index import memory

    if log is not None:
        monkeypatch.setattr(memory, "_LOG", log)
    rng = random.Random(5)
    parents = random.Random(6)  # whether a stored run names its parent (may extend a run)
    store, plain = MemoryStore(max_entries=2500), _PlainStore(2500)
    workers = ["a", "b", "c"]
    tiers = list(Tier)
    chains: list[list[int]] = []
    stored: dict[str, set[int]] = {w: set() for w in workers}
    skipped = 0
    for step in range(1500):
        op = rng.random()
        if op < 0.3 or not chains:  # a new conversation (some share a first turn) or a turn
            if chains and rng.random() < 0.7:
                base = rng.choice(chains)
                chain = base[: rng.randint(1, len(base))]
            else:
                chain = []
            tokens = [rng.randrange(50) for _ in range(BS * rng.randint(1, 40))]
            seed = chain[-1] if chain else root_seed(MODEL)
            chain = chain + chain_keys(tokens, BS, seed)
            chains.append(chain)
        elif op < 0.6:  # a worker stores a run of a conversation: the blocks it lacks, in steps
            w, chain, tier = rng.choice(workers), rng.choice(chains), rng.choice(tiers[:2])
            start = 0  # from where its cached prefix ends (sometimes a stray later run)
            while start < len(chain) and w in plain.blocks.get(chain[start], {}):
                start += 1
            if rng.random() < 0.1:
                start = rng.randrange(len(chain))
            while start < len(chain):
                end = min(len(chain), start + rng.randint(1, 30))
                after = chain[start - 1] if start and parents.random() < 0.8 else None
                completed(store.add(w, tier, chain[start:end], chain=True, after=after))
                plain.add(w, tier, chain[start:end])
                stored[w].update(chain[start:end])
                start = end
        elif not changes:  # cap evictions the only changes: no removals, moves or drops
            pass
        elif op < 0.75 and any(stored.values()):  # removals, moves, new tiers of a few blocks
            w = rng.choice([w for w in workers if stored[w]])
            keys = rng.sample(sorted(stored[w]), min(len(stored[w]), rng.randint(1, 3)))
            kind = rng.randrange(3)
            if kind == 0:
                tier = rng.choice([None, *tiers])
                completed(store.remove(w, tier, keys))
                plain.change(w, keys, tier, None)
            elif kind == 1:
                src, dst = rng.sample(tiers, 2)
                completed(store.move(w, src, dst, keys))
                plain.change(w, keys, src, dst)
            else:
                tier = rng.choice(tiers)  # a held block gains a tier (and counts as used)
                held = [k for k in keys if w in plain.blocks.get(k, {})]
                completed(store.add(w, tier, held))
                plain.add(w, tier, held)
        elif op < 0.78:
            w = rng.choice(workers)
            completed(store.drop_worker(w, stored[w]))
            plain.change(w, list(stored[w]), None, None)
            stored[w] = set()
        chain = rng.choice(chains)
        chain = chain[: rng.randint(len(chain) // 2, len(chain))]
        asked = rng.sample(workers, rng.randint(1, 3))
        got, want = completed(store.match(chain, asked)), plain.match(chain, asked)
        assert got == want, step
        skipped += any(store._runs.values())
        if step % 50 == 0:
            assert _order(store) == plain.order(), step
    assert _order(store) == plain.order()
    assert skipped > 500  # runs were remembered (and so skipped) through most of the run
    if log is not None:  # the log was trimmed many times over
        assert max(map(len, store._changed_at.values())) <= log < max(store._count.values()) // 10


class _CountingBlocks(OrderedDict[int, int]):
    """The memory store's block map, counting the lookups a match makes."""

    lookups = 0

    def get(self, key: int, default: Any = None) -> Any:
        type(self).lookups += 1
        return super().get(key, default)


def test_a_next_turn_looks_up_its_new_blocks_not_its_history() -> None:
    """A 2,000-block history stored in chained runs, then a 40-block turn past it: the match
    skips the history's runs, and the one after it the run that match remembered."""
    store = MemoryStore()
    store._blocks = _CountingBlocks()
    history = chain_keys(list(range(2000 * BS)), BS, root_seed(MODEL))
    for start in range(0, 2000, 250):  # prefilled in steps, as engines store blocks
        completed(store.add("a", Tier.GPU, history[start : start + 250], chain=True))
    completed(store.add("b", Tier.GPU, history[:3], chain=True))
    turn = history + chain_keys([7] * 40 * BS, BS, history[-1])
    for i in range(0, 40, 4):  # the turn's blocks, some of them stored one by one
        completed(store.add("a", Tier.CPU, turn[2000 + i : 2000 + i + 3], chain=True))
    _CountingBlocks.lookups = 0
    m = completed(store.match(turn, ["a", "b"]))
    assert (m["a"], m["b"]) == (
        WorkerMatch(2003, {Tier.GPU: 2000, Tier.CPU: 3}),
        WorkerMatch(3, {Tier.GPU: 3}),
    )
    assert _CountingBlocks.lookups <= 40 + 10  # the new blocks, and a few of the history
    _CountingBlocks.lookups = 0
    assert completed(store.match(turn, ["a"]))["a"] == m["a"]
    assert _CountingBlocks.lookups <= 40 + 1


def test_a_prefill_stored_in_steps_and_its_decode_blocks_make_one_run() -> None:
    """Ingested as an engine publishes them (a 2,048-block prompt in 16 chained steps, then 12
    decode blocks one event each), the worker's blocks form one remembered run: the first
    match of the next turn skips the whole history at once and looks up only its new blocks,
    and a block removed inside the run is still seen."""
    store = MemoryStore()
    index = PrefixIndex(MODEL, store)
    store._blocks = _CountingBlocks()
    rng = random.Random(1)
    tokens = [rng.randrange(1000) for _ in range(2060 * BS)]
    events, parent = [], None
    for start in range(0, 2048, 128):  # prefill steps
        events.append(_stored(tokens[start * BS : (start + 128) * BS], 10_000 + start, parent))
        parent = 10_000 + start + 127
    for i in range(2048, 2060):  # decode fills one block per step
        events.append(_stored(tokens[i * BS : (i + 1) * BS], 10_000 + i, parent))
        parent = 10_000 + i
    completed(index.apply("a", events))
    assert len(store._runs[store._shift["a"]]) == 1
    turn = prefix_keys(tokens + [7] * 40 * BS, BS, MODEL)
    _CountingBlocks.lookups = 0
    assert completed(store.match(turn, ["a"]))["a"] == WorkerMatch(2060, {Tier.GPU: 2060})
    assert _CountingBlocks.lookups <= 1 + 40  # the first block (every worker's), the new ones
    completed(index.apply("a", [BlockRemoved([10_000 + 1500])]))
    assert completed(store.match(turn, ["a"]))["a"] == WorkerMatch(1500, {Tier.GPU: 1500})


def test_a_changed_block_inside_a_remembered_run_is_never_skipped() -> None:
    store = MemoryStore()
    chain = chain_keys(list(range(100 * BS)), BS, root_seed(MODEL))
    completed(store.add("a", Tier.GPU, chain, chain=True))
    assert completed(store.match(chain, ["a"]))["a"].blocks == 100
    completed(store.move("a", Tier.GPU, Tier.CPU, [chain[70]]))
    assert completed(store.match(chain, ["a"]))["a"].by_tier == {Tier.GPU: 99, Tier.CPU: 1}
    completed(store.add("a", Tier.GPU, [chain[70]]))  # a faster copy again
    assert completed(store.match(chain, ["a"]))["a"].by_tier == {Tier.GPU: 100}
    completed(store.remove("a", None, [chain[40]]))
    assert completed(store.match(chain, ["a"]))["a"] == WorkerMatch(40, {Tier.GPU: 40})
    completed(store.add("a", Tier.GPU, [chain[40]]))
    assert completed(store.match(chain, ["a"]))["a"].blocks == 100
    small = MemoryStore(max_entries=100)  # the cap evicts the oldest block: the run's first
    completed(small.add("a", Tier.GPU, chain, chain=True))
    completed(small.add("b", Tier.GPU, [1]))
    assert completed(small.match(chain, ["a"]))["a"].blocks == 0
    assert completed(small.match(chain[1:], ["a"]))["a"].blocks == 99
    completed(store.drop_worker("a", chain))
    assert completed(store.match(chain, ["a"]))["a"].blocks == 0


class _CountingLog(dict[int, int]):
    """A worker's change log, counting the membership passes made over it."""

    passes = 0

    def keys(self) -> Any:
        type(self).passes += 1
        return super().keys()


def test_evictions_short_of_a_run_are_settled_without_its_keys_and_one_inside_is_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under cap churn the only changes are evictions: a run with more blocks before it than
    blocks evicted, deleted or moved since it was known held is skipped without a look-up of
    its keys, even once the change log dropped the records since (a run is only dropped with
    them when a change since was not an eviction); an eviction that reaches inside it (its
    head was used again, so its middle is oldest) is still seen."""
    from router.index import memory

    monkeypatch.setattr(memory, "_LOG", 8)
    unrelated = chain_keys([9] * 300 * BS, BS, root_seed("other"))
    run = chain_keys(list(range(100 * BS)), BS, root_seed(MODEL))
    store = MemoryStore(max_entries=150)
    completed(store.add("a", Tier.GPU, unrelated[:40]))
    completed(store.add("a", Tier.GPU, run, chain=True))  # 40 blocks before the run's
    shift = store._shift["a"]
    store._changed_at[shift] = _CountingLog()
    completed(store.add("b", Tier.GPU, unrelated[40:60]))  # 10 of the 40 evicted
    assert store._count[shift] == 10 and store._floor[shift] > 0  # the log was trimmed
    assert run[0] in store._runs[shift]  # kept: only evictions since
    _CountingLog.passes = 0
    assert completed(store.match(run, ["a"]))["a"].blocks == 100
    assert _CountingLog.passes == 0
    completed(store.add("b", Tier.GPU, unrelated[60:65]))  # 5 more: the run was checked since
    completed(store.remove("a", None, [unrelated[30]]))  # not an eviction: the keys are looked up
    assert completed(store.match(run, ["a"]))["a"].blocks == 100
    assert _CountingLog.passes == 1
    completed(store.add("b", Tier.GPU, unrelated[65:75]))  # the log trimmed past the removal
    completed(store.remove("a", None, [run[60]]))
    assert completed(store.match(run, ["a"]))["a"].blocks == 60

    store = MemoryStore(max_entries=150)
    completed(store.add("a", Tier.GPU, unrelated[:40]))
    completed(store.add("a", Tier.GPU, run, chain=True))
    assert completed(store.match(run[:5], ["a"]))["a"].blocks == 5  # the head moves to the end
    completed(store.add("b", Tier.GPU, unrelated[40:91]))  # evicts the 40 and run[5]
    assert completed(store.match(run, ["a"]))["a"].blocks == 5
    assert completed(store.match(run[6:], ["a"]))["a"].blocks == 94


def test_remembered_runs_and_change_records_stay_bounded() -> None:
    from router.index import memory

    store = MemoryStore(max_entries=10**6)
    for i in range(memory._RUNS + 100):
        chain = chain_keys([i] * 8 * BS, BS, root_seed(MODEL))
        completed(store.add("a", Tier.GPU, chain, chain=True))
    shift = store._shift["a"]
    assert len(store._runs[shift]) == memory._RUNS  # the least recently used went
    keys = [k for k, _, _ in store.entries()][: memory._LOG // 2]
    completed(store.move("a", Tier.GPU, Tier.CPU, keys))
    assert len(store._changed_at[shift]) == len(keys) and store._runs[shift]
    more = chain_keys([0] * (memory._LOG - len(keys) + 1) * BS, BS, root_seed("other"))
    completed(store.add("a", Tier.GPU, more))
    completed(store.move("a", Tier.GPU, Tier.CPU, more))  # past the bound: all dropped
    assert len(store._changed_at[shift]) <= memory._LOG and not store._runs[shift]


def test_a_run_checked_since_the_oldest_kept_change_outlives_the_change_log_trim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the change log's bound its older half goes, and with it only the runs known held
    before the last change dropped: a run checked since stays, and still sees later changes."""
    from router.index import memory

    monkeypatch.setattr(memory, "_LOG", 8)
    store = MemoryStore(max_entries=10**6)
    run = chain_keys(list(range(20 * BS)), BS, root_seed(MODEL))
    stale = chain_keys(list(range(100, 120 * BS)), BS, root_seed(MODEL))[:20]
    other = chain_keys([7] * 9 * BS, BS, root_seed("other"))
    completed(store.add("a", Tier.GPU, run, chain=True))
    completed(store.add("a", Tier.GPU, stale, chain=True))
    completed(store.add("a", Tier.GPU, other))
    shift = store._shift["a"]
    completed(store.move("a", Tier.GPU, Tier.CPU, other[:6]))  # changes 1..6
    assert completed(store.match(run, ["a"]))["a"].blocks == 20  # checked: known held at 6
    completed(store.move("a", Tier.GPU, Tier.CPU, other[6:]))  # 7..9: the log is trimmed
    assert len(store._changed_at[shift]) == 4
    assert run[0] in store._runs[shift] and stale[0] not in store._runs[shift]
    completed(store.remove("a", None, [run[10]]))
    assert completed(store.match(run, ["a"]))["a"].blocks == 10
    assert completed(store.match(stale, ["a"]))["a"].blocks == 20


def test_workers_coming_and_going_under_new_names_reuse_slots() -> None:
    """Workers dropped holding nothing give their slot to the next new one: after 500 names,
    the store keeps as many slots as were ever live at once, and the holders ints stay narrow;
    the live workers' matches are unchanged throughout."""
    idx = _Index()
    rng = random.Random(7)
    live: dict[str, list[int]] = {}
    stay = [rng.randrange(1000) for _ in range(BS * 3)]
    idx.apply("stay", [_stored(stay, 1)])
    for n in range(500):
        name = f"pod-{n}"
        tokens = stay[: BS * rng.randrange(1, 4)] + [rng.randrange(1000) for _ in range(BS * 2)]
        idx.apply(name, [_stored(tokens, 1000 + 10 * n)])
        live[name] = tokens
        if len(live) > 4:
            gone = rng.choice(sorted(live))
            idx.drop_worker(gone)
            del live[gone]
        assert idx.match(prefix_keys(stay, BS, MODEL, ""), ["stay"])["stay"].blocks == 3
        for w, tokens in live.items():
            assert idx.match(prefix_keys(tokens, BS, MODEL, ""), [w])[w].blocks == len(tokens) // BS
    store = idx.store
    assert len(store._shift) == len(live) + 1 and len(store._workers) <= 6
    assert max(h.bit_length() for h in store._blocks.values()) <= 4 * 6
    assert {w for w, _ in store._held} == set(live) | {"stay"}
