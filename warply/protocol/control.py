"""Plugin-side directive socket: a ZMQ ROUTER on its own thread that queues directives.

The thread only decodes and queues; the engine's scheduler thread drains `inbox` between steps,
applies each directive through the engine's own API and answers with `reply`, so engine state
is only ever touched by the thread that owns it. An undecodable message is answered at once
with a rejection (it has no id to apply it under). Replies are `DirectiveAck` msgpack frames;
clients decode them with `ack_decoder`.

With a control token (the router's `control_token`, the plugins' `control_token`), every message
must be a `SignedDirective`: HMAC-SHA256 under the token over the sender's clock, a random nonce
and the encoded directive. The socket answers anything else with a rejection and applies
nothing: an unsigned or wrongly signed message (`unsigned`, `bad_mac`), one whose clock is more
than `window_s` off this host's (`stale`), or a nonce already seen within that window
(`replayed`). Each is counted in `ControlServer.rejected` by reason.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import zmq

from warply.protocol.directives import Directive, decode_directive
from warply.protocol.events import DirectiveAck

_log = logging.getLogger(__name__)
_ack_encoder = msgspec.msgpack.Encoder()
ack_decoder = msgspec.msgpack.Decoder(DirectiveAck)
"""Decodes a control-socket reply."""

REPLAY_WINDOW_S = 30.0
"""How far a signed directive's clock may be from the receiver's; nonces are kept this long."""
_MAX_NONCES = 100_000
_DOMAIN = b"warply-directive/v1\0"
_LOG_FIRST = 5
_LOG_EVERY = 1000


class SignedDirective(msgspec.Struct, array_like=True, tag="warply-signed", frozen=True):
    """An encoded `Directive` with its sender's proof of the control token."""

    ts: float
    """The sender's wall clock (s since the epoch)."""
    nonce: bytes
    """16 random bytes: a message seen once within the window is refused again."""
    directive: bytes
    mac: bytes
    """HMAC-SHA256(token, domain | ts | nonce | directive)."""


_signed_encoder = msgspec.msgpack.Encoder()
_signed_decoder = msgspec.msgpack.Decoder(SignedDirective)


def _mac(token: bytes, ts: float, nonce: bytes, directive: bytes) -> bytes:
    message = b"".join(
        (_DOMAIN, msgspec.msgpack.encode(ts), len(nonce).to_bytes(2, "big"), nonce, directive)
    )
    return hmac.new(token, message, hashlib.sha256).digest()


def sign(directive: bytes, token: str, now: float | None = None) -> bytes:
    """The message that carries the encoded `directive` to a socket holding `token`."""
    ts = time.time() if now is None else now
    nonce = os.urandom(16)
    mac = _mac(token.encode(), ts, nonce, directive)
    return _signed_encoder.encode(SignedDirective(ts, nonce, directive, mac))


class AuthError(ValueError):
    """A message the socket refuses; `reason` is the counter it goes to."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _hint(payload: bytes) -> str:
    """What to fix when a signed directive reaches a socket that has no token."""
    try:
        _signed_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return ""
    return " (a signed directive: give this plugin the router's control_token)"


class Verifier:
    """Checks signed messages against one token: MAC, clock window, nonce not seen before.

    Nonces are remembered for `window_s` (older messages are refused as stale anyway), at most
    `max_nonces` of them: past that, messages are refused until old ones expire, so a flood of
    valid messages cannot grow memory."""

    def __init__(
        self,
        token: str,
        window_s: float = REPLAY_WINDOW_S,
        max_nonces: int = _MAX_NONCES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._token = token.encode()
        self._window = window_s
        self._max = max_nonces
        self._clock = clock
        self._seen: dict[bytes, float] = {}
        """Nonce → its message's time, oldest first (expired ones dropped from the front)."""

    def open(self, message: bytes) -> bytes:
        """The encoded directive inside a valid `message`; `AuthError` otherwise."""
        try:
            signed = _signed_decoder.decode(message)
        except (msgspec.DecodeError, RecursionError):
            raise AuthError("unsigned", "this socket takes signed directives only") from None
        expected = _mac(self._token, signed.ts, signed.nonce, signed.directive)
        if not hmac.compare_digest(expected, signed.mac):
            raise AuthError("bad_mac", "the directive's signature does not match the token")
        now = self._clock()
        if not abs(now - signed.ts) <= self._window:
            raise AuthError(
                "stale", f"the directive is {now - signed.ts:.0f}s off this host's clock"
            )
        self._expire(now)
        if signed.nonce in self._seen:
            raise AuthError("replayed", "this directive was received before")
        if len(self._seen) >= self._max:
            raise AuthError("replayed", "too many directives within the replay window")
        self._seen[signed.nonce] = signed.ts
        return signed.directive

    def _expire(self, now: float) -> None:
        seen = self._seen
        while seen:
            nonce, ts = next(iter(seen.items()))
            if now - ts <= self._window:
                break
            del seen[nonce]


class ControlServer:
    """Binds `endpoint`; `inbox` holds `(envelope, directive)` for the scheduler thread.

    `wake`, if given, is called after each queued directive (engines that block while idle,
    such as vLLM's EngineCore loop, need a nudge to run the hook that drains the inbox).
    """

    def __init__(
        self, endpoint: str, wake: Callable[[], None] | None = None, token: str = ""
    ) -> None:
        self.rejected: Counter[str] = Counter()
        """Messages refused before any directive was applied, by reason (`bad_directive`,
        `unsigned`, `bad_mac`, `stale`, `replayed`); written by the control thread only."""
        self.refused = 0
        """Their total (an int other threads can read while the control thread counts)."""
        self._verifier = Verifier(token) if token else None
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
            if self._verifier is not None:
                payload = self._verifier.open(payload)
            directive = decode_directive(payload)
        except AuthError as exc:
            self._refuse(envelope, exc.reason, f"unauthenticated: {exc}")
            return
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:
            self._refuse(envelope, "bad_directive", f"bad directive: {exc}{_hint(payload)}")
            return
        self.inbox.put((envelope, directive))
        if self._wake is not None:
            self._wake()

    def _refuse(self, envelope: list[bytes], reason: str, message: str) -> None:
        self.refused += 1
        self.rejected[reason] += 1
        n = self.rejected[reason]
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            _log.warning("directive socket refused a message: %s; %d for this reason", message, n)
        self.reply(envelope, DirectiveAck("", False, message))
