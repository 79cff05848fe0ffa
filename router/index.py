"""Global prefix index: which worker holds which canonical block, on which tier.

Fed by decoded state streams (Warply plugins or stock vLLM / SGLang KV events). Engine block
hashes are seeded differently per engine, so the index rebuilds each block's canonical key from
the token ids a `BlockStored` carries (`warply.protocol.keys`), chaining from the parent's key,
and keeps per-worker `engine hash -> key` maps to resolve later removals.

`PrefixIndex` is the small interface the router and the trace replayer use; `MemoryIndex` keeps
everything in process, bounded by an LRU cap on (block, worker) entries with counted evictions.
A shared backend for several router replicas implements the same interface.
"""

from __future__ import annotations

import abc
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from warply.protocol import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Tier,
    TierMoved,
    chain_keys,
    root_seed,
)

_TIERS = tuple(Tier)
_BIT = {tier: 1 << i for i, tier in enumerate(_TIERS)}
_ALL_TIERS = (1 << len(_TIERS)) - 1


def _fastest(bits: int) -> int:
    """Index in `_TIERS` of the fastest tier among `bits` (lowest set bit)."""
    return (bits & -bits).bit_length() - 1


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    """How much of a request's key chain one worker holds, from the first block on."""

    blocks: int
    """Leading blocks held on any tier."""
    by_tier: dict[Tier, int]
    """How many of those leading blocks sit on each tier (fastest tier that holds the block)."""


@dataclass(slots=True)
class IndexStats:
    """Counters for metrics: what the index holds and what it refused."""

    entries: int = 0
    evictions: int = 0
    entries_by_tier: Counter[Tier] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    entries_by_worker_tier: Counter[tuple[str, Tier]] = field(default_factory=Counter)
    """Entries per (worker, fastest tier holding the block): bytes cached per pool and tier."""


class PrefixIndex(abc.ABC):
    """Where cached prefixes live, per worker and tier."""

    @abc.abstractmethod
    def apply(self, worker: str, events: Iterable[Event]) -> None:
        """Apply one worker's state events, in stream order."""

    @abc.abstractmethod
    def drop_worker(self, worker: str) -> None:
        """Forget everything a worker holds (stream gap it could not recover, or worker gone)."""

    @abc.abstractmethod
    def match(
        self, keys: Sequence[int], workers: Iterable[str] | None = None
    ) -> dict[str, WorkerMatch]:
        """Per worker (all, or the given ones), the leading run of `keys` it holds."""

    @abc.abstractmethod
    def stats(self) -> IndexStats:
        """Current size and lifetime counters."""


