"""Per-request prefix-hit reports: which cached device blocks a request reused.

Not (yet) part of `warply.protocol`: the state stream's `Event` union has no hit event, and an
unknown tag there would make routers reject the whole batch (and resync). Hits therefore go on
their own PUB socket with the same framing `[topic, seq (u64 BE), msgpack]`; the payload is a
tagged array `HitBatch`. Fire-and-forget (no replay): hits are statistics, not index state.
"""

from __future__ import annotations

import time

import msgspec
import zmq

from warply.protocol.tiers import Tier

HITS_VERSION = 1


class PrefixHit(msgspec.Struct, tag="hit", array_like=True):
    """One request's local prefix-cache hit, decided when its blocks were allocated."""

    request_id: str
    block_hashes: list[int]
    """Engine hashes (as on the state stream) of the reused blocks, root first."""
    hit_tokens: int
    prompt_tokens: int
    namespace: str = ""
    tier: Tier = Tier.GPU


class HitBatch(msgspec.Struct, tag="warply-hits", array_like=True):
    """One publish of hits from one worker."""

    version: int
    ts: float
    hits: list[PrefixHit]
    worker: str = ""


_encoder = msgspec.msgpack.Encoder()
hit_batch_decoder = msgspec.msgpack.Decoder(HitBatch)


class HitPublisher:
    """PUB socket owned by the scheduler thread; sends never block (ZMQ queues them)."""

    def __init__(self, endpoint: str, *, topic: str = "", worker: str = "") -> None:
        self._topic = topic.encode()
        self._worker = worker
        self._seq = 0
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 200)
        # Same convention as warply.protocol.publisher: a wildcard host binds, else connect.
        binds = "*" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        (self._sock.bind if binds else self._sock.connect)(endpoint)

    def publish(self, hits: list[PrefixHit]) -> None:
        """Send one batch (dropped by ZMQ, not blocked on, if no subscriber keeps up)."""
        if not hits:
            return
        payload = _encoder.encode(HitBatch(HITS_VERSION, time.time(), hits, self._worker))
        try:
            self._sock.send_multipart(
                (self._topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )
        except zmq.Again:
            return
        self._seq += 1

    def close(self) -> None:
        """Close the socket (lingers briefly to flush)."""
        self._sock.close()
