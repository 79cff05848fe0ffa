"""The checks every `IndexStore` passes, written against the contract alone.

`tests/test_index.py` runs them on `MemoryStore`. A new store's tests run them the same way:

    from index_contract import check_store_contract
    asyncio.run(check_store_contract(lambda: MyStore(...)))

`new_store` must return an empty store that holds a few hundred entries without evicting (the
contract lets a store evict at any time; these checks count entries exactly). Nothing here
assumes a store never suspends: every call is awaited.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable

from router.index import IndexStore, WorkerMatch
from warply.protocol import Tier

GPU, CPU, SSD, OBJ = Tier.GPU, Tier.CPU, Tier.SSD, Tier.OBJECT_STORE

Check = Callable[[IndexStore], Awaitable[None]]


async def _add_then_match(s: IndexStore) -> None:
    await s.add("a", GPU, [1, 2, 3, 4])
    await s.add("b", CPU, [1, 2])
    assert await s.match([1, 2, 3, 4, 5], ["a", "b", "never-seen"]) == {
        "a": WorkerMatch(4, {GPU: 4}),
        "b": WorkerMatch(2, {CPU: 2}),
        "never-seen": WorkerMatch(0, {}),
    }
    assert await s.match([1, 2], ["a"]) == {"a": WorkerMatch(2, {GPU: 2})}  # only those asked
    assert (await s.match([9, 1, 2], ["a"]))["a"] == WorkerMatch(0, {})  # runs start at keys[0]
    assert (await s.match([], ["a", "b"])) == {"a": WorkerMatch(0, {}), "b": WorkerMatch(0, {})}
    assert await s.match([1], []) == {}


async def _a_run_ends_at_the_first_missing_key(s: IndexStore) -> None:
    await s.add("a", GPU, [1, 2, 4, 5])
    await s.add("b", GPU, [1, 2, 3, 4, 5])
    m = await s.match([1, 2, 3, 4, 5], ["a", "b"])
    assert (m["a"].blocks, m["b"].blocks) == (2, 5)
    assert (await s.match([1, 2, 3, 4, 5], ["a"]))["a"].blocks == 2  # one candidate alone too


async def _chained_adds_naming_their_parent_match_as_one_chain(s: IndexStore) -> None:
    await s.add("a", GPU, [11, 12, 13, 14, 15], chain=True)
    await s.add("a", GPU, [16], chain=True, after=15)  # a decode step's block
    await s.add("a", CPU, [17, 18, 19, 20], chain=True, after=16)
    await s.add("a", GPU, [30, 31], chain=True, after=99)  # no run ends there
    chain = list(range(11, 21))
    assert (await s.match([*chain, 21], ["a"]))["a"] == WorkerMatch(10, {GPU: 6, CPU: 4})
    assert await s.remove("a", None, [18]) == [False]
    assert (await s.match(chain, ["a"]))["a"] == WorkerMatch(7, {GPU: 6, CPU: 1})
    assert (await s.match([30, 31], ["a"]))["a"] == WorkerMatch(2, {GPU: 2})


async def _entries_count_once_under_their_fastest_tier(s: IndexStore) -> None:
    await s.add("a", CPU, [1, 2, 3])
    await s.add("a", GPU, [2, 3, 4])
    await s.add("a", OBJ, [1, 1])  # repeated keys; a slower extra copy changes no count
    await s.add("a", GPU, [4])  # already there
    assert (await s.match([1, 2, 3, 4], ["a"]))["a"] == WorkerMatch(4, {CPU: 1, GPU: 3})
    stats = await s.stats()
    assert (stats.entries, stats.evictions) == (4, 0)
    assert stats.entries_by_tier == Counter({GPU: 3, CPU: 1})
    assert stats.entries_by_worker_tier == Counter({("a", GPU): 3, ("a", CPU): 1})
    assert not stats.skipped


async def _remove_reports_what_the_worker_still_holds(s: IndexStore) -> None:
    await s.add("a", GPU, [1, 2, 5])
    await s.add("a", CPU, [1])
    await s.add("b", GPU, [2])
    assert await s.remove("a", GPU, [1, 2, 3]) == [True, False, False]  # 3: never held
    assert (await s.match([1, 2], ["a", "b"])) == {
        "a": WorkerMatch(1, {CPU: 1}),
        "b": WorkerMatch(0, {}),
    }
    assert (await s.match([2], ["b"]))["b"].blocks == 1  # other workers keep theirs
    assert await s.remove("a", GPU, [5, 5]) == [False, False]  # a repeat finds it gone
    assert await s.remove("a", SSD, [1]) == [True]  # not on that tier: unchanged
    assert await s.remove("a", None, [1]) == [False]  # every tier
    assert await s.remove("nobody", GPU, [1, 2]) == [False, False]
    assert await s.remove("a", GPU, []) == []
    stats = await s.stats()
    assert stats.entries == 1 and stats.entries_by_worker_tier == Counter({("b", GPU): 1})


async def _move_changes_tiers_of_held_keys_only(s: IndexStore) -> None:
    await s.add("a", GPU, [1, 2])
    await s.add("b", GPU, [7])
    assert await s.move("a", GPU, SSD, [1, 3, 7]) == 2  # 3 unknown, 7 held by b only
    assert (await s.match([1, 2], ["a"]))["a"] == WorkerMatch(2, {SSD: 1, GPU: 1})
    assert (await s.match([7], ["a", "b"])) == {
        "a": WorkerMatch(0, {}),
        "b": WorkerMatch(1, {GPU: 1}),
    }
    assert await s.move("a", CPU, OBJ, [2]) == 0  # src not held: dst is added all the same
    assert await s.remove("a", GPU, [2]) == [True]  # the object-store copy remains
    assert (await s.match([2], ["a"]))["a"] == WorkerMatch(1, {OBJ: 1})
    assert await s.move("nobody", GPU, CPU, [1]) == 1
    stats = await s.stats()
    assert stats.entries == 3
    assert stats.entries_by_worker_tier == Counter({("a", SSD): 1, ("a", OBJ): 1, ("b", GPU): 1})


async def _drop_worker_forgets_only_that_worker(s: IndexStore) -> None:
    await s.add("a", GPU, [1, 2, 3])
    await s.add("a", CPU, [3])
    await s.add("b", GPU, [1, 2])
    await s.drop_worker("a", [1, 2, 3, 99])  # a superset of what it holds
    assert await s.match([1, 2, 3], ["a", "b"]) == {
        "a": WorkerMatch(0, {}),
        "b": WorkerMatch(2, {GPU: 2}),
    }
    stats = await s.stats()
    assert stats.entries == 2 and stats.entries_by_worker_tier == Counter({("b", GPU): 2})
    await s.drop_worker("nobody", [1])
    await s.add("a", CPU, [1])  # the worker comes back
    assert (await s.match([1, 2], ["a"]))["a"] == WorkerMatch(1, {CPU: 1})


async def _stats_are_a_fresh_copy(s: IndexStore) -> None:
    await s.add("a", GPU, [1])
    first = await s.stats()
    first.entries_by_tier[GPU] += 10
    first.entries_by_worker_tier[("a", GPU)] += 10
    again = await s.stats()
    assert again.entries_by_tier == Counter({GPU: 1})
    assert again.entries_by_worker_tier == Counter({("a", GPU): 1})
    await s.remove("a", GPU, [1])
    empty = await s.stats()
    assert (empty.entries, dict(empty.entries_by_tier), dict(empty.entries_by_worker_tier)) == (
        0,
        {},
        {},
    )  # zero counts are left out


async def _agrees_with_a_model_under_random_calls(s: IndexStore) -> None:
    """Random calls on three workers; after each, match and stats equal a plain model's."""
    rng = random.Random(11)
    tiers = list(Tier)
    workers = ["a", "b", "c"]
    model: dict[tuple[int, str], set[Tier]] = {}  # (key, worker) -> tiers

    def expect(keys: list[int], asked: list[str]) -> dict[str, WorkerMatch]:
        out = {}
        for w in asked:
            run = 0
            while run < len(keys) and model.get((keys[run], w)):
                run += 1
            by_tier: Counter[Tier] = Counter(
                min(model[(k, w)], key=tiers.index) for k in keys[:run]
            )
            out[w] = WorkerMatch(run, dict(by_tier))
        return out

    for _ in range(600):
        w = rng.choice(workers)
        keys = [rng.randrange(40) for _ in range(rng.randint(0, 6))]
        op = rng.random()
        if op < 0.45:
            tier = rng.choice(tiers)
            await s.add(w, tier, keys)
            for k in keys:
                model.setdefault((k, w), set()).add(tier)
        elif op < 0.7:
            gone: Tier | None = rng.choice([None, *tiers])
            flags = []
            for k in keys:
                held = model.get((k, w), set())
                held -= set(tiers) if gone is None else {gone}
                flags.append(bool(held))
            assert await s.remove(w, gone, keys) == flags
        elif op < 0.9:
            src, dst = rng.choice(tiers), rng.choice(tiers)
            absent = 0
            for k in keys:
                held = model.get((k, w), set())
                if not held:
                    absent += 1
                    continue
                held.discard(src)
                held.add(dst)
            assert await s.move(w, src, dst, keys) == absent
        else:
            await s.drop_worker(w, [k for (k, x) in model if x == w])
            for k in [k for (k, x) in model if x == w]:
                model[(k, w)].clear()
        chain = [rng.randrange(40) for _ in range(8)]
        asked = rng.sample(workers, rng.randint(1, 3))
        assert await s.match(chain, asked) == expect(chain, asked)
        stats = await s.stats()
        fastest = {kw: min(t, key=tiers.index) for kw, t in model.items() if t}
        assert stats.entries == len(fastest)
        assert stats.entries_by_worker_tier == Counter((w, t) for (_, w), t in fastest.items())
        assert stats.entries_by_tier == Counter(fastest.values())


CHECKS: tuple[Check, ...] = (
    _add_then_match,
    _a_run_ends_at_the_first_missing_key,
    _chained_adds_naming_their_parent_match_as_one_chain,
    _entries_count_once_under_their_fastest_tier,
    _remove_reports_what_the_worker_still_holds,
    _move_changes_tiers_of_held_keys_only,
    _drop_worker_forgets_only_that_worker,
    _stats_are_a_fresh_copy,
    _agrees_with_a_model_under_random_calls,
)


async def check_store_contract(new_store: Callable[[], IndexStore]) -> None:
    """Run every check, each on a new empty store."""
    for check in CHECKS:
        try:
            await check(new_store())
        except AssertionError as exc:
            raise AssertionError(f"{check.__name__}: {exc}") from exc
