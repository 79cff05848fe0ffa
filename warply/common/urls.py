"""HTTP base URLs given in configs and flags (workers, the router, a live endpoint): one check,
so that a typo is named where it is written, not met later as a refused connection."""

from __future__ import annotations

from urllib.parse import urlsplit


def check_http_url(url: str, schemes: tuple[str, ...] = ("http", "https")) -> str:
    """`url` unchanged when it is SCHEME://HOST[:PORT][/PATH] with a scheme of `schemes`, a host
    and a port in range; else a ValueError saying what is wrong (the caller names the field)."""
    want = f"write {schemes[0]}://HOST:PORT"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- urllib raises ValueError for a port out of range or not a number
    except ValueError as exc:  # also a malformed IPv6 host
        raise ValueError(f"{exc} ({want})") from None
    if parts.scheme not in schemes or not parts.hostname or any(c.isspace() for c in url):
        raise ValueError(f"not an {' or '.join(schemes)} URL with a host ({want})")
    return url
