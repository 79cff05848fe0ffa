"""`warply` command line: one module per verb, each with a `register(subparsers)`.

Exit codes: 0 done, 1 a runtime failure (e.g. the router cannot be reached), 2 a usage or
configuration error; failures are one line on stderr (`admin.CliError`), never a traceback."""

from __future__ import annotations

import argparse
import sys

from warply import __version__
from warply.cli import bench, demo, export, stats, up, watch, where
from warply.cli.admin import CliError

_VERBS = (up, stats, where, export, watch, bench, demo)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="warply", description="Warply: KV-cache control plane.")
    ap.add_argument("--version", action="version", version=f"warply {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    for verb in _VERBS:
        verb.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `warply` console script."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        code: int = args.func(args)
    except CliError as exc:
        print(f"warply {args.command}: {exc}", file=sys.stderr)
        return exc.code
    return code


if __name__ == "__main__":
    sys.exit(main())
