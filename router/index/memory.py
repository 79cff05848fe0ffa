"""`MemoryStore`: the in-process index store (`router.index.contract.IndexStore`).

Everything lives in plain dicts of ints, bounded by an LRU cap on (block, worker) entries with
counted evictions. Each block's holders are one int: worker slot i owns the 4 bits at 4·i (its
tier bits), so a block costs no per-block dict, a batch of new blocks is inserted with
`dict.fromkeys`, and the garbage collector tracks nothing here (no collection pauses from a
million entries). Per (worker, fastest tier) entry counts are kept as entries change, so
`stats()` never walks the index.

A long conversation's next turn matches a chain whose history the worker already held at the
last match, or stored in a few `add` calls since: walking it block by block (a lookup and an
LRU move each) costs the request time in proportion to its history. So each worker's chained
runs are remembered (`add(chain=True)`: the stored run, or the run it extends when its parent
ends one (`after`): a prefill stored in steps and the blocks its decode fills make one run;
`match`: the run walked from a remembered one on, merged), by first key, with the worker's
change count when they were known held, and a few of their last keys (about 0, 1, 2, 4, ...
blocks before the end, one per power of two). A match meeting a
run's first key skips the run up to the last of those keys the chain shares (chained keys:
equal keys, equal prefixes), unless one of its blocks changed for that worker since (removed,
moved, a new tier, evicted: each change recorded per worker; when any was, the skip first
looks the run's keys up among them, one pass in C). Evictions alone are settled without that
pass: a run known held had all its blocks at the LRU order's recent end, F blocks before them,
and each eviction, removal or move since brought a block at most one place nearer the front;
fewer than F of those, and none of the run's blocks can have been evicted (under cap churn a
long history's next turn then costs no look-up per history block, and its run outlives the
change log's trim). The walk's LRU moves are
deferred to the next call that changes or reads the order (every write, `entries`), which
applies them in the order taken: the index holds and evicts exactly what per-block moves would
have left.

No method suspends: synchronous code (the trace replayer, tests, benches) drives the async
contract with `completed`.
"""

from __future__ import annotations

import heapq
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Coroutine, Iterable, Iterator, Sequence
from itertools import islice, repeat
from typing import Any, NamedTuple, TypeVar

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
_MIN_RUN = 4
"""Blocks a stored run needs to be remembered (shorter ones cost a walk no more than a skip)."""
_RUNS = 4096
"""Runs remembered per worker, least recently used dropped first."""
_LOG = 1 << 12
"""Changed keys kept per worker (`MemoryStore._changed_at`); past that the older half goes, with
the runs known held before the last change dropped that only the records could check (dropping
a run is always safe: the walk goes block by block). ~110 bytes per key: at 1 << 16, 32
churning workers held ~210 MiB of change records beside a 65k-entry index."""
_DEFERRED = 1 << 14
"""Keys whose LRU move may wait for the next write. A flush costs ~0.4 µs a key in a
million-entry index (measured: 262,144 moves 98 ms, 32,768 moves 17 ms): this bounds the stall
a stretch of matches without writes (no events) puts on the one match that flushes them."""


class _Run(NamedTuple):
    """A run of chained blocks a worker holds, remembered by its first key."""

    backs: array[int]
    """Blocks before the run's end of each of `marks`, ascending from 0, one per power of two."""
    marks: array[int]
    """The run's keys at those places: a chain sharing one shares the run up to there."""
    length: int
    stamp: int
    """The worker's change count when the run was last known held."""
    counts: tuple[int, ...]
    """Blocks per fastest tier index."""
    explicit: int
    """The worker's count of changes other than evictions, then."""
    reorders: int
    """The store's count of reorders (`MemoryStore._reorders`), then."""
    front: int
    """Blocks before all of the run's in the LRU order once its keys were last put at the
    recent end (inserted, or moved there by the match that checked it): with fewer reorders
    since than that, no block of the run was evicted."""


