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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

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
_SLOT = 4
"""Bits per worker in a block's holders int (`_occupied` folds exactly this many)."""
assert len(_TIERS) <= _SLOT, "a worker's tier bits must fit its slot"
_NIBBLE = (1 << _SLOT) - 1


def _occupied(holders: int) -> int:
    """The lowest bit of each worker slot that holds any tier bit."""
    return holders | holders >> 1 | holders >> 2 | holders >> 3


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
    """In-process index with an LRU cap on (block, worker) entries.

    Each block's holders are one int: worker slot i owns the 4 bits at 4·i (its tier bits), so
    a block costs no per-block dict, a batch of new blocks is inserted with `dict.fromkeys`, and
    the garbage collector tracks nothing here (no collection pauses from a million entries).
    """

    def __init__(self, model: str, max_entries: int = 4_000_000) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.model = model
        self.max_entries = max_entries
        # canonical key -> holders (tier bits per worker slot); order = recency (oldest first).
        self._blocks: OrderedDict[int, int] = OrderedDict()
        # worker -> engine hash -> canonical key (the namespace is folded into the key's chain).
        self._engine: dict[str, dict[int, int]] = {}
        self._shift: dict[str, int] = {}
        """Worker -> bit offset of its slot (4 · slot number), kept for the process's life."""
        self._workers: list[str] = []
        """Slot number -> worker."""
        self._entries = 0
        self._evictions = 0
        self._skipped: Counter[str] = Counter()
        # (worker, index of the fastest tier holding the block) -> entries, kept as entries change
        # so `stats()` (every /metrics scrape) never walks the index (1.2 s at a million entries).
        self._held: Counter[tuple[str, int]] = Counter()

    def apply(self, worker: str, events: Iterable[Event]) -> None:
        hashes = self._engine.setdefault(worker, {})
        shift = self._shift.get(worker)
        if shift is None:
            shift = self._shift[worker] = _SLOT * len(self._workers)
            self._workers.append(worker)
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(worker, shift, hashes, ev)
            elif isinstance(ev, BlockRemoved):
                self._clear_bits(shift, hashes, ev.block_hashes, _BIT[ev.tier])
            elif isinstance(ev, TierMoved):
                self._moved(shift, hashes, ev)
            elif isinstance(ev, AllCleared):
                bits = _ALL_TIERS if ev.tier is None else _BIT[ev.tier]
                self._clear_bits(shift, hashes, list(hashes), bits)
        self._enforce_cap()

    def _stored(self, worker: str, shift: int, hashes: dict[int, int], ev: BlockStored) -> None:
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
                old = holders >> shift & _NIBBLE
                if not old:
                    fresh += 1
                elif old | bit != old:
                    self._retier(worker, old, old | bit)
                blocks[key] = holders | bit << shift
        new = dict.fromkeys((k for k in keys if k not in known) if known else keys, bit << shift)
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

    def _set(self, key: int, holders: int, shift: int, old: int, new: int) -> None:
        """Replace one worker's tier bits `old` by `new` in a block's holders (0: it left)."""
        self._retier(self._workers[shift // _SLOT], old, new)
        rest = holders & ~(_NIBBLE << shift) | new << shift
        if rest:
            self._blocks[key] = rest
        else:
            del self._blocks[key]
        if not new:
            self._entries -= 1

    def _clear_bits(
        self, shift: int, hashes: dict[int, int], engine_hashes: list[int], bits: int
    ) -> None:
        blocks = self._blocks
        for engine_hash in engine_hashes:
            key = hashes.get(engine_hash)
            if key is None:
                self._skipped["unknown_block"] += 1
                continue
            holders = blocks.get(key, 0)
            old = holders >> shift & _NIBBLE
            left = old & ~bits
            if not left:
                del hashes[engine_hash]
            if left != old:
                self._set(key, holders, shift, old, left)

    def _moved(self, shift: int, hashes: dict[int, int], ev: TierMoved) -> None:
        for engine_hash in ev.block_hashes:
            key = hashes.get(engine_hash)
            holders = self._blocks.get(key, 0) if key is not None else 0
            old = holders >> shift & _NIBBLE
            if key is None or not old:
                self._skipped["unknown_block"] += 1
                continue
            new = (old & ~_BIT[ev.src]) | _BIT[ev.dst]
            if new != old:
                self._set(key, holders, shift, old, new)

    def _enforce_cap(self) -> None:
        while self._entries > self.max_entries:
            _, holders = self._blocks.popitem(last=False)
            for worker, bits in self._holders(holders):
                self._held[(worker, _fastest(bits))] -= 1
                self._entries -= 1
                self._evictions += 1
            # The engine-hash maps keep their entries: a later BlockRemoved for them is a no-op,
            # and a child block stored later can still chain from them.

    def _holders(self, holders: int) -> Iterator[tuple[str, int]]:
        """(worker, tier bits) of each worker in a block's holders."""
        while holders:
            slot = ((holders & -holders).bit_length() - 1) // _SLOT
            yield self._workers[slot], holders >> _SLOT * slot & _NIBBLE
            holders &= ~(_NIBBLE << _SLOT * slot)

    def entries(self) -> Iterator[tuple[int, str, int]]:
        """Every (canonical key, worker, tier bits) entry, oldest block first (a full walk: for
        tests and debugging, not for metrics)."""
        for key, holders in self._blocks.items():
            for worker, bits in self._holders(holders):
                yield key, worker, bits

    def drop_worker(self, worker: str) -> None:
        hashes = self._engine.pop(worker, {})
        shift = self._shift.get(worker, 0)
        for key in hashes.values():
            holders = self._blocks.get(key, 0)
            old = holders >> shift & _NIBBLE
            if old:
                self._set(key, holders, shift, old, 0)

    def match(
        self, keys: Sequence[int], workers: Iterable[str] | None = None
    ) -> dict[str, WorkerMatch]:
        asked = set(self._engine if workers is None else workers)
        depth = dict.fromkeys(asked, 0)
        shifts = {w: self._shift[w] for w in asked if w in self._shift}
        live = sum(1 << s for s in shifts.values())  # lowest bit of each live worker's slot
        chain: list[int] = []  # holders of each matched block, in request order
        get, touch, append = self._blocks.get, self._blocks.move_to_end, chain.append
        it = iter(keys if live else ())
        for key in it:
            holders = get(key, 0)
            present = _occupied(holders) & live
            if present != live:  # someone's run ends here (everyone's, at a block nobody holds)
                for w, s in shifts.items():
                    if (live & ~present) >> s & 1:
                        depth[w] = len(chain)
                live = present
                if not live:
                    break
            touch(key)
            append(holders)
            if not live & (live - 1):
                break
        if live and not live & (live - 1):  # one worker left (the deep part of most walks)
            slot = _NIBBLE << live.bit_length() - 1
            for key in it:
                holders = get(key, 0)
                if not holders & slot:
                    break
                touch(key)
                append(holders)
        for w, s in shifts.items():
            if live >> s & 1:
                depth[w] = len(chain)
        return {
            w: WorkerMatch(d, self._by_tier(chain, shifts[w], d) if d else {})
            for w, d in depth.items()
        }

    @staticmethod
    def _by_tier(chain: list[int], shift: int, depth: int) -> dict[Tier, int]:
        """Blocks per fastest tier holding them, over the worker's matched run."""
        by_tier: dict[Tier, int] = {}
        for holders, n in Counter(chain[:depth]).items():  # few distinct values: count in C
            tier = _TIERS[_fastest(holders >> shift & _NIBBLE)]
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
