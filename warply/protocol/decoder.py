"""Decoder for state streams: Warply's own, and the unmodified KV-event streams of engines.

Reads ZMQ multipart frames `[topic, seq (u64 BE), msgpack payload]` as published by Warply
plugins, vLLM 0.32 (`--kv-events-config`) and SGLang 0.5.23 (`--kv-events-config`), and yields
`warply.protocol.events` structs. Engine batches come as msgspec-encoded structs, either as maps
(`{"type": "BlockStored", ...}`) or as tagged arrays (`["BlockStored", ...]`) depending on the
engine's struct options; both are read. Bad input never raises: each rejected frame is counted by
reason (`StreamDecoder.rejected`) and logged (rate-limited), so one bad publisher cannot stop a
subscriber.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import msgspec
import xxhash

from warply.protocol.events import (
    PROTOCOL_VERSION,
    AllCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
)
from warply.protocol.tiers import tier_for_medium

_log = logging.getLogger(__name__)
_U64 = (1 << 64) - 1
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


class Rejection(StrEnum):
    """Why a frame was dropped."""

    BAD_FRAME = "bad_frame"
    """Wrong number of parts, or a sequence number that is not 8 bytes."""
    BAD_MSGPACK = "bad_msgpack"
    """The payload is not valid (or is truncated) msgpack."""
    UNSUPPORTED_VERSION = "unsupported_version"
    """A Warply batch with a protocol version this reader does not speak."""
    BAD_SCHEMA = "bad_schema"
    """Valid msgpack, but not a batch of known events with the right field types."""
    UNKNOWN_MEDIUM = "unknown_medium"
    """An engine medium with no tier mapping."""


class DecodedBatch(msgspec.Struct, frozen=True):
    """One accepted publish: its sequence number, timestamp and normalised events."""

    seq: int
    ts: float
    events: list[Event]
    source: str
    """"warply" for a Warply plugin stream, "engine" for a stock vLLM / SGLang stream."""


class _Reject(Exception):
    def __init__(self, reason: Rejection, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def engine_block_id(value: int | bytes) -> int:
    """An engine block hash as the u64 id Warply uses: ints are masked to 64 bits, digests
    longer than 8 bytes (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) folded with xxh3."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _U64
    if isinstance(value, (bytes, bytearray)):
        if len(value) <= 8:
            return int.from_bytes(value, "big")
        return xxhash.xxh3_64_intdigest(bytes(value))
    raise TypeError(f"block hash of type {type(value).__name__}")


def _engine_hash(value: Any) -> int:
    try:
        return engine_block_id(value)
    except TypeError as exc:
        raise _Reject(Rejection.BAD_SCHEMA, str(exc)) from None


