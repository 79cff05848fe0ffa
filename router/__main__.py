"""`warply-router` / `python -m router`: the router process.

    warply-router --config router.yaml
    warply-router --config router.yaml --check    # validate and build it, print a summary, exit
    warply-router --model tiny --tokenizer MODEL_DIR --block-size 32 \\
        --worker http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558 \\
        --worker http://127.0.0.1:8002,events=tcp://127.0.0.1:5567 --strategy prefix_affinity

Flags override the file's fields of the same name; `--worker` flags replace the file's pools
with one pool named "default". A bad configuration prints one message naming the field and
exits with status 2; an address it cannot listen on (a port in use, a host not of this machine),
one line and status 1.

SIGTERM or SIGINT stops it: new connections are refused at once, the requests in flight may
finish for `drain_timeout_s` (15 s by default), each one still open then ends with a 503 (an
error event on a started stream), and it exits 0.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from router.access_log import AccessLog, keep_requests_out_of_logs
from router.app import Router
from router.chat_template import names_file
from router.config import CLI_FIELDS, ConfigError, IndexConfig, RouterConfig, load_config
from router.drain import GRACE_S
from router.index import StoreUnavailable, shown_url
from router.tokenize import TokenizerError

_WORKER_KEYS = {"name", "events", "replay", "topic", "control", "bind"}
_SCHEMES = ("http://", "https://")
"""What a worker's URL starts with (`WorkerConfig.url`: `warply.common.urls.check_http_url`)."""


def _worker_flag(spec: str, n: int) -> dict[str, Any]:
    """`URL[,key=value...]` → a worker mapping (validated later with the rest)."""
    url, *parts = spec.split(",")
    if not url.startswith(_SCHEMES):
        name, _, address = url.rpartition("=")
        if not address.startswith(_SCHEMES):
            address = "http://" + (address.partition("://")[2] or address or "127.0.0.1:8001")
        example = f"{address},name={name or f'w{n}'}"
        raise ConfigError(
            f"--worker {spec!r}: write the worker's URL (http://HOST:PORT) first, then "
            f"key=value parts, e.g. {example}"
        )
    worker: dict[str, Any] = {"name": f"w{n}", "url": url}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in _WORKER_KEYS:
            raise ConfigError(
                f"--worker {spec!r}: expected key=value with key in {sorted(_WORKER_KEYS)}"
            )
        worker[key] = value.lower() in ("1", "true", "yes") if key == "bind" else value
    return worker


def fixed_mmap_threshold() -> None:
    """Give glibc's malloc a fixed mmap threshold of 128 KiB (what `MALLOC_MMAP_THRESHOLD_=131072`
    does), unless the environment sets one: with glibc's dynamic threshold, large buffers freed
    once (bodies, token lists) raise it and later ones stay in the main arena, whose RSS then
    creeps up under steady load (docs/reliability.md, "Where the memory goes")."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to set
        return
    libc.mallopt(-3, 128 * 1024)  # -3: M_MMAP_THRESHOLD (malloc.h)


def collect_less() -> None:
    """The garbage collector's settings once start-up is done (bench/router_decision.py uses
    them too)."""
    # Move everything built so far (modules, config, the index's container) out of the garbage
    # collector's reach: the index holds only GC-untracked dicts of ints, but a full collection
    # would still walk its million-entry OrderedDict (~60 ms here) on the event loop.
    gc.freeze()
    # A request allocates a few hundred tracked objects: at the default threshold (700) the
    # youngest generation was collected every other request (~25 µs of CPU per request, and a
    # full collection every ~100), at 10,000 every ~30 requests, for a few MiB more garbage.
    gc.set_threshold(10_000, 10, 10)


def _field_help(name: str) -> str | None:
    """A flag's help: the first sentence of its config field's description."""
    if name == "index_max_entries":
        field = IndexConfig.model_fields["max_entries"]
    else:
        field = RouterConfig.model_fields[name]
    sentence = " ".join((field.description or "").split()).split(". ")[0].rstrip(".")
    return sentence.replace("%", "%%") or None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="warply-router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", type=Path, help="YAML (.yaml/.yml) or TOML (.toml) config file")
    for name, kind in CLI_FIELDS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, help=_field_help(name))
    ap.add_argument("--strategy", help="builtin name, warply.strategies entry point, module:Class")
    ap.add_argument("--knobs", help="strategy knobs as a JSON object")
    ap.add_argument(
        "--default-chat-template-kwargs",
        metavar="JSON",
        help=f"{_field_help('default_chat_template_kwargs')} (a JSON object)",
    )
    ap.add_argument("--min-hit-ratio", type=float, help="alert below this windowed hit rate")
    ap.add_argument(
        "--worker",
        action="append",
        default=[],
        help="URL[,name=,events=,replay=,topic=,control=,bind=] (repeatable)",
    )
    ap.add_argument(
        "--lora-adapter",
        action="append",
        default=[],
        metavar="NAME",
        help="a LoRA adapter the engines serve (repeatable); requests may name it in `model`",
    )
    ap.add_argument(
        "--cors-allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="an origin (https://host[:port], or '*') whose web pages may call the client API "
        "(repeatable; replaces the file's cors_allowed_origins)",
    )
    ap.add_argument(
        "--trust-request-chat-template",
        action="store_const",
        const=True,
        help=_field_help("trust_request_chat_template"),
    )
    ap.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_const",
        const=True,
        help=_field_help("exclude_tools_when_tool_choice_none"),
    )
    ap.add_argument("--block-size", type=int, help="block size of the --worker pool")
    ap.add_argument("--kv-bytes-per-token", type=int, default=0, help="for bytes-cached metrics")
    ap.add_argument(
        "--check",
        action="store_true",
        help="validate the configuration and build what it names (tokenizer, strategies, tier "
        "policy, shared store), print a summary and exit: 0 when it would serve, 2 when not; "
        "workers are not contacted",
    )
    ap.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="level of the log on stderr",
    )
    return ap


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The flags and the config file as one validated config; raises `ConfigError`."""
    overrides: dict[str, Any] = {name: getattr(args, name) for name in CLI_FIELDS}
    if args.lora_adapter:
        overrides["lora_adapters"] = args.lora_adapter
    for flag in ("trust_request_chat_template", "exclude_tools_when_tool_choice_none"):
        if getattr(args, flag):
            overrides[flag] = True
    if args.cors_allowed_origin:
        overrides["cors_allowed_origins"] = args.cors_allowed_origin
    if args.worker:
        if args.block_size is None:
            raise ConfigError(
                "--worker needs --block-size: the engines' KV block size (vLLM --block-size, "
                "SGLang --page-size)"
            )
        overrides["pools"] = [
            {
                "name": "default",
                "block_size": args.block_size,
                "kv_bytes_per_token": args.kv_bytes_per_token,
                "workers": [_worker_flag(s, i) for i, s in enumerate(args.worker)],
            }
        ]
    elif args.block_size is not None:
        raise ConfigError("--block-size applies to --worker flags; set pools[].block_size instead")
    knobs = None if args.knobs is None else _json_flag("--knobs", args.knobs)
    if args.default_chat_template_kwargs is not None:
        overrides["default_chat_template_kwargs"] = _json_flag(
            "--default-chat-template-kwargs", args.default_chat_template_kwargs
        )
    return load_config(
        args.config,
        overrides,
        strategy=args.strategy,
        knobs=knobs,
        min_hit_ratio=args.min_hit_ratio,
    )


