"""The index store contract: what every backend that keeps "which worker holds which block, on
which tier" implements.

The prefix index has two parts. Ingestion (`router.index.ingest`, one for every backend) reads
each worker's decoded state events, recomputes canonical block keys from their token ids and
keeps the engine-hash → key maps; it calls a store through this contract. A store keeps, per
canonical key, the workers that hold the block and on which tiers. A store sees canonical keys
(ints from `warply.protocol.keys`), worker names and `Tier`s only: never engine hashes, tokens
or events. `router.index.memory.MemoryStore` is the in-process store; a store on the network
(Redis / Valkey, shared by several router replicas) implements the same class.

The primitives, by caller:

    Ingestion: one worker's state stream, in stream order (`IndexFeed` → `Ingest.apply`).
        add()         - a worker stored blocks on a tier.
        remove()      - blocks left one tier of a worker, or all of its tiers.
        move()        - a worker moved blocks from one tier to another.
        drop_worker() - forget everything a worker holds (a stream gap that could not be
                        recovered, or a publisher restart: the stream rebuilds it).
        mark()        - the last batch of a worker's stream that was applied (optional).
    Start-up: once per worker stream, before its history is taken (`StateSubscriber`).
        marked()      - that batch, as an earlier router process left it (optional).
    Placement: once per pool per request, on the request's path (`Placement.choose`).
        match()       - per worker, the leading run of a key chain it holds, by tier.
    Metrics: on every /metrics scrape and /warply/cache_stats call.
        stats()       - entries by worker and tier, evictions.

Terms used below:
    entry         - one (key, worker) pair: the worker holds the block on at least one tier.
                    A worker may hold a block on several tiers at once (GPU and a CPU copy).
    fastest tier  - of an entry's tiers, the first in `Tier` order (gpu, cpu, ssd,
                    object_store). Per-tier counts (match, stats) count each entry once,
                    under its fastest tier.

Guarantees every store gives:
    Coroutines. Every method is `async` so a network store can wait on its server. A store that
        never suspends (the memory store) lets synchronous code drive it with
        `router.index.memory.completed`.
    Order. Ingestion awaits each call before it makes the next one for the same worker, so one
        worker's calls arrive in stream order and never overlap; calls for different workers
        and match / stats calls may interleave with them. One batch of events becomes several
        calls: over a store that suspends, a match may see part of a batch applied.
    Atomicity. A reader (match, stats) sees each add / remove / move / drop_worker call wholly
        or not at all. The memory store gets this from never suspending; a network store from
        doing each call in one server-side step (a transaction or a script).
    Bounds. A store may hold fewer entries than it was given: it may drop entries to stay
        within its bound (a cap, an LRU, a TTL), counting each dropped entry in
        `IndexStats.evictions`. Removing or moving an entry the store does not hold (never
        added, evicted, already removed) changes nothing and is not an error.
    Recency. add and match count as a use of the blocks they touch (an LRU store refreshes
        them); remove, move and stats do not.
    Failure. A store on the network raises `StoreUnavailable` when its server cannot answer
        (refused, timed out); the call may or may not have been applied. The memory store
        never raises it.
"""

from __future__ import annotations

import abc
import re
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from warply.protocol import Tier


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
    """Events ingestion could not apply, by reason (`unknown_parent`, `unknown_block`); a store
    leaves this empty (ingestion fills it in `PrefixIndex.stats`)."""
    entries_by_worker_tier: Counter[tuple[str, Tier]] = field(default_factory=Counter)
    """Entries per (worker, fastest tier holding the block): bytes cached per pool and tier."""
    store_failures: Counter[str] = field(default_factory=Counter)
    """Calls a network store failed, by operation (`match`, `apply`, ...); a store leaves this
    empty (`PrefixIndex.stats` fills it)."""
    overpredicted: Counter[str] = field(default_factory=Counter)
    """Blocks per worker the index credited that its engine then reported not cached
    (`PrefixIndex.overpredicted`); a store leaves this empty."""


class StoreUnavailable(Exception):
    """A network store's server did not answer; the message names the store and the cause."""


def shown_url(url: str) -> str:
    """A store's URL as messages and logs show it: what precedes `@` (a user and password, as in
    `redis://:secret@host`) replaced by `***`."""
    return re.sub(r"//[^@/]*@", "//***@", url)


