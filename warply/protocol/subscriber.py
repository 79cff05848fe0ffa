"""One worker's state-stream subscription: decode, detect gaps, recover them, or resync.

Sequence numbers come from the publisher (vLLM, SGLang and Warply plugins all number batches
from 0). A gap is recovered from the publisher's replay socket (ZMQ ROUTER: request = the first
missing seq as u64 BE; replies = `[seq, payload]` frames ending with seq -1). When replay cannot
fill the gap (no replay endpoint, timeout, buffer already rotated), or the sequence goes
backwards (the engine restarted), the worker's index entries are stale: `on_stale` tells the
index to drop them so the stream rebuilds them. A batch numbered at or below the last one is a
duplicate (a live copy of a replayed batch) when its timestamp is not newer than the last one
applied; otherwise its publisher restarted (and its first batches may have been lost while the
socket reconnected: they are replayed from the new publisher like any gap).

A router started after another one fed a shared index holds no sequence of its own: `applied`
gives the last batch that router applied (seq, ts), and the publisher's history must still
hold that very batch. When it holds another batch under that number, or ends before it, the
publisher restarted in between: the entries are stale and dropped before the history is
applied (so does an empty history: a publisher keeps its latest batches). A history that
starts after it (rotated) cannot tell, and is taken as continuous. Without a replay socket, the
live stream must go on from that batch (a restart or a gap there resyncs).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from warply.protocol.decoder import DecodedBatch, StreamDecoder
from warply.protocol.publisher import REPLAY_END_SEQ

_log = logging.getLogger(__name__)


class StateSubscriber:
    """Reads one worker's state stream and hands every in-order batch to `on_batch`.

    `on_batch` and `on_stale` are coroutine functions; each is awaited before the next batch is
    read, so the consumer sees the stream in order."""

    def __init__(
        self,
        worker: str,
        endpoint: str,
        on_batch: Callable[[str, DecodedBatch], Awaitable[None]],
        on_stale: Callable[[str], Awaitable[None]],
        *,
        replay_endpoint: str | None = None,
        applied: Callable[[str], Awaitable[tuple[int, float] | None]] | None = None,
        topic: bytes = b"",
        bind: bool = False,
        replay_timeout_s: float = 1.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.worker = worker
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.decoder = StreamDecoder(worker)
        self.last_seq: int | None = None
        self._last_ts = float("-inf")
        self.replaying = False
        """A gap (or the start-up history) is being fetched from the replay socket."""
        self.ready = asyncio.Event()
        """Set once the start-up history is applied (or there is none to take)."""
        self.gaps = 0
        self.replayed = 0
        self.resyncs = 0
        self._on_batch = on_batch
        self._on_stale = on_stale
        self._applied = applied
        """The (seq, ts) of the last batch an earlier reader applied for this worker, or None."""
        self._topic = topic
        self._bind = bind
        self._replay_timeout_s = replay_timeout_s
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None

    def open(self) -> None:
        """Create and attach the SUB socket (bind for collectors, else connect to the engine)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.setsockopt(zmq.LINGER, 0)
        (sub.bind if self._bind else sub.connect)(self.endpoint)
        self._sub = sub

    async def run(self) -> None:
        """Receive until cancelled; never raises on bad input (the decoder counts it)."""
        if self._sub is None:
            self.open()
        assert self._sub is not None
        try:
            if self.last_seq is None:
                await self._catch_up()
            self.ready.set()
            while True:
                frames = await self._sub.recv_multipart()
                batch = self.decoder.decode_frames(frames)
                if batch is not None:
                    await self._accept(batch)
        finally:
            self._sub.close(linger=0)
            self._sub = None

    def restarted(self) -> None:
        """Its publisher is gone (the engine crashed): take the next batch, whatever its number,
        as the start of a new sequence (earlier ones replayed from the new publisher)."""
        self.last_seq = None
        self._last_ts = float("-inf")

    async def _accept(self, batch: DecodedBatch) -> None:
        if self.last_seq is not None and batch.seq <= self.last_seq:
            if batch.seq != 0 and batch.ts <= self._last_ts:
                return  # a duplicate of something already applied (live after replay)
            why = f"sequence restarted at {batch.seq} after {self.last_seq} (publisher restarted)"
            await self._stale(why)
            self.restarted()
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if batch.seq > expected:
            self.gaps += 1
            if not await self._replay(expected, batch.seq):
                await self._stale(f"could not recover seq {expected}..{batch.seq - 1}")
        await self._deliver(batch)

    async def _deliver(self, batch: DecodedBatch) -> None:
        self.last_seq = batch.seq
        self._last_ts = max(self._last_ts, batch.ts)
        await self._on_batch(self.worker, batch)

    async def _stale(self, why: str) -> None:
        self.resyncs += 1
        _log.warning("state stream %s: %s; dropping its index entries (resync)", self.worker, why)
        await self._on_stale(self.worker)

    async def _replay(self, start: int, stop: int) -> bool:
        """Fetch batches `start..stop-1` from the replay socket and deliver them all at once;
        True if complete (nothing is delivered otherwise).

        Delivery waits for the whole range because a replay walks through history: a late
        joiner's replay from 0 holds blocks stored before a cache reset, then the reset. Applied
        batch by batch across awaits, the router would place requests on those past states. The
        batches go to `on_batch` back to back: when it never suspends (the router's index over
        its in-process store), nothing else runs in between."""
        batches = await self._fetch(start, stop)
        if batches is None:
            return False
        for batch in batches:
            await self._deliver(batch)
        self.replayed += len(batches)
        return True

    async def _catch_up(self) -> None:
        """On start, take the publisher's whole buffered history (from its oldest batch) instead
        of waiting for the next batch to reveal a gap: the index knows what the worker holds
        before the first request is placed. Checked first against the batch an earlier reader
        applied, if any (module docstring)."""
        mark = await self._applied(self.worker) if self._applied is not None else None
        batches = await self._fetch(0, None)
        if batches is None:
            if self.replay_endpoint:
                _log.info("state stream %s: no replay history; starting from live", self.worker)
            if mark is not None:
                self.last_seq, self._last_ts = mark
            return
        if mark is not None and _restarted_since(mark, batches):
            await self._stale(f"its publisher restarted after batch {mark[0]}, which was applied")
        for batch in batches:
            await self._deliver(batch)
        self.replayed += len(batches)

    async def _fetch(self, start: int, stop: int | None) -> list[DecodedBatch] | None:
        """Batches `start..stop-1` (stop None: all the publisher buffers from `start` on, the
        first one being whatever it still holds); None if incomplete or undecodable."""
        if not self.replay_endpoint:
            return None
        self.replaying = True
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        batches: list[DecodedBatch] = []
        got: int | None = start if stop is not None else None
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(self._replay_timeout_s * 1000)):
                    return None
                frames = await sock.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames) >= 2 else None
                if seq is None or seq == REPLAY_END_SEQ:
                    break
                if (got is not None and seq < got) or (stop is not None and seq >= stop):
                    continue
                if got is not None and seq > got:
                    return None  # the publisher's buffer no longer holds `got`
                batch = self.decoder.decode_payload(seq, frames[-1])
                if batch is None:
                    return None
                batches.append(batch)
                got = seq + 1
        finally:
            sock.close(linger=0)
            self.replaying = False
        if stop is not None and (got is None or got < stop):
            return None
        return batches


def _restarted_since(mark: tuple[int, float], history: list[DecodedBatch]) -> bool:
    """Whether the publisher of `history` (its buffered batches, consecutive, oldest first)
    restarted after publishing batch `mark` (seq, ts): the history holds another batch under
    that number, or ends before it, or is empty (a publisher keeps its latest batches, so one
    that holds none has published nothing since it started)."""
    seq, ts = mark
    if not history:
        return True
    first = history[0].seq
    if first <= seq <= history[-1].seq:
        return history[seq - first].ts != ts
    return history[-1].seq < seq
