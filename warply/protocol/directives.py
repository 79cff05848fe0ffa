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
    QUOTA = "quota"
    """Cap the KV bytes one namespace may hold on one tier of the worker (`quota_bytes` on
    `tier`; None = every tier). No prefix: it applies to the whole namespace. A plugin whose
    engine or backend cannot enforce it answers with a rejection that says why."""


class Directive(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One command for the blocks of one prefix.

    The prefix is given by `token_ids` (the plugin hashes it the engine's way) or by canonical
    `keys`; at least one must be set. `tier` is the target tier (prefetch: promote to it;
    offload: demote to it; pin/evict: the tier it applies to, None = wherever it lives).
    `ttl_s` bounds a pin (0 = until unpinned). `namespace` is the cache salt the prefix lives in.
    A `quota` directive names no prefix: it carries `quota_bytes` for `namespace` on `tier`.
    """

    id: str
    kind: DirectiveKind
    token_ids: list[int] | None = None
    keys: list[int] | None = None
    tier: Tier | None = None
    ttl_s: float = 0.0
    namespace: str = ""
    quota_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.ttl_s < 0:
            raise ValueError("`ttl_s` must be >= 0")
        if self.kind is DirectiveKind.QUOTA:
            if self.quota_bytes is None or self.quota_bytes < 0:
                raise ValueError("a quota directive needs `quota_bytes` >= 0")
            if self.token_ids or self.keys:
                raise ValueError("a quota directive applies to a namespace, not to a prefix")
            return
        if self.quota_bytes is not None:
            raise ValueError(f"`quota_bytes` belongs to quota directives, not {self.kind.value}")
        if not self.token_ids and not self.keys:
            raise ValueError("a directive needs `token_ids` or `keys`")


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Directive)


def encode_directive(directive: Directive) -> bytes:
    """Serialise a directive for the control socket."""
    return _encoder.encode(directive)


def decode_directive(payload: bytes) -> Directive:
    """Parse a directive; raises `msgspec.DecodeError` / `ValidationError` with the bad field."""
    return _decoder.decode(payload)
