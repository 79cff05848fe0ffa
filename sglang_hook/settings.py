"""`--enable-warply` and its `--warply-*` options: parsed on SGLang's own parser, turned into a
`--kv-events-config` that selects the `warply` event publisher, and carried to the scheduler
processes on the `ServerArgs` record. A server started without `--enable-warply` is unchanged.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from warply.common.argtypes import fraction, positive
from warply.protocol.endpoints import GRAMMAR, endpoint_arg
from warply.protocol.plugin import CONTROL_TOKEN_ENV, CONTROL_TOKEN_MIN_CHARS, PluginSettings

SGLANG_VERSION = "0.5.23"
"""The SGLang release whose internals the hooks target."""

PUBLISHER_NAME = "warply"
"""`--kv-events-config '{"publisher": "warply", ...}'` selects the Warply publisher."""

_SETTINGS_ATTR = "_warply_settings"


@dataclass(frozen=True, kw_only=True)
class WarplySettings(PluginSettings):
    """What `--enable-warply` configures: the shared plugin settings
    (`warply.protocol.plugin.PluginSettings`, the same names as the vLLM plugin's JSON keys),
    pickled to scheduler processes with `ServerArgs`. Flags: `--warply-router` →
    `events_endpoint` (the PUB socket connects to the router's collector), `--warply-replay` →
    `replay_endpoint`, `--warply-control` → `control_endpoint`. An empty `worker` means
    `HOST:PORT` of the SGLang server."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add `--enable-warply` and the `--warply-*` options to SGLang's parser."""
    group = parser.add_argument_group("Warply", "KV-cache state export and directives (Warply)")
    group.add_argument(
        "--enable-warply",
        action="store_true",
        help="Publish radix-cache state to a Warply router and apply its directives.",
    )
    group.add_argument(
        "--warply-router",
        type=endpoint_arg,
        help=f"The state stream's endpoint (events_endpoint; {GRAMMAR}): the router's "
        "collector, e.g. tcp://HOST:PORT (required with --enable-warply).",
    )
    group.add_argument(
        "--warply-control",
        type=endpoint_arg,
        help=f"Bind a directive socket here (control_endpoint; {GRAMMAR}); omit to accept no "
        "directives.",
    )
    group.add_argument(
        "--warply-replay",
        type=endpoint_arg,
        help="Bind a state-stream replay socket here (replay_endpoint).",
    )
    group.add_argument(
        "--warply-control-token",
        default="",
        help="Apply only directives signed with this token (control_token: the router's "
        f"control_token, >= {CONTROL_TOKEN_MIN_CHARS} characters; default: ${CONTROL_TOKEN_ENV}, "
        "which keeps it off the command line).",
    )
    group.add_argument("--warply-worker", default="", help="Worker id (default: HOST:PORT).")
    group.add_argument(
        "--warply-model", default="", help="Model name seeding canonical keys (default: served)."
    )
    group.add_argument("--warply-topic", default="", help="ZMQ topic of the state stream.")
    group.add_argument(
        "--warply-snapshot-interval",
        type=positive(float),
        default=1.0,
        help="Load snapshot period (s).",
    )
    group.add_argument(
        "--warply-max-pinned-fraction",
        type=fraction,
        default=0.5,
        help="Pins may hold at most this share of the KV pool.",
    )


def settings_from_args(args: argparse.Namespace) -> WarplySettings | None:
    """The settings `args` ask for, or None without `--enable-warply`; SystemExit if incomplete."""
    if not getattr(args, "enable_warply", False):
        given = [f"--warply-{n}" for n in ("router", "control", "replay")
                 if getattr(args, f"warply_{n}", None)]  # fmt: skip
        if given:  # the plugin would stay off without a word
            raise SystemExit(f"error: {', '.join(given)} given without --enable-warply")
        return None
    if not args.warply_router:
        raise SystemExit("error: --enable-warply needs --warply-router tcp://HOST:PORT")
    token = {"control_token": args.warply_control_token} if args.warply_control_token else {}
    return WarplySettings(
        **token,
        events_endpoint=args.warply_router,
        control_endpoint=args.warply_control,
        replay_endpoint=args.warply_replay,
        worker=args.warply_worker or f"{args.host}:{args.port}",
        model=args.warply_model or args.served_model_name or args.model_path,
        topic=args.warply_topic,
        snapshot_interval_s=args.warply_snapshot_interval,
        max_pinned_fraction=args.warply_max_pinned_fraction,
    )


def kv_events_config(settings: WarplySettings) -> str:
    """The `--kv-events-config` JSON that selects the Warply publisher with these settings."""
    config: dict[str, Any] = {
        "publisher": PUBLISHER_NAME,
        "endpoint": settings.events_endpoint,
        "topic": settings.topic,
    }
    if settings.replay_endpoint:
        config["replay_endpoint"] = settings.replay_endpoint
    return json.dumps(config)


def settings_of(server_args: Any) -> WarplySettings | None:
    """The settings carried on a `ServerArgs` record (None: Warply is off)."""
    settings = getattr(server_args, _SETTINGS_ATTR, None)
    return settings if isinstance(settings, WarplySettings) else None


def _after_add_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser)


def _after_from_cli_args(server_args: Any, cls: type, args: argparse.Namespace) -> None:
    settings = settings_from_args(args)
    if settings is None:
        return
    existing = server_args.kv_events_config
    if existing and json.loads(existing).get("publisher") != PUBLISHER_NAME:
        raise SystemExit(
            "error: --enable-warply publishes through SGLang's KV-event pump; drop "
            "--kv-events-config or set its publisher to 'warply'"
        )
    server_args.kv_events_config = kv_events_config(settings)
    # SGLang 0.5.23 pickles underscore attributes of ServerArgs to child processes
    # (ServerArgs.__reduce__), the way `_launch_command` travels; the settings ride along.
    setattr(server_args, _SETTINGS_ATTR, settings)


HOOKS = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", _after_from_cli_args),
)
"""AFTER hooks on SGLang 0.5.23's `ServerArgs` (target, function)."""