class MemoryIndex(PrefixIndex):
    """In-process index with an LRU cap on (block, worker) entries."""

    def __init__(self, model: str, max_entries: int = 4_000_000) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.model = model
        self.max_entries = max_entries
        # canonical key -> {worker: tier bits}; order = recency (oldest first).
        self._blocks: OrderedDict[int, dict[str, int]] = OrderedDict()
        # worker -> engine hash -> canonical key (the namespace is folded into the key's chain).
        # Only ints in these maps and in `_blocks`' holder dicts: the garbage collector does not
        # track such dicts, so a million entries add no GC pauses to the router's event loop.
        self._engine: dict[str, dict[int, int]] = {}
        self._entries = 0
        self._evictions = 0
        self._skipped: Counter[str] = Counter()
        # (worker, index of the fastest tier holding the block) -> entries, kept as entries change
        # so `stats()` (every /metrics scrape) never walks the index (1.2 s at a million entries).
        self._held: Counter[tuple[str, int]] = Counter()

    def apply(self, worker: str, events: Iterable[Event]) -> None:
        hashes = self._engine.setdefault(worker, {})
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(worker, hashes, ev)
            elif isinstance(ev, BlockRemoved):
                self._clear_bits(worker, hashes, ev.block_hashes, _BIT[ev.tier])
            elif isinstance(ev, TierMoved):
                self._moved(worker, hashes, ev)
            elif isinstance(ev, AllCleared):
                bits = _ALL_TIERS if ev.tier is None else _BIT[ev.tier]
                self._clear_bits(worker, hashes, list(hashes), bits)
        self._enforce_cap()

    def _stored(self, worker: str, hashes: dict[int, int], ev: BlockStored) -> None:
        if ev.parent_hash is None:
            seed = root_seed(self.model, ev.namespace or "")
        else:
            parent = hashes.get(ev.parent_hash)
            if parent is None:
                # The parent was stored before we subscribed or was dropped: the prefix these
                # tokens extend is unknown, so no canonical key can be computed.
                self._skipped["unknown_parent"] += len(ev.block_hashes)
                return
            seed = parent
        keys = chain_keys(ev.token_ids, ev.block_size, seed)  # one per hash: BlockStored checks
        hashes.update(zip(ev.block_hashes, keys, strict=True))
        bit = _BIT[ev.tier]
        blocks = self._blocks
        known = blocks.keys() & keys  # usually empty: a stored block is new to the index
        fresh = 0
        if known:
            for key in keys:
                if key not in known:
                    continue
                holders = blocks[key]
                blocks.move_to_end(key)
                old = holders.get(worker, 0)
                if not old:
                    fresh += 1
                elif old | bit != old:
                    self._retier(worker, old, old | bit)
                holders[worker] = old | bit
        new = {key: {worker: bit} for key in keys if key not in known}
        blocks.update(new)
        fresh += len(new)
        self._entries += fresh
        self._held[(worker, _fastest(bit))] += fresh

    def _retier(self, worker: str, old: int, new: int) -> None:
        """Move one entry's count from its old fastest tier to its new one (0 bits: absent)."""
        if old:
            self._held[(worker, _fastest(old))] -= 1
        if new:
            self._held[(worker, _fastest(new))] += 1

    def _clear_bits(
        self, worker: str, hashes: dict[int, int], engine_hashes: list[int], bits: int
    ) -> None:
        for engine_hash in engine_hashes:
            key = hashes.get(engine_hash)
            if key is None:
                self._skipped["unknown_block"] += 1
                continue
            holders = self._blocks.get(key)
            old = holders.get(worker, 0) if holders else 0
            left = old & ~bits
            if left:
                if left != old:
                    self._retier(worker, old, left)
                holders[worker] = left  # type: ignore[index]
                continue
            del hashes[engine_hash]
            if holders and worker in holders:
                self._retier(worker, holders.pop(worker), 0)
                self._entries -= 1
                if not holders:
                    del self._blocks[key]

    def _moved(self, worker: str, hashes: dict[int, int], ev: TierMoved) -> None:
        for engine_hash in ev.block_hashes:
            key = hashes.get(engine_hash)
            holders = self._blocks.get(key) if key is not None else None
            if not holders or worker not in holders:
                self._skipped["unknown_block"] += 1
                continue
            old = holders[worker]
            new = (old & ~_BIT[ev.src]) | _BIT[ev.dst]
            if new != old:
                self._retier(worker, old, new)
            holders[worker] = new

    def _enforce_cap(self) -> None:
        while self._entries > self.max_entries:
            key, holders = self._blocks.popitem(last=False)
            self._entries -= len(holders)
            self._evictions += len(holders)
            for worker, bits in holders.items():
                self._held[(worker, _fastest(bits))] -= 1
            # The engine-hash maps keep their entries: a later BlockRemoved for them is a no-op,
            # and a child block stored later can still chain from them.

    def drop_worker(self, worker: str) -> None:
        hashes = self._engine.pop(worker, {})
        for key in hashes.values():
            holders = self._blocks.get(key)
            bits = holders.pop(worker, None) if holders else None
            if bits is not None:
                self._retier(worker, bits, 0)
                self._entries -= 1
                if not holders:
                    del self._blocks[key]

    def match(
        self, keys: Sequence[int], workers: Iterable[str] | None = None
    ) -> dict[str, WorkerMatch]:
        live = set(self._engine if workers is None else workers)
        if not live:
            return {}
        depth = dict.fromkeys(live, 0)
        chain: list[dict[str, int]] = []  # holders of each matched block, in request order
        get, touch, append = self._blocks.get, self._blocks.move_to_end, chain.append
        it = iter(keys)
        for key in it:
            holders = get(key)
            if holders is None:
                break
            if not live <= holders.keys():  # someone drops out here (rare: check before narrowing)
                still = live & holders.keys()
                for w in live - still:
                    depth[w] = len(chain)
                live = still
                if not live:
                    break
            touch(key)
            append(holders)
            if len(live) == 1:
                break
        if len(live) == 1:  # one worker left (the deep part of most walks): a plain lookup loop
            (only,) = live
            for key in it:
                holders = get(key)
                if holders is None or only not in holders:
                    break
                touch(key)
                append(holders)
        for w in live:
            depth[w] = len(chain)
        return {w: WorkerMatch(d, self._by_tier(chain, w, d)) for w, d in depth.items()}

    @staticmethod
    def _by_tier(chain: list[dict[str, int]], worker: str, depth: int) -> dict[Tier, int]:
        """Blocks per fastest tier holding them, over the worker's matched run."""
        by_tier: dict[Tier, int] = {}
        if not depth:
            return by_tier
        for bits, n in Counter(map(itemgetter(worker), chain[:depth])).items():
            tier = _TIERS[_fastest(bits)]
            by_tier[tier] = by_tier.get(tier, 0) + n
        return by_tier

    def stats(self) -> IndexStats:
        by_worker: Counter[tuple[str, Tier]] = Counter(
            {(worker, _TIERS[tier]): n for (worker, tier), n in self._held.items() if n}
        )
        by_tier: Counter[Tier] = Counter()
        for (_, tier), n in by_worker.items():
            by_tier[tier] += n
        return IndexStats(
            self._entries, self._evictions, by_tier, Counter(self._skipped), by_worker
        )
