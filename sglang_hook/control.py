"""Directive socket: a ZMQ ROUTER on its own thread that queues directives and sends back acks.

The thread never touches the cache: the scheduler thread drains `inbox` between steps and
answers with `reply`. SGLang 0.5.23's scheduler spins through `on_idle` when it has no work, so
no wake-up is needed for a queued directive to be applied.
"""

from __future__ import annotations

import queue
import threading

import msgspec
import zmq

from warply.protocol import Directive, DirectiveAck, decode_directive

_ack_encoder = msgspec.msgpack.Encoder()


class ControlServer:
    """Binds `endpoint`; `inbox` holds `(envelope, directive)`; replies go out on the thread."""

    def __init__(self, endpoint: str) -> None:
        self.inbox: queue.SimpleQueue[tuple[list[bytes], Directive]] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple[list[bytes], DirectiveAck] | None] = (
            queue.SimpleQueue()
        )
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)  # a taken address fails scheduler start-up, by design
        self._thread = threading.Thread(target=self._loop, name="warply-control", daemon=True)
        self._thread.start()

    def reply(self, envelope: list[bytes], ack: DirectiveAck) -> None:
        """Queue an ack for the client that sent the directive."""
        self._outbox.put((envelope, ack))

    def close(self) -> None:
        """Send queued replies, then stop the thread and close the socket."""
        self._outbox.put(None)
        self._thread.join(2.0)

    def _loop(self) -> None:
        try:
            while True:
                if self._sock.poll(20):
                    frames = self._sock.recv_multipart()
                    self._receive(frames[:-1], frames[-1])
                while True:
                    try:
                        item = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    envelope, ack = item
                    self._sock.send_multipart([*envelope, _ack_encoder.encode(ack)])
        finally:
            self._sock.close()

    def _receive(self, envelope: list[bytes], payload: bytes) -> None:
        try:
            directive = decode_directive(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self.reply(envelope, DirectiveAck("", False, f"bad directive: {exc}"))
            return
        self.inbox.put((envelope, directive))
