"""`MemoryStore`: the in-process index store (`router.index.contract.IndexStore`).

Everything lives in plain dicts of ints, bounded by an LRU cap on (block, worker) entries with
counted evictions. Each block's holders are one int: worker slot i owns the 4 bits at 4·i (its
tier bits), so a block costs no per-block dict, a batch of new blocks is inserted with
`dict.fromkeys`, and the garbage collector tracks nothing here (no collection pauses from a
million entries). Per (worker, fastest tier) entry counts are kept as entries change, so
`stats()` never walks the index.

No method suspends: synchronous code (the trace replayer, tests, benches) drives the async
contract with `completed`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Coroutine, Iterable, Iterator, Sequence
from itertools import repeat
from typing import Any, TypeVar

from router.index.contract import IndexStats, IndexStore, WorkerMatch
from warply.protocol import Tier

_T = TypeVar("_T")

_TIERS = tuple(Tier)
_BIT = {tier: 1 << i for i, tier in enumerate(_TIERS)}
_ALL_TIERS = (1 << len(_TIERS)) - 1
_SLOT = 4
"""Bits per worker in a block's holders int (`_occupied` folds exactly this many)."""
assert len(_TIERS) <= _SLOT, "a worker's tier bits must fit its slot"
_NIBBLE = (1 << _SLOT) - 1
_STEP = 512
"""Keys per step of a one-worker walk (`MemoryStore._run`)."""


def completed(coro: Coroutine[Any, Any, _T]) -> _T:
    """The result of a coroutine that finishes without suspending, run without an event loop.

    Every coroutine of `MemoryStore`, and of ingestion and `PrefixIndex` over it, is one: this
    costs one `send`. Raises RuntimeError if the coroutine suspends (a network store: run it in
    an event loop instead)."""
    try:
        coro.send(None)
    except StopIteration as done:
        result: _T = done.value
        return result
    coro.close()
    raise RuntimeError("the coroutine suspended: await it in an event loop")


def _occupied(holders: int) -> int:
    """The lowest bit of each worker slot that holds any tier bit."""
    return holders | holders >> 1 | holders >> 2 | holders >> 3


def _fastest(bits: int) -> int:
    """Index in `_TIERS` of the fastest tier among `bits` (lowest set bit)."""
    return (bits & -bits).bit_length() - 1