def _json_flag(flag: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} is not valid JSON: {exc}") from None


def _summary(config: RouterConfig) -> str:
    """What a valid configuration serves, one line per part (`--check`)."""
    index = config.index
    url = shown_url(index.url or "")
    shared = f" {url} prefix {index.prefix!r}" if url else ""
    lines = [
        f"ok: {config.model} on http://{config.host}:{config.port}, tokenizer {config.tokenizer}",
        f"strategy {config.strategy.name} {json.dumps(config.strategy.knobs, default=str)}",
        f"index {index.store}{shared}, max {index.max_entries} entries",
    ]
    if config.chat_template is not None:
        named = names_file(config.chat_template)
        shown = config.chat_template if named else "given as text"
        lines.append(f"chat template {shown} (not the tokenizer folder's)")
    chat = [
        f"content format {config.chat_template_content_format}"
        if config.chat_template_content_format != "auto" else "",
        f"template defaults {json.dumps(config.default_chat_template_kwargs)}"
        if config.default_chat_template_kwargs else "",
        "tools left out for tool_choice none" if config.exclude_tools_when_tool_choice_none else "",
        f"thinking disabled as effort {config.anthropic_disabled_thinking_effort}"
        if config.anthropic_disabled_thinking_effort != "auto" else "",
        f"SGLang's named template {config.hf_chat_template_name}"
        if config.hf_chat_template_name else "",
    ]  # fmt: skip
    if any(chat):
        lines.append("chat: " + ", ".join(c for c in chat if c))
    for pool in config.pools:
        names = ", ".join(f"{w.name} {w.url}" for w in pool.workers)
        lines.append(f"pool {pool.name} ({pool.role}, block {pool.block_size}): {names}")
    if config.tiering is not None:
        lines.append(f"tiering {config.tiering.policy.name} every {config.tiering.interval_s} s")
    auth = "admin token" if config.auth_token else "no admin token"
    control = "signed directives" if config.control_token else "unsigned directives"
    lines.append(f"{auth}, {control}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Validate, build, serve until SIGINT/SIGTERM, then drain (with `--check`: validate, build,
    exit)."""
    args = _parser().parse_args(argv)
    try:
        config = config_from_args(args)
        router = Router(config)
    except ConfigError as exc:
        print(f"warply-router: {exc}", file=sys.stderr)
        return 2
    except TokenizerError as exc:
        print(f"warply-router: tokenizer: {exc}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:
        print(f"warply-router: index.url: cannot reach the shared store: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(_summary(config))
        return 0
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    keep_requests_out_of_logs()
    collect_less()
    fixed_mmap_threshold()

    def serving(_: str) -> None:  # aiohttp calls it once the listener is bound
        logging.getLogger("warply.router").info(
            "serving %s on http://%s:%d (%d workers, strategy %s)",
            config.model,
            config.host,
            config.port,
            len(router.workers),
            config.strategy.name,
        )

    try:
        web.run_app(
            router.app,
            host=config.host,
            port=config.port,
            handler_cancellation=True,
            # The requests in flight were waited for, then ended, in the app's drain
            # (`router.drain`); aiohttp's own wait (60 s, twice, by default) is only a backstop.
            shutdown_timeout=GRACE_S,
            # aiohttp's default accept backlog (128) overflowed when hundreds of clients
            # connected at once (the soak's 500: a few ClientOSErrors that never reached the
            # router); the kernel caps it at net.core.somaxconn.
            backlog=4096,
            print=serving,
            access_log_class=AccessLog,
            loop=uvloop.new_event_loop(),  # libuv's loop: about a third less CPU per request
        )
    except OSError as exc:  # binding the listener: a port in use or not allowed, a foreign host
        where = f"{config.host}:{config.port}"
        print(f"warply-router: cannot listen on {where}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