class IndexStore(abc.ABC):
    """Canonical block key → the workers holding it, per tier. See the module docstring for
    the terms and the guarantees every method keeps."""

    @abc.abstractmethod
    async def add(
        self, worker: str, tier: Tier, keys: Sequence[int], chain: bool = False,
        after: int | None = None,
    ) -> None:
        """
        Record that `worker` now holds each of `keys` on `tier`.

        Called by ingestion once per `BlockStored` event whose keys it could compute.

        Args:
            worker: the worker's name (as configured in the router).
            tier: the tier the blocks were stored on.
            keys: canonical keys of the stored blocks, in chain order (parent first). A key the
                worker already holds on other tiers gains `tier`; a key it already holds on
                `tier` is unchanged. Keys may repeat.
            chain: the keys are consecutive blocks of one chain (`warply.protocol.chain_keys`,
                as ingestion computes them): each commits to every block before it, so a store
                may remember the run and let a later `match` of a chain through its first and
                last key take it whole (the memory store does). Ignoring it is allowed.
            after: with `chain`, the canonical key of the block `keys[0]` chains from (its
                parent), when known: a store may extend a remembered run of the worker that
                ends there, so that a prefill stored in steps, and the blocks its decode fills
                one by one, are taken whole by one skip (the memory store does). Ignoring it
                is allowed.

        Effects:
            Each key counts as used (most recent first to survive a bound). A bounded store
            may evict entries at the end of the call (the oldest first, possibly some of these
            keys when the bound is smaller than the batch), counting them as evictions.
        """

    @abc.abstractmethod
    async def remove(self, worker: str, tier: Tier | None, keys: Sequence[int]) -> list[bool]:
        """
        Record that each of `keys` left `tier` of `worker` (every tier when `tier` is None).

        Called by ingestion for a `BlockRemoved` event (the keys of the engine hashes it knows)
        and for `AllCleared` (every key the worker's engine-hash map names).

        Args:
            worker: the worker's name.
            tier: the tier the blocks left, or None for all of them.
            keys: canonical keys, applied in order. Keys may repeat; a key the worker does not
                hold on `tier` is left as it is.

        Returns:
            One flag per key, in order: True when, after the call, the worker still holds the
            key on some tier. Ingestion forgets the engine hash of every key flagged False.

        Effects:
            An entry left with no tier is gone. Recency is not changed.
        """

    @abc.abstractmethod
    async def move(self, worker: str, src: Tier, dst: Tier, keys: Sequence[int]) -> int:
        """
        Record that `worker` moved each of `keys` from tier `src` to tier `dst`.

        Called by ingestion once per `TierMoved` event (the keys of the engine hashes it knows).

        Args:
            worker: the worker's name.
            src: the tier the blocks left (dropped from each entry if it was there).
            dst: the tier the blocks now sit on (added to each entry).
            keys: canonical keys, applied in order; keys may repeat.

        Returns:
            How many of `keys` the worker held on no tier: those are left absent (a move
            never creates an entry), and ingestion counts them as `unknown_block`.

        Effects:
            Recency is not changed.
        """

    @abc.abstractmethod
    async def drop_worker(self, worker: str, keys: Iterable[int]) -> None:
        """
        Forget every entry of `worker`.

        Called by ingestion when the worker's stream went stale (a gap the replay socket could
        not fill, or the publisher restarted); the stream then rebuilds what the worker holds.

        Args:
            worker: the worker's name.
            keys: every key ingestion has mapped for the worker since it was last dropped (a
                superset of the store's entries for it, since every entry came from an `add`
                for one of them). A store that indexes its entries by worker may ignore this;
                the memory store walks it instead of its whole key space.

        Effects:
            Afterwards `match` reports no block for the worker until the next `add`, and
            `marked` reports no batch for it until the next `mark`.
        """

    async def mark(self, worker: str, seq: int, ts: float) -> None:  # noqa: B027 - optional
        """
        Record that the batch `seq` of `worker`'s state stream, published at `ts`, is applied.

        Called by the router after each batch it applied. Only a store that outlives a router
        process needs it (a shared one): a router started later checks the mark against the
        publisher's history (`marked`), to tell a stream it can continue from one that
        restarted meanwhile, whose entries here are stale. The default keeps nothing.

        Effects:
            The newest mark by `ts` (then `seq`) is kept: replicas marking the same stream, or
            one taking the history a second time, never move it back.
        """

    async def marked(self, worker: str) -> tuple[int, float] | None:
        """
        The (seq, ts) of the newest batch `mark`ed for `worker` since its last `drop_worker`;
        None when there is none (the default: a store that keeps no marks).
        """
        return None

    @abc.abstractmethod
    async def match(self, keys: Sequence[int], workers: Collection[str]) -> dict[str, WorkerMatch]:
        """
        For each worker in `workers`, the leading run of `keys` it holds.

        Called by placement once per pool for each request, on the request's path: this is the
        call to keep fast (the memory store answers an 8k-token chain in tens of microseconds,
        and skips the runs it remembers: a conversation's history costs it a step or two).

        Args:
            keys: a request's key chain (`warply.protocol.prefix_keys`), first block first; a
                store may rely on its keys being chained (see `add`'s `chain`).
            workers: the candidate workers' names; names the store never saw are allowed.

        Returns:
            A dict with one `WorkerMatch` per worker in `workers`: `blocks` = how many keys,
            from keys[0] on, the worker holds on some tier (the run ends at the first key it
            does not hold, even when it holds later ones); `by_tier` = those blocks counted
            under their fastest tier (empty when `blocks` is 0).

        Effects:
            The keys walked count as used (the memory store walks a key while some candidate's
            run is still going). Nothing else changes.
        """

    @abc.abstractmethod
    async def stats(self) -> IndexStats:
        """
        The store's current size and lifetime counters.

        Called on every metrics read, so it must not walk the entries (keep counts as they
        change).

        Returns:
            A fresh `IndexStats` (the caller may keep or change it): `entries` (current
            entries), `evictions` (entries the store dropped on its own since it started),
            `entries_by_tier` and `entries_by_worker_tier` (entries under their fastest tier;
            zero counts left out). `skipped` is left empty: ingestion owns it.
        """

    async def close(self) -> None:  # noqa: B027 - optional: a store without connections
        """Release the store's connections (the router calls it at shutdown)."""
