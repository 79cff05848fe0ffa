"""Plugin → router state stream: the events a Warply plugin publishes, and the batch around them.

Wire form: msgpack of `EventBatch`, framed as ZMQ multipart `[topic, seq (u64 BE), payload]`.
Structs are tagged arrays (compact, and the tag lets a reader reject unknown event kinds).
Engine streams (vLLM, SGLang) are read by `warply.protocol.decoder`, which normalises them to
these same structs, so everything downstream handles one event model.
"""

from __future__ import annotations

import msgspec

from warply.protocol.tiers import Tier

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change; readers reject batches with another version."""


class _Event(msgspec.Struct, tag=True, array_like=True):
    """Base of all state events."""


class BlockStored(_Event, tag="stored"):
    """Full blocks cached on `tier`, in chain order.

    `block_hashes` are the engine's own ids (used to resolve later removals); the router
    recomputes canonical keys from `token_ids`. `namespace` is the cache salt / tenant; None means
    "same namespace as the parent block" (engines report the salt only at a chain's root).
    """

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    block_size: int
    tier: Tier = Tier.GPU
    namespace: str | None = None
    lora: str | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(
                f"{len(self.token_ids)} token ids for {len(self.block_hashes)} blocks "
                f"of {self.block_size}"
            )


class BlockRemoved(_Event, tag="removed"):
    """Blocks dropped from `tier` (they may still live on another tier)."""

    block_hashes: list[int]
    tier: Tier = Tier.GPU


class AllCleared(_Event, tag="cleared"):
    """Every block on `tier` is gone; None means every tier of this worker."""

    tier: Tier | None = None


class TierMoved(_Event, tag="moved"):
    """Blocks moved between tiers (promotion or demotion) without changing content."""

    block_hashes: list[int]
    src: Tier
    dst: Tier


class LoadSnapshot(_Event, tag="load"):
    """Engine load at one instant: scheduler queues and KV occupancy."""

    running: int
    waiting: int
    kv_usage: float
    kv_blocks_total: int = 0
    kv_bytes_per_block: int = 0
    """KV bytes one block takes on this engine, all layers and ranks (from its KV cache spec;
    0: not reported). The router's bytes metrics use it unless the pool sets
    `kv_bytes_per_token`."""
    backend_bytes: dict[Tier, int] | None = None
    """KV bytes this worker holds on tiers below the device as the tier backend itself counts
    them (e.g. LMCache's `/status`: its L1 is the cpu tier); None: not reported. The router takes
    these figures for those tiers instead of index entries × bytes per block. Added in protocol
    version 1 as a trailing optional field: older readers ignore it, older writers omit it."""


class DirectiveAck(_Event, tag="ack"):
    """A plugin's answer to one directive: applied, or rejected with a reason."""

    directive_id: str
    applied: bool
    reason: str = ""
    blocks: int = 0


class PrefixHit(_Event, tag="hit"):
    """One request's local prefix-cache hit, decided when the engine allocated its blocks.

    Statistics, not index state: the index ignores it; the router and metrics count it.
    """

    request_id: str
    block_hashes: list[int]
    """Engine hashes (as in `BlockStored`) of the reused blocks, root first."""
    hit_tokens: int
    prompt_tokens: int
    namespace: str = ""
    tier: Tier = Tier.GPU


Event = (
    BlockStored | BlockRemoved | AllCleared | TierMoved | LoadSnapshot | DirectiveAck | PrefixHit
)


class EventBatch(msgspec.Struct, tag="warply", array_like=True):
    """One publish: events from one worker, in order, stamped with the protocol version."""

    version: int
    ts: float
    events: list[Event]
    worker: str = ""


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: list[Event], ts: float, worker: str = "") -> bytes:
    """Serialise a batch of events for the wire (the payload frame)."""
    return _encoder.encode(EventBatch(PROTOCOL_VERSION, ts, events, worker))
