"""Plugin-side directive socket: a ZMQ ROUTER on its own thread that queues directives.

The thread only decodes and queues; the engine's scheduler thread drains `inbox` between steps,
applies each directive through the engine's own API and answers with `reply`, so engine state
is only ever touched by the thread that owns it. An undecodable message is answered at once
with a rejection (it has no id to apply it under). Replies are `DirectiveAck` msgpack frames;
clients decode them with `ack_decoder`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import msgspec
import zmq

from warply.protocol.directives import Directive, decode_directive
from warply.protocol.events import DirectiveAck

_log = logging.getLogger(__name__)
_ack_encoder = msgspec.msgpack.Encoder()
ack_decoder = msgspec.msgpack.Decoder(DirectiveAck)
"""Decodes a control-socket reply."""


class ControlServer:
    """Binds `endpoint`; `inbox` holds `(envelope, directive)` for the scheduler thread.

    `wake`, if given, is called after each queued directive (engines that block while idle,
    such as vLLM's EngineCore loop, need a nudge to run the hook that drains the inbox).
    """

    def __init__(self, endpoint: str, wake: Callable[[], None] | None = None) -> None:
        self.inbox: queue.SimpleQueue[tuple[list[bytes], Directive]] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple[list[bytes], DirectiveAck] | None] = (
            queue.SimpleQueue()
        )
        self._wake = wake
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)  # a taken address fails engine start-up, by design
        self._thread = threading.Thread(target=self._loop, name="warply-control", daemon=True)
        self._thread.start()

    def apply_pending(self, apply: Callable[[Directive], DirectiveAck]) -> list[DirectiveAck]:
        """Scheduler thread: apply every queued directive, answer each, return the acks.

        An exception inside `apply` becomes a rejection: every directive gets an answer.
        """
        acks: list[DirectiveAck] = []
        while True:
            try:
                envelope, directive = self.inbox.get_nowait()
            except queue.Empty:
                return acks
            try:
                ack = apply(directive)
            except Exception as exc:
                _log.exception("warply directive %s failed", directive.id)
                ack = DirectiveAck(directive.id, False, f"internal error: {exc}")
            self.reply(envelope, ack)
            acks.append(ack)

    def reply(self, envelope: list[bytes], ack: DirectiveAck) -> None:
        """Queue an ack for the client that sent the directive (sent by the control thread)."""
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
        if self._wake is not None:
            self._wake()