class MemoryStore(IndexStore):
    """In-process store with an LRU cap on (block, worker) entries."""

    def __init__(self, max_entries: int = 4_000_000) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        # canonical key -> holders (tier bits per worker slot); order = recency (oldest first).
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._shift: dict[str, int] = {}
        """Worker -> bit offset of its slot (4 · slot number), kept for the process's life."""
        self._workers: list[str] = []
        """Slot number -> worker."""
        self._entries = 0
        self._evictions = 0
        # (worker, index of the fastest tier holding the block) -> entries, kept as entries change
        # so `stats()` (every /metrics scrape) never walks the index (1.2 s at a million entries).
        self._held: Counter[tuple[str, int]] = Counter()

    def _slot(self, worker: str) -> int:
        """The worker's slot offset, given the next free slot on first sight."""
        shift = self._shift.get(worker)
        if shift is None:
            shift = self._shift[worker] = _SLOT * len(self._workers)
            self._workers.append(worker)
        return shift

    async def add(self, worker: str, tier: Tier, keys: Sequence[int]) -> None:
        shift = self._shift.get(worker)
        if shift is None:
            shift = self._slot(worker)
        bit = _BIT[tier]
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
        if self._entries > self.max_entries:
            self._enforce_cap()

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

    async def remove(self, worker: str, tier: Tier | None, keys: Sequence[int]) -> list[bool]:
        shift = self._shift.get(worker)
        if shift is None:
            return [False] * len(keys)
        bits = _ALL_TIERS if tier is None else _BIT[tier]
        get = self._blocks.get
        held: list[bool] = []
        for key in keys:
            holders = get(key, 0)
            old = holders >> shift & _NIBBLE
            left = old & ~bits
            if left != old:
                self._set(key, holders, shift, old, left)
            held.append(left != 0)
        return held

    async def move(self, worker: str, src: Tier, dst: Tier, keys: Sequence[int]) -> int:
        shift = self._shift.get(worker)
        if shift is None:
            return len(keys)
        keep, bit = ~_BIT[src], _BIT[dst]
        get = self._blocks.get
        absent = 0
        for key in keys:
            holders = get(key, 0)
            old = holders >> shift & _NIBBLE
            if not old:
                absent += 1
                continue
            new = (old & keep) | bit
            if new != old:
                self._set(key, holders, shift, old, new)
        return absent

    async def drop_worker(self, worker: str, keys: Iterable[int]) -> None:
        shift = self._shift.get(worker)
        if shift is None:
            return
        get = self._blocks.get
        for key in keys:
            holders = get(key, 0)
            old = holders >> shift & _NIBBLE
            if old:
                self._set(key, holders, shift, old, 0)

    def _enforce_cap(self) -> None:
        while self._entries > self.max_entries:
            _, holders = self._blocks.popitem(last=False)
            for worker, bits in self._holders(holders):
                self._held[(worker, _fastest(bits))] -= 1
                self._entries -= 1
                self._evictions += 1

    def _holders(self, holders: int) -> Iterator[tuple[str, int]]:
        """(worker, tier bits) of each worker in a block's holders."""
        while holders:
            slot = ((holders & -holders).bit_length() - 1) // _SLOT
            yield self._workers[slot], holders >> _SLOT * slot & _NIBBLE
            holders &= ~(_NIBBLE << _SLOT * slot)

    def entries(self) -> Iterator[tuple[int, str, int]]:
        """Every (canonical key, worker, tier bits) entry, oldest block first (a full walk: for
        tests and debugging, not for metrics). Bit i of the tier bits is `tuple(Tier)[i]`."""
        for key, holders in self._blocks.items():
            for worker, bits in self._holders(holders):
                yield key, worker, bits

    async def match(self, keys: Sequence[int], workers: Collection[str]) -> dict[str, WorkerMatch]:
        asked = set(workers)
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
            self._run(keys, chain, _NIBBLE << live.bit_length() - 1)
        for w, s in shifts.items():
            if live >> s & 1:
                depth[w] = len(chain)
        return {
            w: WorkerMatch(d, self._by_tier(chain, shifts[w], d) if d else {})
            for w, d in depth.items()
        }

    def _run(self, keys: Sequence[int], chain: list[int], slot: int) -> None:
        """Extend `chain` over the run of `keys` past it held in `slot`, touching each block:
        in steps of `_STEP` keys, each looked up, masked and searched in C (a long
        conversation's prompt walks thousands of blocks here)."""
        get, touch, held = self._blocks.get, self._blocks.move_to_end, slot.__and__
        start = len(chain)
        while start < len(keys):
            part = keys[start : start + _STEP]
            holders = list(map(get, part, repeat(0, len(part))))
            try:
                end = list(map(held, holders)).index(0)
            except ValueError:
                end = len(part)
            chain += holders[:end]
            deque(map(touch, part[:end]), maxlen=0)
            if end < len(part):
                return
            start += end

    @staticmethod
    def _by_tier(chain: list[int], shift: int, depth: int) -> dict[Tier, int]:
        """Blocks per fastest tier holding them, over the worker's matched run."""
        by_tier: dict[Tier, int] = {}
        for holders, n in Counter(chain[:depth]).items():  # few distinct values: count in C
            tier = _TIERS[_fastest(holders >> shift & _NIBBLE)]
            by_tier[tier] = by_tier.get(tier, 0) + n
        return by_tier

    async def stats(self) -> IndexStats:
        by_worker: Counter[tuple[str, Tier]] = Counter(
            {(worker, _TIERS[tier]): n for (worker, tier), n in self._held.items() if n}
        )
        by_tier: Counter[Tier] = Counter()
        for (_, tier), n in by_worker.items():
            by_tier[tier] += n
        return IndexStats(self._entries, self._evictions, by_tier, Counter(), by_worker)
