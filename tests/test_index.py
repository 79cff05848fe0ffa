"""The router's prefix index: canonical keys from events, tiers, removals, caps, resync."""

from __future__ import annotations

import random
from collections import Counter

from router.index import MemoryIndex
from warply.protocol import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    Tier,
    TierMoved,
    prefix_keys,
)

MODEL = "m"
BS = 4


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


def test_match_follows_the_longest_cached_prefix_per_worker() -> None:
    idx = MemoryIndex(MODEL)
    prompt = list(range(40))
    idx.apply("a", [_stored(prompt[:16], 100, namespace="")])
    idx.apply("a", [_stored(prompt[16:24], 104, parent=103)])  # continues the chain
    idx.apply("b", [_stored(prompt[:8], 500)])
    m = idx.match(prefix_keys(prompt, BS, MODEL))
    assert (m["a"].blocks, m["b"].blocks) == (6, 2)
    assert m["a"].by_tier == {Tier.GPU: 6}


def test_namespaces_never_share_blocks() -> None:
    idx = MemoryIndex(MODEL)
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
    idx = MemoryIndex(MODEL)
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
    idx = MemoryIndex(MODEL)
    idx.apply("a", [_stored(list(range(8)), 10, parent=999), BlockRemoved([12345])])
    assert idx.stats().skipped == {"unknown_parent": 2, "unknown_block": 1}
    assert idx.stats().entries == 0


def test_lru_cap_evicts_oldest_blocks_and_counts_them() -> None:
    idx = MemoryIndex(MODEL, max_entries=8)
    old, new = list(range(16)), list(range(100, 132))
    idx.apply("a", [_stored(old, 1)])
    idx.apply("b", [_stored(new, 50)])
    stats = idx.stats()
    assert stats.entries == 8 and stats.evictions == 4
    assert idx.match(prefix_keys(old, BS, MODEL))["a"].blocks == 0
    assert idx.match(prefix_keys(new, BS, MODEL))["b"].blocks == 8


def test_drop_worker_forgets_only_that_worker() -> None:
    idx = MemoryIndex(MODEL)
    prompt = list(range(16))
    idx.apply("a", [_stored(prompt, 1)])
    idx.apply("b", [_stored(prompt, 7)])
    idx.drop_worker("a")
    m = idx.match(prefix_keys(prompt, BS, MODEL))
    assert "a" not in m and m["b"].blocks == 4 and idx.stats().entries == 4


def test_stats_counts_stay_equal_to_a_full_walk_under_random_events() -> None:
    rng = random.Random(4)
    idx = MemoryIndex(MODEL, max_entries=60)
    tiers = list(Tier)
    next_hash = 1
    stored: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for _ in range(400):
        worker = rng.choice(list(stored))
        op = rng.random()
        if op < 0.5 or not stored[worker]:
            n = rng.randint(1, 4)
            tokens = [rng.randrange(3) for _ in range(n * BS)]  # few values: shared blocks
            idx.apply(worker, [_stored(tokens, next_hash, tier=rng.choice(tiers))])
            stored[worker] += range(next_hash, next_hash + n)
            next_hash += n
        elif op < 0.7:
            idx.apply(worker, [BlockRemoved(rng.sample(stored[worker], 1), rng.choice(tiers))])
        elif op < 0.85:
            src, dst = rng.sample(tiers, 2)
            idx.apply(worker, [TierMoved(rng.sample(stored[worker], 1), src, dst)])
        elif op < 0.95:
            idx.apply(worker, [AllCleared(rng.choice([None, *tiers]))])
        else:
            idx.drop_worker(worker)
            stored[worker] = []
        walked: Counter[tuple[str, Tier]] = Counter()
        for _, w, bits in idx.entries():
            walked[(w, list(Tier)[(bits & -bits).bit_length() - 1])] += 1
        stats = idx.stats()
        assert stats.entries_by_worker_tier == walked
        assert stats.entries == sum(walked.values()) <= 60


def test_a_run_ends_at_a_missing_block_even_for_one_candidate() -> None:
    idx = MemoryIndex(MODEL, max_entries=7)
    prompt = list(range(32))
    idx.apply("a", [_stored(prompt, 1)])  # 8 blocks, cap 7: the chain's first one is evicted
    keys = prefix_keys(prompt, BS, MODEL)
    assert idx.match(keys, ["a"])["a"].blocks == 0
    assert idx.match(keys[1:], ["a"])["a"].blocks == 7


def test_many_workers_share_blocks() -> None:
    idx = MemoryIndex(MODEL)
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
