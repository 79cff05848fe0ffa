"""The router's admin API as CLI verbs reach it: `--router` / `--token` options, one HTTP call
decoded into its typed shape (`warply.protocol.api`), and failures as `CliError`s that
`warply.cli.main` prints as one line (exit 1: the router failed or cannot be reached; exit 2:
the request or the configuration is wrong, e.g. a bad token or an unknown model)."""

from __future__ import annotations

import argparse
import os
from typing import Any, TypeVar

from warply import admin
from warply.common.argtypes import positive
from warply.protocol.api import AUTH_TOKEN_ENV

_T = TypeVar("_T")

DEFAULT_ROUTER = "http://127.0.0.1:8000"
"""`warply-router`'s default address (`router.config.RouterConfig` host and port)."""

RUNTIME, USAGE = 1, 2
"""Exit codes: a runtime failure; a usage or configuration error (argparse's own code)."""


class CliError(Exception):
    """A failure a verb reports as one line, with its exit code."""

    def __init__(self, message: str, code: int = RUNTIME) -> None:
        super().__init__(message)
        self.code = code


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """`--router URL` and `--token TOKEN` (defaults from WARPLY_ROUTER and the router's own
    WARPLY_AUTH_TOKEN)."""
    parser.add_argument(
        "--router",
        default=os.environ.get("WARPLY_ROUTER", DEFAULT_ROUTER),
        help=f"the router's base URL (default: $WARPLY_ROUTER or {DEFAULT_ROUTER})",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get(AUTH_TOKEN_ENV),
        help=f"the router's admin token, when it has one (default: ${AUTH_TOKEN_ENV})",
    )
    parser.add_argument(
        "--timeout",
        type=positive(float),
        default=10.0,
        help="seconds to wait for the router (default 10)",
    )


def call(args: argparse.Namespace, path: str, shape: type[_T], body: Any = None) -> _T:
    """GET `path` (POST `body` as JSON when given) on `args.router`, decoded as `shape`."""
    try:
        return admin.call(args.router, path, shape, body, token=args.token, timeout=args.timeout)
    except admin.AdminError as exc:
        raise CliError(str(exc), USAGE if exc.usage else RUNTIME) from None
