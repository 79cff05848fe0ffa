"""Schema of `kv_connector_extra_config` for WarplyConnector, validated once at start-up.

    {"delegate": {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {...}},
     "warply": {"events_endpoint": "tcp://*:5557", "control_endpoint": "tcp://127.0.0.1:5560"}}

Any error (unknown key, bad endpoint, unknown delegate) raises `WarplyConfigError` with one line
that names the offending key, which fails vLLM start-up.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

_ENDPOINT = re.compile(r"^tcp://(?P<host>\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>\d{1,5})$")
_PREFIX = "WarplyConnector: invalid kv_connector_extra_config"


class WarplyConfigError(ValueError):
    """A configuration error; the message names the key (e.g. `warply.events_endpoint`)."""


def _check_endpoint(value: str | None) -> str | None:
    if value is None:
        return None
    if value.startswith(("ipc://", "inproc://")) and len(value.split("://", 1)[1]) > 0:
        return value
    match = _ENDPOINT.match(value)
    if match is None:
        raise ValueError(f"{value!r} is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)")
    if not 0 < int(match["port"]) < 65536:
        raise ValueError(f"port {match['port']} out of range in {value!r}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DelegateConfig(_Strict):
    """The wrapped connector: the same fields as vLLM's own `--kv-transfer-config` for it.

    Fields left out (kv_role, kv_buffer_device, engine_id, ...) are inherited from the outer
    WarplyConnector config.
    """

    kv_connector: str
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] | None = None
    kv_buffer_device: str | None = None

    @field_validator("kv_connector")
    @classmethod
    def _not_self(cls, value: str) -> str:
        if value in ("WarplyConnector", "WarplyHMAConnector"):
            raise ValueError("a WarplyConnector cannot delegate to another WarplyConnector")
        return value


class WarplySettings(_Strict):
    """Warply's own part: where state goes, where directives come from, and limits."""

    events_endpoint: str | None = None
    """State stream PUB socket. `tcp://*:P` binds; a concrete address connects to a collector."""
    replay_endpoint: str | None = None
    """ROUTER socket (always binds) serving replays of the state stream."""
    control_endpoint: str | None = None
    """ROUTER socket (always binds) receiving directives; each is answered on it."""
    topic: str = ""
    worker: str = ""
    """Worker id stamped on batches; empty = vLLM's kv engine_id."""
    model: str = ""
    """Model name seeding canonical keys (must match the router's); empty = served model name."""
    snapshot_interval_s: float = Field(default=1.0, gt=0)
    max_pinned_fraction: float = Field(default=0.5, ge=0, le=1)
    """Pins may hold at most this share of the device blocks (protects the scheduler)."""
    replay_buffer_steps: int = Field(default=10_000, gt=0)

    _endpoints = field_validator(
        "events_endpoint", "replay_endpoint", "control_endpoint"
    )(_check_endpoint)


class WarplyConnectorConfig(_Strict):
    """All of `kv_connector_extra_config`."""

    delegate: DelegateConfig | None = None
    warply: WarplySettings = Field(default_factory=WarplySettings)


def parse_config(extra_config: dict[str, Any]) -> WarplyConnectorConfig:
    """Validate `kv_connector_extra_config`; raise `WarplyConfigError` naming the first bad key."""
    try:
        return WarplyConnectorConfig.model_validate(extra_config)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            raise WarplyConfigError(f"{_PREFIX}: unknown key {key!r}") from None
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise WarplyConfigError(f"{_PREFIX}: {key}: {msg}") from None


def config_error(key: str, message: str) -> WarplyConfigError:
    """A config error found after schema validation (e.g. an unregistered delegate)."""
    return WarplyConfigError(f"{_PREFIX}: {key}: {message}")