def _fields(raw: Any, names: Sequence[str], kind: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    values = raw[1:]
    if len(values) > len(names) + 8:
        raise _Reject(Rejection.BAD_SCHEMA, f"{kind} with {len(values)} fields")
    return dict(zip(names, values, strict=False))


def _int_list(value: Any, what: str) -> list[int]:
    try:
        return msgspec.convert(value, list[int])  # validated in C, no per-token Python loop
    except msgspec.ValidationError:
        raise _Reject(Rejection.BAD_SCHEMA, f"{what} must be a list of ints") from None


def _tier(medium: Any) -> Any:
    if medium is not None and not isinstance(medium, str):
        raise _Reject(Rejection.BAD_SCHEMA, f"medium of type {type(medium).__name__}")
    tier = tier_for_medium(medium)
    if tier is None:
        raise _Reject(Rejection.UNKNOWN_MEDIUM, f"medium {medium!r}")
    return tier


def salt_namespace(extra_keys: Any, lora_name: Any) -> str:
    """The cache namespace of a chain root, from vLLM's per-block `extra_keys`.

    vLLM 0.32 folds `cache_salt` into the extra keys of a request's first block only, next to
    the LoRA name and multimodal ids; anything there besides the LoRA name changes the block's
    identity, so it all becomes the namespace.
    """
    if not isinstance(extra_keys, list) or not extra_keys or not extra_keys[0]:
        return ""
    parts = [str(k) for k in extra_keys[0] if k != lora_name]
    return "|".join(parts)


def _stored(raw: Any) -> BlockStored:
    f = _fields(raw, _STORED_FIELDS, "BlockStored")
    hashes = _engine_hashes(f.get("block_hashes"))
    parent_raw = f.get("parent_block_hash")
    parent = None if parent_raw is None else _engine_hash(parent_raw)
    tokens = _int_list(f.get("token_ids"), "token_ids")
    block_size = f.get("block_size")
    if not isinstance(block_size, int) or block_size <= 0:
        raise _Reject(Rejection.BAD_SCHEMA, f"block_size {block_size!r}")
    if len(tokens) != len(hashes) * block_size:
        raise _Reject(
            Rejection.BAD_SCHEMA,
            f"{len(tokens)} token ids for {len(hashes)} blocks of {block_size}",
        )
    lora = f.get("lora_name")
    namespace = None
    if parent is None:
        # SGLang 0.5.23 sends the salt as its own `cache_salt` field; vLLM 0.32 in extra_keys.
        salt = f.get("cache_salt")
        namespace = salt if isinstance(salt, str) else salt_namespace(f.get("extra_keys"), lora)
    return BlockStored(
        block_hashes=hashes,
        parent_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        tier=_tier(f.get("medium")),
        namespace=namespace,
        lora=lora if isinstance(lora, str) else None,
    )


def _engine_hashes(value: Any) -> list[int]:
    """`block_hashes` as u64 ids; a list of in-range ints (vLLM's default) is checked in C."""
    if not isinstance(value, list):
        raise _Reject(Rejection.BAD_SCHEMA, "block_hashes must be a list")
    try:
        ids: list[int] = msgspec.convert(value, list[int])
        if not ids or (min(ids) >= 0 and max(ids) <= _U64):
            return ids
    except msgspec.ValidationError:
        pass  # bytes digests or bad items: one at a time below
    return [_engine_hash(h) for h in value]


def _removed(raw: Any) -> BlockRemoved:
    f = _fields(raw, _REMOVED_FIELDS, "BlockRemoved")
    hashes = _engine_hashes(f.get("block_hashes"))
    return BlockRemoved(block_hashes=hashes, tier=_tier(f.get("medium")))


def _engine_event(raw: Any) -> Event:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise _Reject(Rejection.BAD_SCHEMA, f"event of type {type(raw).__name__}")
    if tag == "BlockStored":
        return _stored(raw)
    if tag == "BlockRemoved":
        return _removed(raw)
    if tag == "AllBlocksCleared":
        return AllCleared()
    raise _Reject(Rejection.BAD_SCHEMA, f"unknown event type {tag!r}")


def _engine_batch(raw: Any) -> tuple[float, list[Event]]:
    if isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
    else:
        raise _Reject(Rejection.BAD_SCHEMA, "payload is not an event batch")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise _Reject(Rejection.BAD_SCHEMA, "batch needs a numeric ts and a list of events")
    return float(ts), [_engine_event(e) for e in events]


class StreamDecoder:
    """Turns frames into `DecodedBatch`es; counts and logs what it rejects instead of raising."""

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
        except msgspec.DecodeError as exc:
            return self._reject(Rejection.BAD_MSGPACK, str(exc))
        try:
            if isinstance(raw, list) and raw and raw[0] == "warply":
                batch = self._warply(raw)
                result = DecodedBatch(seq, batch.ts, batch.events, "warply")
            else:
                ts, events = _engine_batch(raw)
                result = DecodedBatch(seq, ts, events, "engine")
        except _Reject as rej:
            return self._reject(rej.reason, str(rej))
        self.accepted += 1
        return result

    @staticmethod
    def _warply(raw: list[Any]) -> EventBatch:
        version = raw[1] if len(raw) > 1 else None
        if version != PROTOCOL_VERSION:
            raise _Reject(
                Rejection.UNSUPPORTED_VERSION,
                f"protocol version {version!r}, this reader speaks {PROTOCOL_VERSION}",
            )
        try:
            return msgspec.convert(raw, EventBatch)
        except msgspec.ValidationError as exc:
            raise _Reject(Rejection.BAD_SCHEMA, str(exc)) from None

    def _reject(self, reason: Rejection, detail: str) -> DecodedBatch | None:
        self.rejected[reason] += 1
        n = self.rejected[reason]
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            _log.warning(
                "state stream %s: rejected frame (%s: %s); %d rejected for this reason",
                self.name or "?",
                reason.value,
                detail,
                n,
            )
        return None
