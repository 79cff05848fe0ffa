"""Router / SDK → plugin directives: tier and retention commands for cached prefixes.

Plugins apply them through the engine's or backend's own API and answer each one with a
`DirectiveAck` event on the state stream; Warply itself never moves KV blocks.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from warply.protocol.tiers import Tier


class DirectiveKind(StrEnum):
    """What a directive asks for."""

    PIN = "pin"
    UNPIN = "unpin"
    PREFETCH = "prefetch"
    OFFLOAD = "offload"
    EVICT = "evict"


class Directive(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One command for the blocks of one prefix.

    The prefix is given by `token_ids` (the plugin hashes it the engine's way) or by canonical
    `keys`; at least one must be set. `tier` is the target tier (prefetch: promote to it;
    offload: demote to it; pin/evict: the tier it applies to, None = wherever it lives).
    `ttl_s` bounds a pin (0 = until unpinned). `namespace` is the cache salt the prefix lives in.
    """

    id: str
    kind: DirectiveKind
    token_ids: list[int] | None = None
    keys: list[int] | None = None
    tier: Tier | None = None
    ttl_s: float = 0.0
    namespace: str = ""

    def __post_init__(self) -> None:
        if not self.token_ids and not self.keys:
            raise ValueError("a directive needs `token_ids` or `keys`")
        if self.ttl_s < 0:
            raise ValueError("`ttl_s` must be >= 0")


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Directive)


def encode_directive(directive: Directive) -> bytes:
    """Serialise a directive for the control socket."""
    return _encoder.encode(directive)


def decode_directive(payload: bytes) -> Directive:
    """Parse a directive; raises `msgspec.DecodeError` / `ValidationError` with the bad field."""
    return _decoder.decode(payload)
