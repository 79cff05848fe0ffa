"""`PrefixIndex`: ingestion in front of one store, the object the router and the replayer hold."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Coroutine, Iterable, Sequence
from typing import Any

from router.index.contract import IndexStats, IndexStore, StoreUnavailable, WorkerMatch
from router.index.ingest import Ingest
from router.index.outage import StoreOutage
from warply.protocol import Event


class PrefixIndex:
    """Where cached prefixes live, per worker and tier, for one model.

    Writes go through ingestion (engine events → canonical keys → `store`); reads go to the
    store. Every method returns a coroutine (the store may be on the network); over the memory store
    none suspends."""

    def __init__(self, model: str, store: IndexStore, max_hashes: int = 4_000_000) -> None:
        """`max_hashes`: engine hashes ingestion keeps for all workers together (`Ingest`)."""
        self.model = model
        self.store = store
        self.ingest = Ingest(model, store, max_hashes)
        self.outage = StoreOutage()
        self._overpredicted: Counter[str] = Counter()

    def apply(self, worker: str, events: Iterable[Event]) -> Coroutine[Any, Any, None]:
        """Apply one worker's state events, in stream order (`Ingest.apply`; await it)."""
        return self.ingest.apply(worker, events)

    def mark(self, worker: str, seq: int, ts: float) -> Coroutine[Any, Any, None]:
        """Record the last batch of `worker`'s stream applied (`IndexStore.mark`; await it)."""
        return self.store.mark(worker, seq, ts)

    async def marked(self, worker: str) -> tuple[int, float] | None:
        """The last batch of `worker`'s stream an earlier router applied to a shared store
        (`IndexStore.marked`); None when there is none, or the store cannot answer (counted)."""
        try:
            found = await self.store.marked(worker)
        except StoreUnavailable as exc:
            self.outage.failed("marked", exc)
            return None
        self.outage.recovered()
        return found

    async def drop_worker(self, worker: str) -> None:
        """Forget everything a worker holds (stream gap it could not recover, or worker gone)."""
        await self.ingest.drop_worker(worker)

    def left(self, worker: str) -> None:
        """`worker` left the router for good: its over-prediction count goes too (`drop_worker`
        keeps it: a resync is not a departure)."""
        self._overpredicted.pop(worker, None)

    def overpredicted(self, worker: str, blocks: int) -> None:
        """Count `blocks` the index credited to `worker` that its engine then reported not
        cached (evicted before the request ran, or an eviction event not applied yet). The
        entries stay: the engine stores them again as it computes them
        (`RequestAccount.overpredicted`)."""
        self._overpredicted[worker] += blocks

    async def match(
        self, keys: Sequence[int], workers: Collection[str] | None = None
    ) -> dict[str, WorkerMatch]:
        """Per worker (the given ones, or every worker with a live stream), the leading run of
        `keys` it holds (`IndexStore.match`). While a network store cannot answer, every
        worker holds nothing (load decides), and the failure is counted in `outage`."""
        names = self.ingest.workers() if workers is None else workers
        try:
            found = await self.store.match(keys, names)
        except StoreUnavailable as exc:
            self.outage.failed("match", exc)
            return {name: WorkerMatch(0, {}) for name in names}
        self.outage.recovered()
        return found

    async def stats(self) -> IndexStats:
        """The store's counters (none while it is unreachable), with ingestion's skipped events
        and the store's failed calls."""
        try:
            stats = await self.store.stats()
        except StoreUnavailable as exc:
            self.outage.failed("stats", exc)
            stats = IndexStats()
        else:
            self.outage.recovered()
        stats.skipped = Counter(self.ingest.skipped)
        stats.store_failures = Counter(self.outage.failures)
        stats.overpredicted = Counter(self._overpredicted)
        return stats
