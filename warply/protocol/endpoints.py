"""The one grammar for ZMQ endpoints in Warply settings, and the bind-or-connect rule.

    tcp://HOST:PORT     HOST: a name, an IPv4 address, `[IPv6]`, or `*` (every interface)
    ipc://PATH
    inproc://NAME

Used by both engine plugins' settings (vLLM `kv_connector_extra_config`, SGLang `--warply-*`) and
by the publisher. Errors are one line that quotes the value.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

_TCP = re.compile(r"^tcp://(?P<host>\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>\d{1,5})$")
_TRANSPORTS = ("ipc://", "inproc://")

WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "[::]"})
"""Hosts that mean "every interface": a socket given one binds (vLLM 0.32 and SGLang 0.5.23
follow the same convention for their KV-event publishers)."""

GRAMMAR = "tcp://HOST:PORT, ipc://PATH"
"""The accepted forms, as error messages and help texts name them."""


class EndpointError(ValueError):
    """A value that is not an endpoint of the grammar above."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed endpoint; `str(endpoint)` is the text it was parsed from."""

    text: str
    transport: str
    """"tcp", "ipc" or "inproc"."""
    host: str | None = None
    port: int | None = None

    @property
    def wildcard(self) -> bool:
        """A tcp endpoint on every interface (`*`, `0.0.0.0`, `[::]`)."""
        return self.host in WILDCARD_HOSTS

    @property
    def binds(self) -> bool:
        """The engines' rule for a PUB socket: bind a wildcard host, ipc and inproc; connect
        to a concrete address (so one collector can bind it for many publishers)."""
        return self.transport != "tcp" or self.wildcard

    def __str__(self) -> str:
        return self.text


def parse_endpoint(value: str) -> Endpoint:
    """Parse `value`; raise `EndpointError` (one line, quoting it) when it is not an endpoint."""
    if not isinstance(value, str):
        raise EndpointError(f"{value!r} is not a ZMQ endpoint ({GRAMMAR})")
    for prefix in _TRANSPORTS:
        if value.startswith(prefix) and len(value) > len(prefix):
            return Endpoint(value, prefix.removesuffix("://"))
    match = _TCP.match(value)
    if match is None:
        raise EndpointError(f"{value!r} is not a ZMQ endpoint ({GRAMMAR})")
    port = int(match["port"])
    if not 0 < port < 65536:
        raise EndpointError(f"port {match['port']} out of range in {value!r}")
    return Endpoint(value, "tcp", match["host"], port)


def check_endpoint(value: str) -> str:
    """`value` unchanged if it is an endpoint; else `EndpointError`."""
    parse_endpoint(value)
    return value


def endpoint_arg(value: str) -> str:
    """argparse `type` for an endpoint: a bad one is a one-line usage error (the SGLang plugin's
    `--warply-*` flags, `warply watch`)."""
    try:
        return check_endpoint(value)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def binds(value: str) -> bool:
    """Whether a PUB socket given `value` binds (True) or connects (False); see `Endpoint.binds`.

    A value outside the grammar falls back to the engines' substring test (`*` or ipc/inproc
    binds), so a socket can still be opened on whatever ZMQ itself accepts.
    """
    try:
        return parse_endpoint(value).binds
    except EndpointError:
        return "*" in value or value.startswith(_TRANSPORTS)
