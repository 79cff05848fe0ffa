"""`warply bench replay|live`: the trace replayer, run as `python -m replay`."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `bench` verb."""
    b = sub.add_parser(
        "bench",
        help="replay a request trace: simulated engines (replay) or a live endpoint (live)",
        description="`warply bench replay TRACE ...`: the router's index and strategies over "
        "simulated engines; `warply bench live --url URL TRACE ...`: against a running "
        "OpenAI-compatible endpoint. `warply bench replay --help` lists the options.",
    )
    b.add_argument("mode", choices=("replay", "live"), help="replay or live")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of that mode")
    b.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    """Run the trace replayer (`python -m replay`) in a subprocess of this interpreter.

    The SDK never imports the router; the replayer parses and validates its own arguments.
    """
    import subprocess

    return subprocess.call([sys.executable, "-m", "replay", args.mode, *args.rest])
