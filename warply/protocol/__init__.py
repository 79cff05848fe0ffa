"""The wire contract between engine plugins, the router and the SDK (no engine imports)."""

from warply.protocol.decoder import DecodedBatch, Rejection, StreamDecoder
from warply.protocol.directives import (
    Directive,
    DirectiveKind,
    decode_directive,
    encode_directive,
)
from warply.protocol.events import (
    PROTOCOL_VERSION,
    AllCleared,
    BlockRemoved,
    BlockStored,
    DirectiveAck,
    Event,
    EventBatch,
    LoadSnapshot,
    TierMoved,
    encode_batch,
)
from warply.protocol.keys import chain_keys, prefix_keys, root_seed
from warply.protocol.tiers import Tier, tier_for_medium

__all__ = [
    "PROTOCOL_VERSION",
    "AllCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "Directive",
    "DirectiveAck",
    "DirectiveKind",
    "Event",
    "EventBatch",
    "LoadSnapshot",
    "Rejection",
    "StreamDecoder",
    "Tier",
    "TierMoved",
    "chain_keys",
    "decode_directive",
    "encode_batch",
    "encode_directive",
    "prefix_keys",
    "root_seed",
    "tier_for_medium",
]
