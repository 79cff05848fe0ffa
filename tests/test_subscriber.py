"""The router's stream subscriber over real ZMQ sockets: bad frames, gaps, replay, restarts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec
import zmq

from warply.launch import free_port
from warply.protocol import PROTOCOL_VERSION, DecodedBatch, LoadSnapshot, Rejection, encode_batch
from warply.protocol.publisher import StatePublisher
from warply.protocol.subscriber import StateSubscriber

Applied = tuple[int, float] | None
"""The (seq, ts) of the last batch an earlier reader applied, or None."""


def _load(i: int) -> list[LoadSnapshot]:
    return [LoadSnapshot(running=i, waiting=0, kv_usage=0.0)]


class _Sink:
    def __init__(self) -> None:
        self.batches: list[DecodedBatch] = []
        self.stale: list[str] = []

    async def on_batch(self, worker: str, batch: DecodedBatch) -> None:
        self.batches.append(batch)

    async def on_stale(self, worker: str) -> None:
        self.stale.append(worker)


async def _until(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the subscriber"
        await asyncio.sleep(0.02)


async def _start(sub: StateSubscriber) -> asyncio.Task[None]:
    sub.open()
    task = asyncio.create_task(sub.run())
    await asyncio.sleep(0.3)  # let the SUB connect (ZMQ slow joiner)
    return task


def _earlier(applied: tuple[int, float] | None) -> Callable[[str], Awaitable[Applied]]:
    """What a shared index gives a subscriber: the last batch an earlier reader applied."""

    async def earlier(worker: str) -> Applied:
        return applied

    return earlier


async def _bare(
    worker: str = "w0", applied: Applied = None
) -> tuple[zmq.Socket[bytes], StateSubscriber, _Sink, asyncio.Task[None]]:
    """A bare PUB socket (an engine's stream, no replay socket) and a subscriber started on it."""
    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    sink = _Sink()
    sub = StateSubscriber(
        worker, f"tcp://127.0.0.1:{port}", sink.on_batch, sink.on_stale, applied=_earlier(applied)
    )
    return pub, sub, sink, await _start(sub)


def test_bad_frames_are_counted_and_the_subscriber_keeps_going() -> None:
    async def main() -> None:
        pub, sub, sink, task = await _bare()
        good = encode_batch(_load(0), 1.0)
        pub.send_multipart([b"", (0).to_bytes(8, "big"), good])
        pub.send_multipart([b"", b"\x01\x02", good])  # bad frame: 2-byte seq
        pub.send_multipart(
            [
                b"",
                (1).to_bytes(8, "big"),
                msgspec.msgpack.encode(["warply", PROTOCOL_VERSION + 1, 1.0, []]),
            ]
        )  # wrong version
        pub.send_multipart([b"", (1).to_bytes(8, "big"), good[:-5]])  # truncated msgpack
        pub.send_multipart([b"", (1).to_bytes(8, "big"), encode_batch(_load(1), 2.0)])
        await _until(lambda: len(sink.batches) == 2)
        task.cancel()
        pub.close(linger=0)
        assert [b.seq for b in sink.batches] == [0, 1]
        assert sub.decoder.rejected == {
            Rejection.BAD_FRAME: 1,
            Rejection.UNSUPPORTED_VERSION: 1,
            Rejection.BAD_MSGPACK: 1,
        }
        assert sink.stale == [] and sub.gaps == 0

    asyncio.run(main())


def test_an_event_on_an_unknown_medium_is_skipped_without_a_gap() -> None:
    """An engine batch whose only event names a medium with no tier still arrives (empty), so
    its sequence number is seen: no gap, no replay, no resync."""

    async def main() -> None:
        pub, sub, sink, task = await _bare()
        tape = [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "TAPE"}]]
        cleared = [2.0, [{"type": "AllBlocksCleared"}]]
        for seq, batch in enumerate((tape, cleared)):
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
        await _until(lambda: len(sink.batches) == 2)
        task.cancel()
        pub.close(linger=0)
        assert [(b.seq, len(b.events)) for b in sink.batches] == [(0, 0), (1, 1)]
        assert sub.decoder.rejected == {Rejection.UNKNOWN_MEDIUM: 1}
        assert (sub.gaps, sub.resyncs, sink.stale) == (0, 0, [])

    asyncio.run(main())


async def _late_joiner(
    published: int, buffer_steps: int
) -> tuple[StatePublisher, StateSubscriber, _Sink, asyncio.Task[None]]:
    """A publisher that sent `published` batches before a replay-capable subscriber started."""
    port, rport = free_port(), free_port()
    publisher = StatePublisher(
        f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{rport}",
        buffer_steps=buffer_steps,
        bind=True,
    )
    for i in range(published):
        publisher.publish(_load(i))
    await asyncio.sleep(0.3)  # published before anyone listened
    return (publisher, *await _join(publisher))


