"""Schema of `kv_connector_extra_config` for WarplyConnector, validated once at start-up.

    {"delegate": {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {...}},
     "warply": {"events_endpoint": "tcp://*:5557", "control_endpoint": "tcp://127.0.0.1:5560"}}

Any error (unknown key, bad endpoint, unknown delegate) raises `WarplyConfigError` with one line
that names the offending key, which fails vLLM start-up.

Under the short connector name `warply` (`SHORT_NAME`), every endpoint the `warply` section does
not mention takes its default (`warply.protocol.plugin.DEFAULT_ENDPOINTS`), so
`{"kv_connector": "warply"}` alone is a complete configuration; an endpoint given as `null` stays
off. Under `WarplyConnector` nothing is defaulted: an endpoint left out is off, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from warply.protocol.plugin import DEFAULT_ENDPOINTS, PluginSettings, SettingsError

_PREFIX = "WarplyConnector: invalid kv_connector_extra_config"

SHORT_NAME = "warply"
"""The connector's short name in `--kv-transfer-config`: WarplyConnector with default endpoints."""


class WarplyConfigError(ValueError):
    """A configuration error; the message names the key (e.g. `warply.events_endpoint`)."""


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
        if value in ("WarplyConnector", "WarplyHMAConnector", SHORT_NAME):
            raise ValueError("a WarplyConnector cannot delegate to another WarplyConnector")
        return value


@dataclass(frozen=True, kw_only=True)
class WarplySettings(PluginSettings):
    """Warply's own part: the shared plugin settings (`warply.protocol.plugin.PluginSettings`:
    `events_endpoint`, `replay_endpoint`, `control_endpoint`, `topic`, `worker`, `model`,
    `snapshot_interval_s`, `max_pinned_fraction`) and vLLM's extras. An empty `worker` means
    vLLM's kv engine_id."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    replay_buffer_steps: int = 10_000
    """Batches the replay socket keeps, > 0."""
    lmcache_url: str = ""
    """HTTP base URL of the LMCache MP server behind an LMCacheMPConnector delegate
    (`http://127.0.0.1:8080`): its `/status` bytes go out as the cpu tier's in load snapshots,
    and evict directives on the cpu tier go to its `/cache/objects`. Empty: neither."""
    mooncake_url: str = ""
    """HTTP admin URL of the Mooncake master behind a MooncakeStoreConnector delegate (its
    `-metrics_port`: `http://127.0.0.1:9003`): its `master_allocated_bytes` go out as the cpu
    tier's bytes, and cpu-tier evict / pin / unpin directives act on the store's objects of the
    prefix (through a store client set up from `MOONCAKE_CONFIG_PATH`). Empty: neither."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.replay_buffer_steps <= 0:
            raise SettingsError("replay_buffer_steps", "must be greater than 0")
        for name in ("lmcache_url", "mooncake_url"):
            url = getattr(self, name)
            if url and not url.startswith(("http://", "https://")):
                raise SettingsError(name, "must be an http:// or https:// URL")
        if self.lmcache_url and self.mooncake_url:
            raise SettingsError("mooncake_url", "one delegate backend: drop lmcache_url or this")


class WarplyConnectorConfig(_Strict):
    """All of `kv_connector_extra_config`."""

    delegate: DelegateConfig | None = None
    warply: WarplySettings = Field(default_factory=WarplySettings)


def parse_config(extra_config: dict[str, Any], defaults: bool = False) -> WarplyConnectorConfig:
    """Validate `kv_connector_extra_config`; raise `WarplyConfigError` naming the first bad key.
    `defaults`: fill the endpoints the `warply` section leaves out (the short name's rule)."""
    section = extra_config.get("warply", {})
    if defaults and isinstance(section, dict):
        extra_config = {**extra_config, "warply": {**DEFAULT_ENDPOINTS, **section}}
    try:
        return WarplyConnectorConfig.model_validate(extra_config)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            raise WarplyConfigError(f"{_PREFIX}: unknown key {'.'.join(loc)!r}") from None
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, SettingsError):  # a shared-settings check: name its field
            loc.append(cause.field)
        key = ".".join(loc) or "<root>"
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise WarplyConfigError(f"{_PREFIX}: {key}: {msg}") from None


def config_error(key: str, message: str) -> WarplyConfigError:
    """A config error found after schema validation (e.g. an unregistered delegate)."""
    return WarplyConfigError(f"{_PREFIX}: {key}: {message}")
