"""Engine KV events → Warply state events: the one normalisation every path goes through.

vLLM 0.32 and SGLang 0.5.23 report `BlockStored` / `BlockRemoved` with their own hash widths,
media and salt conventions. The decoder reads them off an engine's stock stream; the vLLM and
SGLang plugins get the same events as the engines' own objects. Both hand the fields to
`block_stored` / `block_removed` here, so one engine block gets the same id, tier and namespace
whichever way it reaches the router.

What cannot be normalised raises `EventError` with a `Rejection` reason; callers never let it
reach an engine thread:

- `UNKNOWN_MEDIUM` (a medium with no tier): the event is skipped and counted by its reader; the
  rest of the batch goes on. The decoder counts it in `StreamDecoder.rejected["unknown_medium"]`,
  the vLLM plugin in its `events_skipped` counter (`vllm:warply_events_skipped_total`), the SGLang
  plugin in `WarplyEventPublisher.skipped`.
- `BAD_SCHEMA` (fields of the wrong shape): the decoder rejects the whole frame (a publisher
  that sends it is broken); a plugin skips the event and counts it like an unknown medium.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import msgspec
import xxhash

from warply.protocol.events import BlockRemoved, BlockStored
from warply.protocol.tiers import Tier, tier_for_medium

_U64 = (1 << 64) - 1


class Rejection(StrEnum):
    """Why input was dropped: a whole frame, or (`UNKNOWN_MEDIUM`) one event of it."""

    BAD_FRAME = "bad_frame"
    """Wrong number of parts, or a sequence number that is not 8 bytes."""
    BAD_MSGPACK = "bad_msgpack"
    """The payload is not valid (or is truncated) msgpack."""
    UNSUPPORTED_VERSION = "unsupported_version"
    """A Warply batch with a protocol version this reader does not speak."""
    BAD_SCHEMA = "bad_schema"
    """Valid msgpack, but not a batch of known events with the right field types."""
    UNKNOWN_MEDIUM = "unknown_medium"
    """An engine medium with no tier mapping: that event is skipped, the batch is kept."""


class EventError(ValueError):
    """An engine event that cannot be normalised, and why."""

    def __init__(self, reason: Rejection, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def engine_block_id(value: int | bytes) -> int:
    """An engine block hash as the u64 id Warply streams carry.

    Ints are taken modulo 2**64 (SGLang's signed int64 page heads, vLLM's 64-bit tails); digests
    of up to 8 bytes are read big-endian; longer digests (vLLM with
    `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) are folded with xxh3-64.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _U64
    if isinstance(value, (bytes, bytearray)):
        if len(value) <= 8:
            return int.from_bytes(value, "big")
        return xxhash.xxh3_64_intdigest(bytes(value))
    raise TypeError(f"block hash of type {type(value).__name__}")


def engine_block_ids(values: Any) -> list[int]:
    """`block_hashes` as u64 ids; a list of in-range ints (vLLM's default) is checked in C."""
    if not isinstance(values, list):
        raise EventError(Rejection.BAD_SCHEMA, "block_hashes must be a list")
    try:
        ids: list[int] = msgspec.convert(values, list[int])
        if not ids or (min(ids) >= 0 and max(ids) <= _U64):
            return ids
    except msgspec.ValidationError:
        pass  # bytes digests or bad items: one at a time below
    return [_block_id(h) for h in values]


def _block_id(value: Any) -> int:
    try:
        return engine_block_id(value)
    except TypeError as exc:
        raise EventError(Rejection.BAD_SCHEMA, str(exc)) from None


def event_tier(medium: Any) -> Tier:
    """The tier of an event's `medium` (None: the device tier); `EventError` if it has none."""
    if medium is not None and not isinstance(medium, str):
        raise EventError(Rejection.BAD_SCHEMA, f"medium of type {type(medium).__name__}")
    tier = tier_for_medium(medium)
    if tier is None:
        raise EventError(Rejection.UNKNOWN_MEDIUM, f"medium {medium!r}")
    return tier


def cache_namespace(salt: str | None, lora: str | None = None) -> str:
    """The cache namespace of a prefix: the tenant's cache salt, and the LoRA adapter if any.

    Engines keep two adapters' (and two salts') caches apart even for equal tokens, so their
    canonical keys must differ too. Without an adapter the namespace is the salt itself; with
    one it is `salt + "\\0" + adapter` (NUL is the field separator of `keys.root_seed`). Both the
    event side (this module) and the request side (`request_namespace`) build it here.
    """
    base = salt or ""
    return f"{base}\0{lora}" if lora else base


def namespace_salt(namespace: str) -> str:
    """The tenant's cache salt inside a namespace (`cache_namespace` without the adapter)."""
    return namespace.partition("\0")[0]


def request_namespace(body: Mapping[str, Any], base_model: str) -> str:
    """The namespace of an OpenAI request body: its `cache_salt`, and the LoRA adapter its
    `model` names when that is not the base model (vLLM and SGLang serve adapters by name)."""
    salt = body.get("cache_salt")
    model = body.get("model")
    lora = model if isinstance(model, str) and model != base_model else None
    return cache_namespace(salt if isinstance(salt, str) else None, lora)


def salt_namespace(extra_keys: Any, lora_name: Any) -> str:
    """The cache namespace of a chain root from vLLM 0.32's per-block `extra_keys`.

    vLLM folds `cache_salt` into the extra keys of a request's first block only, after the
    LoRA name (first, on every block of an adapter's request) and multimodal ids; anything
    there besides the LoRA name changes the block's identity, so it all becomes the salt part.
    """
    lora = lora_name if isinstance(lora_name, str) and lora_name else None
    first = extra_keys[0] if isinstance(extra_keys, list) and extra_keys else None
    parts = list(first) if isinstance(first, (list, tuple)) else []
    if lora is not None and parts and parts[0] == lora:
        parts = parts[1:]
    return cache_namespace("|".join(_key_text(k) for k in parts), lora)


def _key_text(key: Any) -> str:
    # A multimodal `(identifier, offset)` pair is a tuple in-process and a list off the wire.
    return str(list(key)) if isinstance(key, tuple) else str(key)


def _int_list(value: Any, what: str) -> list[int]:
    try:
        return msgspec.convert(value, list[int])  # validated in C, no per-token Python loop
    except msgspec.ValidationError:
        raise EventError(Rejection.BAD_SCHEMA, f"{what} must be a list of ints") from None


def block_stored(
    block_hashes: Any,
    parent_block_hash: Any,
    token_ids: Any,
    block_size: Any,
    medium: Any,
    *,
    lora_name: Any = None,
    cache_salt: Any = None,
    extra_keys: Any = None,
) -> BlockStored:
    """One engine `BlockStored` (its fields as vLLM 0.32 / SGLang 0.5.23 name them) as Warply's.

    The namespace is set on a chain's root only: SGLang sends the salt as `cache_salt`, vLLM
    inside `extra_keys`; either way the LoRA adapter joins it (`cache_namespace`).
    """
    hashes = engine_block_ids(block_hashes)
    parent = None if parent_block_hash is None else _block_id(parent_block_hash)
    tokens = _int_list(token_ids, "token_ids")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise EventError(Rejection.BAD_SCHEMA, f"block_size {block_size!r}")
    if len(tokens) != len(hashes) * block_size:
        raise EventError(
            Rejection.BAD_SCHEMA,
            f"{len(tokens)} token ids for {len(hashes)} blocks of {block_size}",
        )
    tier = event_tier(medium)
    lora = lora_name if isinstance(lora_name, str) and lora_name else None
    namespace = None
    if parent is None:
        if isinstance(cache_salt, str):
            namespace = cache_namespace(cache_salt, lora)
        else:
            namespace = salt_namespace(extra_keys, lora)
    return BlockStored(
        block_hashes=hashes,
        parent_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        tier=tier,
        namespace=namespace,
        lora=lora,
    )


def block_removed(block_hashes: Any, medium: Any) -> BlockRemoved:
    """One engine `BlockRemoved` as Warply's."""
    return BlockRemoved(block_hashes=engine_block_ids(block_hashes), tier=event_tier(medium))
