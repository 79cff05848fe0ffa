"""Ingestion: each worker's decoded state events → canonical key chains → store calls.

Shared by every store. Engine block hashes are seeded differently per engine (and per vLLM
hash function), so ingestion rebuilds each stored block's canonical key from the token ids a
`BlockStored` carries (`warply.protocol.keys`), chaining from the parent's key, and keeps a
per-worker `engine hash -> canonical key` map to resolve later removals and tier moves. It knows
nothing of how a store keeps holders: it speaks only the `IndexStore` contract.

Events ingestion cannot apply are counted in `skipped`: `unknown_parent` (blocks whose parent
it never saw, so no key can be computed) and `unknown_block` (a removal or move of an engine
hash it has no key for, or a move of a block the worker no longer holds).

The maps are bounded: all workers' together hold at most `max_hashes` engine hashes (the
store's entry cap: it could not hold more blocks anyway). A worker whose map grows past its
share (`max_hashes` / workers) loses its oldest hashes, and their blocks leave the store too,
so the index never holds a block whose removal it could no longer apply (counted in `skipped`
as `hash_cap`). Without that, blocks the store's cap evicted, or whose removal was lost, kept
their map entries until the engine removed them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, KeysView, Sequence
from itertools import islice

from router.index.contract import IndexStore
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


class Ingest:
    """Turns one model's state streams into calls on one store."""

    def __init__(self, model: str, store: IndexStore, max_hashes: int = 4_000_000) -> None:
        self.model = model
        self.store = store
        self.max_hashes = max_hashes
        # worker -> engine hash -> canonical key (the namespace is folded into the key's chain),
        # oldest first. Entries whose block the store evicted stay while under the cap: a later
        # child block still chains from them, and a later removal drops them.
        self._engine: dict[str, dict[int, int]] = {}
        self.skipped: Counter[str] = Counter()

    def workers(self) -> KeysView[str]:
        """Workers whose stream has delivered a batch since they were last dropped."""
        return self._engine.keys()

    async def apply(self, worker: str, events: Iterable[Event]) -> None:
        """Apply one worker's state events, in stream order (each store call is awaited before
        the next one is made). Events that carry no cache state (`LoadSnapshot`) are ignored."""
        hashes = self._engine.setdefault(worker, {})
        store = self.store
        for ev in events:
            if isinstance(ev, BlockStored):
                chained = self._keys(hashes, ev)
                if chained is None:
                    continue
                keys, parent = chained
                if keys:
                    await store.add(worker, ev.tier, keys, chain=True, after=parent)
                    if len(hashes) > self.max_hashes // len(self._engine):
                        await self._shed(worker, hashes)
            elif isinstance(ev, BlockRemoved):
                await self._remove(worker, hashes, ev.block_hashes, ev.tier)
            elif isinstance(ev, TierMoved):
                keys = [k for h in ev.block_hashes if (k := hashes.get(h)) is not None]
                absent = await store.move(worker, ev.src, ev.dst, keys) if keys else 0
                if unknown := len(ev.block_hashes) - len(keys) + absent:
                    self.skipped["unknown_block"] += unknown
            elif isinstance(ev, AllCleared):
                await self._remove(worker, hashes, list(hashes), ev.tier)

    def _keys(self, hashes: dict[int, int], ev: BlockStored) -> tuple[list[int], int | None] | None:
        """The canonical keys of a stored event's blocks (recorded in the worker's map) and its
        parent's key (None for a root block), or None when its parent is unknown."""
        parent: int | None = None
        if ev.parent_hash is None:
            seed = root_seed(self.model, ev.namespace or "")
        else:
            parent = hashes.get(ev.parent_hash)
            if parent is None:
                # The parent was stored before we subscribed or was dropped: the prefix these
                # tokens extend is unknown, so no canonical key can be computed.
                self.skipped["unknown_parent"] += len(ev.block_hashes)
                return None
            seed = parent
        keys = chain_keys(ev.token_ids, ev.block_size, seed)  # one per hash: BlockStored checks
        hashes.update(zip(ev.block_hashes, keys, strict=True))
        return keys, parent

    def hashes(self) -> int:
        """Engine hashes held in all workers' maps."""
        return sum(len(h) for h in self._engine.values())

    async def _shed(self, worker: str, hashes: dict[int, int]) -> None:
        """Drop the worker's oldest hashes past its share of the cap, and their blocks."""
        excess = len(hashes) - max(1, self.max_hashes // len(self._engine))
        oldest = list(islice(hashes.items(), excess))
        for engine_hash, _ in oldest:
            del hashes[engine_hash]
        await self.store.remove(worker, None, [key for _, key in oldest])
        self.skipped["hash_cap"] += len(oldest)

    async def _remove(
        self, worker: str, hashes: dict[int, int], engine_hashes: Sequence[int], tier: Tier | None
    ) -> None:
        """Blocks left `tier` (None: every tier); forget the engine hashes of those the worker
        no longer holds anywhere."""
        found: list[int] = []
        keys: list[int] = []
        for engine_hash in engine_hashes:
            key = hashes.get(engine_hash)
            if key is not None:
                found.append(engine_hash)
                keys.append(key)
        unknown = len(engine_hashes) - len(keys)
        if keys:
            held = await self.store.remove(worker, tier, keys)
            for engine_hash, still in zip(found, held, strict=True):
                # A hash listed twice is gone after its first time, as if it were never known.
                if not still and hashes.pop(engine_hash, None) is None:
                    unknown += 1
        if unknown:
            self.skipped["unknown_block"] += unknown

    async def drop_worker(self, worker: str) -> None:
        """Forget everything a worker holds (a stream gap it could not recover, or a publisher
        restart); the next batch starts its map afresh."""
        hashes = self._engine.pop(worker, {})
        await self.store.drop_worker(worker, hashes.values())
