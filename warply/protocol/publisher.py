"""Plugin-side state publisher: ZMQ PUB with a replay buffer behind a ROUTER socket.

Same framing and replay protocol as the engines' own publishers, so one subscriber reads all of
them: `[topic, seq (u64 BE), payload]` on PUB; a replay request `[seq]` (u64 BE) is answered
with every buffered `[seq, payload]` from there on, then `[-1, b""]`. Sockets live on one
background thread (ZMQ sockets are not thread-safe), so `publish` is cheap and never blocks the
engine's scheduler.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from warply.protocol.endpoints import binds as _binds
from warply.protocol.events import Event, encode_batch

_log = logging.getLogger(__name__)

REPLAY_END_SEQ = -1
"""The sequence number (8 bytes, big-endian, signed) that ends a replay answer, as vLLM and
SGLang send it; `StateSubscriber` stops reading a replay at it."""


class StatePublisher:
    """Publishes event batches in order with sequence numbers and serves replays."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        worker: str = "",
        buffer_steps: int = 10_000,
        bind: bool | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        """`bind`: True binds `endpoint`, False connects it; None follows the engines' rule
        (`warply.protocol.endpoints.Endpoint.binds`)."""
        self.worker = worker
        self.published = 0
        self._topic = topic.encode()
        self._queue: queue.SimpleQueue[list[Event] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 500)
        binds = _binds(endpoint) if bind is None else bind
        (self._pub.bind if binds else self._pub.connect)(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) if binds else endpoint
        """The stream's endpoint as bound (`tcp://HOST:*` resolved to the port taken)."""
        self.replay_endpoint: str | None = None
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._loop, name="warply-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> None:
        """Queue one batch; it goes out with the next sequence number."""
        if events:
            self._queue.put(events)

    def close(self, timeout_s: float = 2.0) -> None:
        """Flush what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        seq = 0
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    events = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if events is None:
                    break
                payload = encode_batch(events, time.time(), self.worker)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.published += 1
                seq += 1
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            _log.warning("ignoring malformed replay request (%d parts)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        end = REPLAY_END_SEQ.to_bytes(8, "big", signed=True)
        self._replay.send_multipart((client, b"", end, b""))