def _marks(keys: Sequence[int], start: int, end: int) -> tuple[array[int], array[int]]:
    """The backs 0, 1, 2, 4, ... of keys[start:end] and the keys there."""
    backs, marks, back = array("Q"), array("Q"), 0
    while back < end - start:
        backs.append(back)
        marks.append(keys[end - 1 - back])
        back = back * 2 or 1
    return backs, marks


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
        """Worker -> bit offset of its slot (4 · slot number), until it is dropped holding
        nothing."""
        self._workers: list[str] = []
        """Slot number -> worker."""
        self._free: list[int] = []
        """Offsets of dropped workers' slots (a heap): the next new worker takes the lowest, so
        workers coming and going under new names never widen the holders ints."""
        self._entries = 0
        self._evictions = 0
        # (worker, index of the fastest tier holding the block) -> entries, kept as entries change
        # so `stats()` (every /metrics scrape) never walks the index (1.2 s at a million entries).
        self._held: Counter[tuple[str, int]] = Counter()
        self._runs: dict[int, dict[int, _Run]] = {}
        """Slot offset -> first key -> the worker's remembered run from it (oldest used first)."""
        self._ends: dict[int, dict[int, int]] = {}
        """Slot offset -> last key -> first key of a run that ended there when it was remembered
        (checked against `_runs` on use; rebuilt from it past twice its bound)."""
        self._changed_at: dict[int, dict[int, int]] = {}
        """Slot offset -> key -> the number of the slot's last change to that key's entry
        (removed, moved, new tier, evicted), since its runs were last all dropped."""
        self._count: dict[int, int] = {}
        """Slot offset -> changes so far (a run's validity stamp)."""
        self._explicit: dict[int, int] = {}
        """Slot offset -> changes so far other than evictions."""
        self._floor: dict[int, int] = {}
        """Slot offset -> the number of the last change record dropped (`_trim`): a run known
        held before it can no longer be checked against the records."""
        self._reorders = 0
        """Blocks evicted, deleted or moved to the recent end so far: each brings any other block
        at most one place nearer the front of the LRU order."""
        self._deferred: list[Sequence[int]] = []
        """Matched runs whose LRU moves wait, in match order (`_flush`)."""
        self._deferred_keys = 0

    def _slot(self, worker: str) -> int:
        """The worker's slot offset, given the next free slot on first sight."""
        shift = self._shift.get(worker)
        if shift is None:
            if self._free:
                shift = heapq.heappop(self._free)
                self._workers[shift // _SLOT] = worker
            else:
                shift = _SLOT * len(self._workers)
                self._workers.append(worker)
            self._shift[worker] = shift
            self._runs[shift], self._changed_at[shift], self._count[shift] = {}, {}, 0
            self._explicit[shift], self._floor[shift] = 0, 0
            self._ends[shift] = {}
        return shift

    def _changed(self, shift: int, key: int, evicted: bool = False) -> None:
        """The slot's entry for `key` lost or changed a tier: runs holding it are stale."""
        changed_at = self._changed_at[shift]
        self._count[shift] += 1
        if not evicted:
            self._explicit[shift] += 1
        changed_at.pop(key, None)  # kept in the order of their last change
        changed_at[key] = self._count[shift]
        if len(changed_at) > _LOG:
            self._trim(shift)

    def _trim(self, shift: int) -> None:
        """Drop the older half of the slot's change records, and the runs known held before the
        last change dropped that only the records could check (a change since them was not an
        eviction): a run's check needs every change since it was known held, or its LRU bound.
        Under eviction churn the runs used recently (checked, so re-stamped) stay."""
        changed_at = self._changed_at[shift]
        old = list(islice(changed_at, len(changed_at) - _LOG // 2))
        floor = self._floor[shift] = changed_at[old[-1]]
        for key in old:
            del changed_at[key]
        runs, explicit = self._runs[shift], self._explicit[shift]
        for first in [f for f, r in runs.items() if r.stamp < floor and r.explicit != explicit]:
            del runs[first]

    def _forget_runs(self, shift: int) -> None:
        self._changed_at[shift].clear()
        self._runs[shift].clear()
        self._ends[shift].clear()

    def _remember(
        self, shift: int, keys: Sequence[int], start: int, end: int, counts: Sequence[int]
    ) -> None:
        """The slot holds keys[start:end] (chained), with `counts` blocks per fastest tier; the
        keys are at the LRU order's recent end, or moved there before the next write."""
        backs, marks = _marks(keys, start, end)
        run = self._known_held(shift, backs, marks, end - start, tuple(counts))
        self._keep(shift, keys[start], run)

    def _known_held(
        self, shift: int, backs: array[int], marks: array[int], length: int,
        counts: tuple[int, ...],
    ) -> _Run:
        """A run the slot holds now, its keys at the LRU order's recent end (or moved there
        before the next write): stamped with the counts its later checks start from."""
        return _Run(backs, marks, length, self._count[shift], counts, self._explicit[shift],
                    self._reorders, len(self._blocks) - length)

    def _keep(self, shift: int, first: int, run: _Run) -> None:
        """Remember `run` from `first` as the slot's most recently used run."""
        runs, ends = self._runs[shift], self._ends[shift]
        runs.pop(first, None)
        runs[first] = run
        if len(runs) > _RUNS:
            del runs[next(iter(runs))]
        ends[run.marks[0]] = first
        if len(ends) > 2 * _RUNS:
            self._ends[shift] = {r.marks[0]: f for f, r in runs.items()}

    def _extend(self, shift: int, after: int, keys: Sequence[int], counts: Sequence[int]) -> bool:
        """Extend the slot's run that ends at `after` by `keys` (chained from it, every one new
        to the slot), if one is remembered. The run keeps its stamp: a key of either part
        changed since then is found by the next skip's check, as for any run."""
        first = self._ends[shift].get(after)
        run = self._runs[shift].get(first) if first is not None else None
        if first is None or run is None or run.marks[0] != after:
            return False
        n = len(keys)
        backs, marks = _marks(keys, 0, n)
        taken = {b.bit_length() for b in backs}
        for back, mark in zip(run.backs, run.marks, strict=True):
            if (n + back).bit_length() not in taken:  # one back per power of two
                taken.add((n + back).bit_length())
                backs.append(n + back)
                marks.append(mark)
        total = tuple(a + b for a, b in zip(run.counts, counts, strict=True))
        # The new keys went in behind the run's older ones: its LRU bound holds for them too.
        self._keep(shift, first, run._replace(backs=backs, marks=marks, length=run.length + n,
                                              counts=total))
        return True

    def _flush(self) -> None:
        """Apply the deferred LRU moves of earlier matches, oldest first."""
        touch = self._blocks.move_to_end
        for keys in self._deferred:
            deque(map(touch, keys), maxlen=0)
        self._reorders += self._deferred_keys
        self._deferred.clear()
        self._deferred_keys = 0

    async def add(
        self, worker: str, tier: Tier, keys: Sequence[int], chain: bool = False,
        after: int | None = None,
    ) -> None:
        if self._deferred:
            self._flush()
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
                self._reorders += 1
                old = holders >> shift & _NIBBLE
                if not old:
                    fresh += 1
                elif old | bit != old:
                    self._retier(worker, old, old | bit)
                    self._changed(shift, key)
                blocks[key] = holders | bit << shift
        new = dict.fromkeys((k for k in keys if k not in known) if known else keys, bit << shift)
        blocks.update(new)
        fresh += len(new)
        self._entries += fresh
        self._held[(worker, _fastest(bit))] += fresh
        if chain and fresh == len(keys):  # every key new to the worker, on `tier`
            counts = [0] * len(_TIERS)
            counts[_fastest(bit)] = fresh
            extended = after is not None and self._extend(shift, after, keys, counts)
            if not extended and fresh >= _MIN_RUN:
                self._remember(shift, keys, 0, fresh, counts)
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
        self._changed(shift, key)
        rest = holders & ~(_NIBBLE << shift) | new << shift
        if rest:
            self._blocks[key] = rest
        else:
            del self._blocks[key]
            self._reorders += 1
        if not new:
            self._entries -= 1

    async def remove(self, worker: str, tier: Tier | None, keys: Sequence[int]) -> list[bool]:
        if self._deferred:
            self._flush()
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
        if self._deferred:
            self._flush()
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
        if self._deferred:
            self._flush()
        shift = self._shift.get(worker)
        if shift is None:
            return
        get = self._blocks.get
        for key in keys:
            holders = get(key, 0)
            old = holders >> shift & _NIBBLE
            if old:
                self._set(key, holders, shift, old, 0)
        self._forget_runs(shift)
        counts = [(worker, tier) for tier in range(len(_TIERS))]
        if not any(self._held[c] for c in counts):  # no block holds its slot's bits any more
            for c in counts:
                self._held.pop(c, None)
            del self._shift[worker]
            heapq.heappush(self._free, shift)

    def _enforce_cap(self) -> None:
        while self._entries > self.max_entries:
            key, holders = self._blocks.popitem(last=False)
            self._reorders += 1
            for worker, bits in self._holders(holders):
                self._changed(self._shift[worker], key, evicted=True)
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
        if self._deferred:
            self._flush()
        for key, holders in self._blocks.items():
            for worker, bits in self._holders(holders):
                yield key, worker, bits

    async def match(self, keys: Sequence[int], workers: Collection[str]) -> dict[str, WorkerMatch]:
        asked = set(workers)
        depth = dict.fromkeys(asked, 0)
        shifts = {w: self._shift[w] for w in asked if w in self._shift}
        live = sum(1 << s for s in shifts.values())  # lowest bit of each live worker's slot
        chain: list[int] = []  # holders of each matched block, in request order
        get, append = self._blocks.get, chain.append
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
            append(holders)
            if not live & (live - 1):
                break
        walked, more = len(chain), None
        if live and not live & (live - 1):  # one worker left (the deep part of most walks)
            walked, more = self._run(keys, chain, live.bit_length() - 1)
        for w, s in shifts.items():
            if live >> s & 1:
                depth[w] = walked
        if walked:  # the walked keys count as used: moved at the next write
            self._deferred.append(keys[:walked])
            self._deferred_keys += walked
            if self._deferred_keys > _DEFERRED:
                self._flush()
        out = {}
        for w, d in depth.items():
            by_tier = self._by_tier(chain, shifts[w], d) if d else {}
            if more is not None and d > len(chain):
                for i, n in enumerate(more):
                    if n:
                        by_tier[_TIERS[i]] = by_tier.get(_TIERS[i], 0) + n
            out[w] = WorkerMatch(d, by_tier)
        return out

    def _run(self, keys: Sequence[int], chain: list[int], shift: int) -> tuple[int, list[int]]:
        """Where the slot's run over `keys` ends, past `chain` (the blocks walked already), and
        its blocks past `chain` per fastest tier index. Remembered runs are skipped (whole, or
        up to where the chain leaves them); the rest goes in steps of `_STEP` keys, each looked
        up, masked and searched in C. A run walked from a remembered one on is remembered."""
        runs = self._runs[shift]
        counts = [0] * len(_TIERS)
        pos, first, before = len(chain), -1, counts
        for q in range(len(chain) - 1 if runs else -1, -1, -1):  # a run starting inside `chain`
            skip = self._skip(keys, q, shift)
            if skip is not None and q + skip[0] > pos:
                walked = self._tally(chain[q:], shift)
                counts = [a - b for a, b in zip(skip[1], walked, strict=True)]
                pos, first, before = q + skip[0], q, [-b for b in walked]
                break
        get, held = self._blocks.get, (_NIBBLE << shift).__and__
        starts = runs.__contains__
        while pos < len(keys):
            skip = self._skip(keys, pos, shift) if runs else None
            if skip is not None:
                if first < 0:
                    first, before = pos, list(counts)
                pos += skip[0]
                counts = [a + b for a, b in zip(counts, skip[1], strict=True)]
                continue
            part = keys[pos : pos + _STEP]
            if runs:  # stop where a remembered run starts
                try:
                    part = part[: list(map(starts, part[1:])).index(True) + 1]
                except ValueError:
                    pass
            holders = list(map(get, part, repeat(0, len(part))))
            try:
                end = list(map(held, holders)).index(0)
            except ValueError:
                end = len(part)
            counts = [a + b for a, b in zip(counts, self._tally(holders[:end], shift), strict=True)]
            pos += end
            if end < len(part):
                break
        if first >= 0:
            known = runs.get(keys[first])
            if known is None or pos - first > known.length:
                total = [a - b for a, b in zip(counts, before, strict=True)]
                self._remember(shift, keys, first, pos, total)
        return pos, counts

    def _skip(self, keys: Sequence[int], pos: int, shift: int) -> tuple[int, Sequence[int]] | None:
        """Blocks and their count per fastest tier index of the slot's remembered run starting
        at keys[pos], as far as the chain follows it (the run's tiers being one, else whole),
        if no entry of that part changed since it was known held (None otherwise)."""
        runs = self._runs[shift]
        run = runs.get(keys[pos])
        if run is None:
            return None
        length, stamp, counts = run.length, run.stamp, run.counts
        for back, mark in zip(run.backs, run.marks, strict=True):
            end = pos + length - back
            if end <= len(keys) and keys[end - 1] == mark:
                break
        else:
            return None
        if back and max(counts) != length:  # tiers mixed: only the whole run has known counts
            return None
        now = self._count[shift]
        if stamp != now and (  # evictions alone, none reaching the run: see `_Run.front`
            run.explicit != self._explicit[shift] or self._reorders - run.reorders >= run.front
        ):  # a membership pass over the run's keys, in C
            if stamp < self._floor[shift]:  # changes since it are no longer all recorded
                del runs[keys[pos]]
                return None
            changed_at = self._changed_at[shift]
            part = keys[pos:end]
            # Most runs hold no changed key at all: a set test, ~40 % cheaper than the lookups.
            if not changed_at.keys().isdisjoint(part) and (
                max(map(changed_at.get, part, repeat(0, end - pos))) > stamp
            ):
                if not back:
                    del runs[keys[pos]]
                return None
        if stamp != now and not back:  # checked whole: later checks start from now
            runs[keys[pos]] = self._known_held(shift, run.backs, run.marks, length, counts)
        if not back:
            return length, counts
        return end - pos, [n and end - pos for n in counts]

    @staticmethod
    def _tally(holders: Sequence[int], shift: int) -> list[int]:
        """Blocks per fastest tier index of the slot, over `holders` (all held by it)."""
        counts = [0] * len(_TIERS)
        for h, n in Counter(holders).items():  # few distinct values: count in C
            counts[_fastest(h >> shift & _NIBBLE)] += n
        return counts

    @staticmethod
    def _by_tier(chain: list[int], shift: int, depth: int) -> dict[Tier, int]:
        """Blocks per fastest tier holding them, over the worker's matched run."""
        counts = MemoryStore._tally(chain[:depth], shift)
        return {_TIERS[i]: n for i, n in enumerate(counts) if n}

    async def stats(self) -> IndexStats:
        by_worker: Counter[tuple[str, Tier]] = Counter(
            {(worker, _TIERS[tier]): n for (worker, tier), n in self._held.items() if n}
        )
        by_tier: Counter[Tier] = Counter()
        for (_, tier), n in by_worker.items():
            by_tier[tier] += n
        return IndexStats(self._entries, self._evictions, by_tier, Counter(), by_worker)
