"""Index feeding: one `StateSubscriber` per worker with a state stream, into the prefix index.

Stock vLLM `--kv-events-config` streams and the WarplyConnector's stream speak the same
protocol. A gap the subscriber cannot recover drops that worker's entries (`on_stale`);
`LoadSnapshot` events update the worker's load (what the strategies see, and the engine's own
queues and capacity on /warply/workers); removals count as engine evictions; `PrefixHit`
events (the engine's own record of a request reusing its cache) count as engine-confirmed hits.
Each applied batch is marked in the store (a shared store keeps the newest, so a router started
later can tell a stream it continues from one that restarted meanwhile: `StateSubscriber`).
Every batch, resync and replay also tells the worker's `IndexHealth`; a `BlockStored` whose
block size is not its pool's puts the worker in `fallback` (its keys could never match).

A network index store that fails a write leaves the worker's entries there unknown (the call may
or may not have been applied): the worker is dropped from the index as soon as the store
answers again, and its stream rebuilds it; its batches are skipped until then.
"""

from __future__ import annotations

import asyncio

import zmq

from router.index import PrefixIndex, StoreUnavailable
from router.index_health import IndexHealth
from router.metrics import RouterMetrics
from router.tasks import cancel
from router.workers import Worker, Workers
from warply.protocol import BlockRemoved, BlockStored, DecodedBatch, LoadSnapshot, PrefixHit
from warply.protocol.api import StreamStats
from warply.protocol.subscriber import StateSubscriber


class IndexFeed:
    """Owns the subscribers and their tasks."""

    def __init__(
        self, workers: Workers, index: PrefixIndex, metrics: RouterMetrics, health: IndexHealth
    ) -> None:
        self._workers = workers
        self._index = index
        self._metrics = metrics
        self.health = health
        self.subscribers: dict[str, StateSubscriber] = {}
        health.watch(self.subscribers)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._lost: set[str] = set()
        """Workers whose entries in the store are unknown after a failed write: to drop."""
        for w in workers.values():
            self._subscribe(w)

    def _subscribe(self, worker: Worker) -> StateSubscriber | None:
        """A subscriber for `worker`'s state stream (None: it has none)."""
        self.health.joined(worker.name, bool(worker.config.events))
        if not worker.config.events:
            return None
        sub = self.subscribers[worker.name] = StateSubscriber(
            worker.name,
            worker.config.events,
            self.on_batch,
            self.resync,
            replay_endpoint=worker.config.replay,
            applied=self._index.marked,
            topic=worker.config.topic.encode(),
            bind=worker.config.bind,
        )
        return sub

    def start(self) -> None:
        """Open every socket now (so no event is missed) and start reading."""
        for sub in self.subscribers.values():
            self._start(sub)

    async def caught_up(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until every stream has applied its publisher's buffered
        history, so the first requests are placed on a rebuilt index."""
        waits = [asyncio.ensure_future(s.ready.wait()) for s in self.subscribers.values()]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=timeout_s)
            for w in pending:
                w.cancel()

    def _start(self, sub: StateSubscriber) -> None:
        """Open its socket and read it (a stream with a replay endpoint catches up first)."""
        sub.open()
        self._tasks[sub.worker] = asyncio.create_task(sub.run(), name=f"feed-{sub.worker}")

    def add(self, worker: Worker) -> None:
        """Subscribe to a worker that joined at runtime, as every worker is at start-up; raises
        `zmq.ZMQError` (and keeps nothing) when its stream's socket cannot be opened."""
        sub = self._subscribe(worker)
        if sub is None:
            return
        try:
            self._start(sub)
        except zmq.ZMQError:
            del self.subscribers[worker.name]
            self.health.left(worker.name)
            raise

    async def remove(self, worker: str) -> None:
        """Stop reading a worker's stream (it is leaving); its index entries stay to the caller."""
        self.subscribers.pop(worker, None)
        self.health.left(worker)
        self._lost.discard(worker)
        task = self._tasks.pop(worker, None)
        if task is not None:
            await cancel([task])

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await cancel(tasks)

    async def on_batch(self, worker: str, batch: DecodedBatch) -> None:
        """Apply one decoded batch of `worker`'s stream."""
        self.health.batch(worker)
        if worker in self._lost:
            await self.on_stale(worker)
        if worker not in self._lost:
            try:
                await self._index.apply(worker, batch.events)
                await self._index.mark(worker, batch.seq, batch.ts)
            except StoreUnavailable as exc:
                self._index.outage.failed("apply", exc)
                self._lost.add(worker)
            else:
                self._index.outage.recovered()
        for ev in batch.events:
            if isinstance(ev, LoadSnapshot):
                self._workers.engine_load(worker, ev)
            elif isinstance(ev, BlockRemoved):
                self._metrics.engine_removed(worker, len(ev.block_hashes))
            elif isinstance(ev, PrefixHit):
                self._metrics.engine_hit(worker, ev.hit_tokens)
            elif isinstance(ev, BlockStored):
                member = self._workers.get(worker)
                if member is not None and ev.block_size != member.pool.block_size:
                    self.health.block_size(worker, ev.block_size, member.pool.block_size)

    async def resync(self, worker: str) -> None:
        """The subscriber dropped the worker's stream state (gap it could not fill, publisher
        restart): drop its entries, `fallback` while the stream rebuilds them."""
        self.health.resynced(worker)
        await self.on_stale(worker)

    async def worker_down(self, worker: str) -> None:
        """The worker refuses connections (its engine crashed): its entries go now, and its
        restarted engine's stream is taken as a new sequence."""
        self.health.down(worker)
        if (sub := self.subscribers.get(worker)) is not None:
            sub.restarted()
        await self.on_stale(worker)

    async def age_out(self) -> None:
        """Drop the entries of workers whose stream went silent while they stored blocks
        (`IndexHealth.expired`)."""
        for name in self.health.expired():
            await self.on_stale(name)

    async def on_stale(self, worker: str) -> None:
        """Drop the worker's entries (its stream went stale, or a write to the store failed);
        while the store cannot answer, the worker stays marked for the drop."""
        try:
            await self._index.drop_worker(worker)
        except StoreUnavailable as exc:
            self._index.outage.failed("drop_worker", exc)
            self._lost.add(worker)
        else:
            self._lost.discard(worker)

    def stream_stats(self, worker: str) -> StreamStats | None:
        """The subscriber's counters for /warply/workers (None: the worker has no stream)."""
        sub = self.subscribers.get(worker)
        if sub is None:
            return None
        return StreamStats(
            endpoint=sub.endpoint,
            last_seq=sub.last_seq,
            gaps=sub.gaps,
            replayed=sub.replayed,
            resyncs=sub.resyncs,
            rejected={str(reason): n for reason, n in sub.decoder.rejected.items()},
        )
