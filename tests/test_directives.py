"""The directive wire type: prefix directives and the per-namespace quota."""

from __future__ import annotations

import pytest

from warply.protocol import Directive, DirectiveKind, Tier
from warply.protocol.directives import decode_directive, encode_directive


def test_quota_round_trips_and_names_no_prefix() -> None:
    quota = Directive("q", DirectiveKind.QUOTA, tier=Tier.CPU, namespace="a", quota_bytes=1 << 30)
    assert decode_directive(encode_directive(quota)) == quota


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": DirectiveKind.QUOTA}, "needs `quota_bytes` >= 0"),
        ({"kind": DirectiveKind.QUOTA, "quota_bytes": -1}, "needs `quota_bytes` >= 0"),
        ({"kind": DirectiveKind.QUOTA, "quota_bytes": 1, "keys": [1]}, "not to a prefix"),
        ({"kind": DirectiveKind.PIN, "keys": [1], "quota_bytes": 1}, "not pin"),
        ({"kind": DirectiveKind.PIN}, "needs `token_ids` or `keys`"),
        ({"kind": DirectiveKind.PIN, "keys": [1], "ttl_s": -1}, "`ttl_s` must be >= 0"),
    ],
)
def test_bad_directives_say_why(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Directive("d", **kwargs)  # type: ignore[arg-type]
