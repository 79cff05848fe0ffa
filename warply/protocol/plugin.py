"""The engine-plugin contract: what a Warply plugin does inside an engine, and its settings.

A plugin (vLLM: `vllm_connector`, SGLang: `sglang_hook`) runs on the engine's scheduler thread
and never blocks it, never raises into it, and never moves KV blocks itself. It

- publishes the engine's cache state on the **state stream** (`events_endpoint`, ZMQ PUB,
  frames `[topic, seq, payload]`, payload `warply.protocol.events.EventBatch` stamped with
  `worker`): `BlockStored` / `BlockRemoved` / `AllCleared` per tier, normalised by
  `warply.protocol.normalize` (events it cannot place on a tier are skipped and counted),
  `PrefixHit`s where the engine reports them, a `LoadSnapshot` every `snapshot_interval_s`;
- serves the stream's recent batches on the **replay socket** (`replay_endpoint`, ROUTER,
  always binds; `warply.protocol.publisher`) so a subscriber can fill a gap;
- applies directives from the **directive socket** (`control_endpoint`, ROUTER, always binds;
  `warply.protocol.control`) between scheduler steps, answers each with a `DirectiveAck` on that
  socket and on the state stream, and keeps pins within `max_pinned_fraction` of the pool; with
  a `control_token`, only signed, fresh, never-replayed directives are applied;
- keys blocks by `warply.protocol.keys` seeded with `model`, which must be the router's.

`PluginSettings` holds what both plugins share, under the same names: the vLLM plugin reads them
from `kv_connector_extra_config["warply"]` (JSON keys as below), the SGLang plugin from its
`--warply-*` flags. Each plugin subclasses it for engine-specific extras. It is a plain frozen
dataclass (picklable: SGLang carries it to its scheduler processes), validated on construction.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from warply.protocol.endpoints import EndpointError, check_endpoint, parse_endpoint

CONTROL_TOKEN_ENV = "WARPLY_CONTROL_TOKEN"
"""Where `control_token` is read from when the settings do not give one (keeps the secret off
the engine's command line)."""
CONTROL_TOKEN_MIN_CHARS = 16
"""The shortest control token the plugins and the router take."""

_log = logging.getLogger(__name__)


def _env_token() -> str:
    return os.environ.get(CONTROL_TOKEN_ENV, "")


DEFAULT_ENDPOINTS = {
    "events_endpoint": "tcp://127.0.0.1:5557",
    "events_bind": True,
    "replay_endpoint": "tcp://127.0.0.1:5558",
    "control_endpoint": "tcp://127.0.0.1:5560",
}
"""A plugin's endpoints when the user names none (vLLM's short connector name `warply`): every
socket binds on loopback only (a router on another host is told otherwise: `tcp://*:P`)."""

LOCAL_EVENTS_ENDPOINT = str(DEFAULT_ENDPOINTS["events_endpoint"])
LOCAL_REPLAY_ENDPOINT = str(DEFAULT_ENDPOINTS["replay_endpoint"])
"""Where a subscriber on the engine's host reaches the default stream and its replay."""


class SettingsError(ValueError):
    """An invalid setting; `field` names it (e.g. `events_endpoint`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, kw_only=True)
class PluginSettings:
    """Settings every Warply engine plugin understands (see the module docstring)."""

    events_endpoint: str | None = None
    """State stream PUB socket. `tcp://*:P` binds; a concrete address connects to a collector."""
    events_bind: bool | None = None
    """Bind (True) or connect (False) `events_endpoint` whatever its host; None: the rule above."""
    replay_endpoint: str | None = None
    """ROUTER socket (always binds) serving replays of the state stream."""
    control_endpoint: str | None = None
    """ROUTER socket (always binds) receiving directives; each is answered on it."""
    topic: str = ""
    """ZMQ topic of the state stream."""
    worker: str = ""
    """Worker id stamped on batches; empty = the plugin's default (engine id, HOST:PORT)."""
    model: str = ""
    """Model name seeding canonical keys (must match the router's); empty = served model name."""
    snapshot_interval_s: float = 1.0
    """Period of `LoadSnapshot` events (s), > 0."""
    max_pinned_fraction: float = 0.5
    """Pins may hold at most this share of the device blocks (protects the scheduler)."""
    control_token: str = field(default_factory=_env_token, repr=False)
    """The router's `control_token`: the directive socket then applies only directives signed
    with it, fresh and never seen before (`warply.protocol.control`). Empty: unsigned
    directives are taken. Default: the `WARPLY_CONTROL_TOKEN` environment variable."""

    def __post_init__(self) -> None:
        for name in ("events_endpoint", "replay_endpoint", "control_endpoint"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                check_endpoint(value)
            except EndpointError as exc:
                raise SettingsError(name, str(exc)) from None
        if not self.snapshot_interval_s > 0:
            raise SettingsError("snapshot_interval_s", "must be greater than 0")
        if not 0 <= self.max_pinned_fraction <= 1:
            raise SettingsError("max_pinned_fraction", "must be between 0 and 1")
        if 0 < len(self.control_token) < CONTROL_TOKEN_MIN_CHARS:
            raise SettingsError(
                "control_token", f"must be at least {CONTROL_TOKEN_MIN_CHARS} characters"
            )
        control = self.control_endpoint
        if control and not self.control_token and parse_endpoint(control).wildcard:
            _log.warning(
                "Warply: directive socket %s listens on every interface without a "
                "control_token: anyone who reaches it can pin and evict this engine's cache",
                control,
            )
