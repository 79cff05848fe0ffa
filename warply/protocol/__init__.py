"""The wire contract between engine plugins, the router and the SDK (no engine imports)."""

from warply.protocol.decoder import DecodedBatch, StreamDecoder
from warply.protocol.directives import (
    Directive,
    DirectiveKind,
    decode_directive,
    encode_directive,
)
from warply.protocol.endpoints import Endpoint, EndpointError, parse_endpoint
from warply.protocol.events import (
    PROTOCOL_VERSION,
    AllCleared,
    BlockRemoved,
    BlockStored,
    DirectiveAck,
    Event,
    EventBatch,
    LoadSnapshot,
    PrefixHit,
    TierMoved,
    encode_batch,
)
from warply.protocol.keys import chain_keys, prefix_keys, root_seed
from warply.protocol.normalize import (
    EventError,
    Rejection,
    block_removed,
    block_stored,
    cache_namespace,
    engine_block_id,
    event_tier,
    namespace_salt,
    request_namespace,
    salt_namespace,
)
from warply.protocol.plugin import PluginSettings, SettingsError
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
    "Endpoint",
    "EndpointError",
    "Event",
    "EventBatch",
    "EventError",
    "LoadSnapshot",
    "PluginSettings",
    "PrefixHit",
    "Rejection",
    "SettingsError",
    "StreamDecoder",
    "Tier",
    "TierMoved",
    "block_removed",
    "block_stored",
    "cache_namespace",
    "chain_keys",
    "decode_directive",
    "encode_batch",
    "encode_directive",
    "engine_block_id",
    "event_tier",
    "parse_endpoint",
    "prefix_keys",
    "namespace_salt",
    "request_namespace",
    "root_seed",
    "salt_namespace",
    "tier_for_medium",
]
