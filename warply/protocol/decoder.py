"""Decoder for state streams: Warply's own, and the unmodified KV-event streams of engines.

Reads ZMQ multipart frames `[topic, seq (u64 BE), msgpack payload]` as published by Warply
plugins, vLLM 0.32 (`--kv-events-config`) and SGLang 0.5.23 (`--kv-events-config`), and yields
`warply.protocol.events` structs. Engine batches come as msgspec-encoded structs, either as maps
(`{"type": "BlockStored", ...}`) or as tagged arrays (`["BlockStored", ...]`) depending on the
engine's struct options; both are read, then normalised by `warply.protocol.normalize` (the same
code the plugins use). Bad input never raises: each rejected frame is counted by reason
(`StreamDecoder.rejected`) and logged (rate-limited), so one bad publisher cannot stop a
subscriber; an event on an unknown medium is skipped and counted, and its batch kept.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from warply.protocol.events import (
    PROTOCOL_VERSION,
    AllCleared,
    Event,
    EventBatch,
)
from warply.protocol.normalize import (
    EventError,
    Rejection,
    block_removed,
    block_stored,
    engine_block_id,
    salt_namespace,
)

__all__ = [
    "DecodedBatch",
    "Rejection",
    "StreamDecoder",
    "engine_block_id",
    "salt_namespace",
]

_log = logging.getLogger(__name__)
_LOG_FIRST = 5
_LOG_EVERY = 1000

# Field order of the engines' event structs when encoded as tagged arrays (after the tag); vLLM
# 0.32 and SGLang 0.5.23 both send maps (`{"type": ...}`), older releases sent these arrays.
# Trailing fields with defaults may be omitted on the wire.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)
_REMOVED_FIELDS = ("block_hashes", "medium")


class DecodedBatch(msgspec.Struct, frozen=True):
    """One accepted publish: its sequence number, timestamp and normalised events."""

    seq: int
    ts: float
    events: list[Event]
    source: str
    """"warply" for a Warply plugin stream, "engine" for a stock vLLM / SGLang stream."""


def _fields(raw: Any, names: Sequence[str], kind: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    values = raw[1:]
    if len(values) > len(names) + 8:
        raise EventError(Rejection.BAD_SCHEMA, f"{kind} with {len(values)} fields")
    return dict(zip(names, values, strict=False))


def _stored(raw: Any) -> Event:
    f = _fields(raw, _STORED_FIELDS, "BlockStored")
    return block_stored(
        f.get("block_hashes"),
        f.get("parent_block_hash"),
        f.get("token_ids"),
        f.get("block_size"),
        f.get("medium"),
        lora_name=f.get("lora_name"),
        cache_salt=f.get("cache_salt"),
        extra_keys=f.get("extra_keys"),
    )


def _removed(raw: Any) -> Event:
    f = _fields(raw, _REMOVED_FIELDS, "BlockRemoved")
    return block_removed(f.get("block_hashes"), f.get("medium"))


def _engine_event(raw: Any) -> Event:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise EventError(Rejection.BAD_SCHEMA, f"event of type {type(raw).__name__}")
    if tag == "BlockStored":
        return _stored(raw)
    if tag == "BlockRemoved":
        return _removed(raw)
    if tag == "AllBlocksCleared":
        return AllCleared()
    raise EventError(Rejection.BAD_SCHEMA, f"unknown event type {tag!r}")


def _engine_batch(raw: Any) -> tuple[float, list[Any]]:
    if isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
    else:
        raise EventError(Rejection.BAD_SCHEMA, "payload is not an event batch")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise EventError(Rejection.BAD_SCHEMA, "batch needs a numeric ts and a list of events")
    return float(ts), events


class StreamDecoder:
    """Turns frames into `DecodedBatch`es; counts and logs what it rejects instead of raising.

    `rejected` counts by reason: whole frames, except `unknown_medium`, which counts events
    skipped from batches that were otherwise accepted (the batch keeps its sequence number, so
    skipping an event never looks like a gap).
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.accepted = 0
        self.rejected: Counter[str] = Counter()

    def decode_frames(self, frames: Sequence[bytes]) -> DecodedBatch | None:
        """Decode one published message: `[topic, seq, payload]` (or `[seq, payload]`)."""
        if len(frames) not in (2, 3) or len(frames[-2]) != 8:
            return self._reject(
                Rejection.BAD_FRAME,
                f"{len(frames)} parts, seq of {len(frames[-2]) if len(frames) >= 2 else 0} bytes",
            )
        return self.decode_payload(int.from_bytes(frames[-2], "big"), frames[-1])

    def decode_payload(self, seq: int, payload: bytes) -> DecodedBatch | None:
        """Decode one payload whose sequence number is already known (live or replayed)."""
        try:
            raw = msgspec.msgpack.decode(payload)
        except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep
            return self._reject(Rejection.BAD_MSGPACK, str(exc))
        try:
            if isinstance(raw, list) and raw and raw[0] == "warply":
                batch = self._warply(raw)
                result = DecodedBatch(seq, batch.ts, batch.events, "warply")
            else:
                ts, raw_events = _engine_batch(raw)
                result = DecodedBatch(seq, ts, self._engine_events(raw_events), "engine")
        except EventError as exc:
            return self._reject(exc.reason, str(exc))
        self.accepted += 1
        return result

    def _engine_events(self, raw_events: list[Any]) -> list[Event]:
        events: list[Event] = []
        for raw in raw_events:
            try:
                events.append(_engine_event(raw))
            except EventError as exc:
                if exc.reason is not Rejection.UNKNOWN_MEDIUM:
                    raise
                self._count(exc.reason, str(exc), "skipped event")
        return events

    @staticmethod
    def _warply(raw: list[Any]) -> EventBatch:
        version = raw[1] if len(raw) > 1 else None
        if version != PROTOCOL_VERSION:
            raise EventError(
                Rejection.UNSUPPORTED_VERSION,
                f"protocol version {version!r}, this reader speaks {PROTOCOL_VERSION}",
            )
        try:
            return msgspec.convert(raw, EventBatch)
        except msgspec.ValidationError as exc:
            raise EventError(Rejection.BAD_SCHEMA, str(exc)) from None

    def _reject(self, reason: Rejection, detail: str) -> DecodedBatch | None:
        self._count(reason, detail, "rejected frame")
        return None

    def _count(self, reason: Rejection, detail: str, what: str) -> None:
        self.rejected[reason] += 1
        n = self.rejected[reason]
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            _log.warning(
                "state stream %s: %s (%s: %s); %d for this reason",
                self.name or "?",
                what,
                reason.value,
                detail,
                n,
            )