async def _join(
    publisher: StatePublisher, applied: Applied = None
) -> tuple[StateSubscriber, _Sink, asyncio.Task[None]]:
    """A replay-capable subscriber started on `publisher`; `applied`: the last batch an earlier
    reader applied, as a shared index would give it."""
    sink = _Sink()
    assert publisher.replay_endpoint is not None
    sub = StateSubscriber(
        "w0",
        publisher.endpoint,
        sink.on_batch,
        sink.on_stale,
        replay_endpoint=publisher.replay_endpoint,
        applied=_earlier(applied),
    )
    return sub, sink, await _start(sub)


def test_late_joiner_recovers_history_from_replay() -> None:
    async def main() -> None:
        publisher, sub, sink, task = await _late_joiner(3, buffer_steps=100)
        await _until(lambda: len(sink.batches) == 3)  # history first, before any new batch
        for i in range(3, 6):
            publisher.publish(_load(i))
        await _until(lambda: len(sink.batches) == 6)
        task.cancel()
        publisher.close()
        assert [b.seq for b in sink.batches] == list(range(6))
        assert [b.events[0].running for b in sink.batches] == list(range(6))  # type: ignore[union-attr]
        assert (sub.gaps, sub.replayed, sink.stale) == (0, 3, [])

    asyncio.run(main())


def test_late_joiner_takes_what_a_rotated_replay_buffer_still_holds() -> None:
    async def main() -> None:
        publisher, sub, sink, task = await _late_joiner(5, buffer_steps=2)  # keeps 3 and 4
        await _until(lambda: len(sink.batches) == 2)
        publisher.publish(_load(5))
        await _until(lambda: len(sink.batches) == 3)
        task.cancel()
        publisher.close()
        assert [b.seq for b in sink.batches] == [3, 4, 5]
        assert (sub.gaps, sub.replayed, sink.stale) == (0, 2, [])

    asyncio.run(main())


def test_unrecoverable_gap_and_restart_mark_the_worker_stale() -> None:
    async def main() -> None:
        pub, sub, sink, task = await _bare("w7")
        for seq in (0, 1, 5, 0):  # 2..4 lost with no replay socket; then the engine restarts
            pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(_load(seq), 1.0)])
        await _until(lambda: len(sink.batches) == 4)
        task.cancel()
        pub.close(linger=0)
        assert sink.stale == ["w7", "w7"] and sub.gaps == 1 and sub.resyncs == 2
        assert [b.seq for b in sink.batches] == [0, 1, 5, 0]

    asyncio.run(main())


def test_a_later_reader_checks_the_applied_batch_against_the_publishers_history() -> None:
    """The history holds the batch an earlier reader applied: continued, no resync. It holds
    another batch under that number, ends before it, or is empty: the publisher restarted, the
    entries are dropped (once) before the history is applied. A rotated history cannot tell:
    kept."""

    async def main() -> None:
        publisher, _, first, task = await _late_joiner(3, buffer_steps=100)
        await _until(lambda: len(first.batches) == 3)
        task.cancel()
        ts = [b.ts for b in first.batches]
        for applied, stale in (((2, ts[2]), []), ((1, ts[1] + 1), ["w0"]), ((7, ts[2]), ["w0"])):
            sub, sink, task = await _join(publisher, applied)
            await _until(lambda sink=sink: len(sink.batches) == 3)
            task.cancel()
            assert (sink.stale, sub.resyncs, sub.replayed) == (stale, len(stale), 3), applied
        publisher.close()
        publisher, _, _, task = await _late_joiner(0, buffer_steps=100)  # started, sent nothing
        task.cancel()
        sub, sink, task = await _join(publisher, (2, ts[2]))
        await _until(sub.ready.is_set)
        task.cancel()
        publisher.close()
        assert (sink.stale, sink.batches) == (["w0"], [])
        publisher, _, first, task = await _late_joiner(5, buffer_steps=2)  # keeps 3 and 4
        await _until(lambda: len(first.batches) == 2)
        task.cancel()
        sub, sink, task = await _join(publisher, (1, first.batches[0].ts - 1))
        await _until(lambda: len(sink.batches) == 2)
        task.cancel()
        publisher.close()
        assert (sink.stale, sub.resyncs) == ([], 0)

    asyncio.run(main())


def test_without_history_the_live_stream_must_go_on_from_the_applied_batch() -> None:
    """No replay socket: the next live batch after the applied one continues; a batch whose
    number is not newer but whose time is (a restarted publisher) resyncs."""

    async def main() -> None:
        for seq, stale in ((5, []), (0, ["w0"])):
            pub, sub, sink, task = await _bare(applied=(4, 1.0))
            pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(_load(seq), 2.0)])
            await _until(lambda sink=sink: len(sink.batches) == 1)
            task.cancel()
            pub.close(linger=0)
            assert (sink.stale, sub.gaps, sub.last_seq) == (stale, 0, seq)

    asyncio.run(main())
