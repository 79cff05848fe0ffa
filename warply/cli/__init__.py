"""`warply` command line: one module per verb, each with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import sys

from warply import __version__
from warply.cli import bench, watch

_VERBS = (watch, bench)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="warply", description="Warply: KV-cache control plane.")
    ap.add_argument("--version", action="version", version=f"warply {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    for verb in _VERBS:
        verb.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `warply` console script."""
    args = _parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
