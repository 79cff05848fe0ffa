"""`warply up SPEC.yaml` / `warply down`: start a deployment spec on this host and leave it
running (its state in the run folder), then stop it from another shell."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from warply.common.argtypes import output_folder, positive


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `up` and `down` verbs."""
    u = sub.add_parser(
        "up",
        help="start a deployment spec (engines, tier services, router) and leave it running",
        description="Start what SPEC describes on this host (the YAML of warply.Engine or "
        "warply.DisaggEngine, with `kind:`), wait until the router serves, print its URL and "
        "exit; the processes keep running until `warply down`. Exit codes: 0 up, 1 a component "
        "failed (its log's last lines are shown; nothing is left running), 2 a bad spec.",
    )
    u.add_argument("spec", type=Path, help="spec file (YAML)")
    u.add_argument("--vllm", help="the `vllm` program to run (default: found, see docs/sdk.md)")
    u.add_argument("--sglang-python", help="the Python with SGLang (backend sglang)")
    u.add_argument("--run-dir", type=output_folder, help="folder for logs and state (default: "
                   "~/.cache/warply/runs/TIME-PID)")  # fmt: skip
    u.add_argument(
        "--timeout", type=positive(float), default=600, help="seconds per stage (default 600)"
    )
    u.set_defaults(func=_up)
    d = sub.add_parser(
        "down",
        help="stop a deployment `warply up` started",
        description="Stop every process of the latest `warply up` (or of --run-dir), by the "
        "process ids in its state file. Exit codes: 0 stopped, 1 no running deployment.",
    )
    d.add_argument("--run-dir", type=Path, help="the run folder `warply up` printed")
    d.set_defaults(func=_down)


def _up(args: argparse.Namespace) -> int:
    from warply.lifecycle import UpError, up
    from warply.spec.deployment import SpecError, load_spec

    try:
        spec = load_spec(args.spec)
    except SpecError as exc:
        print(f"warply up: {exc}", file=sys.stderr)
        return 2
    try:
        running = up(spec, run_dir=args.run_dir, vllm=args.vllm,
                     sglang_python=args.sglang_python, timeout_s=args.timeout)  # fmt: skip
    except UpError as exc:
        print(f"warply up: {exc}", file=sys.stderr)
        return 1
    print(f"router:     {running.url}/v1 (model {spec.served_name!r})")
    print(f"run folder: {running.run_dir}")
    where = "" if args.run_dir is None else f" --run-dir {args.run_dir}"
    print(f"stop with:  warply down{where}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from warply.lifecycle import down

    try:
        stopped = down(args.run_dir)
    except FileNotFoundError as exc:
        print(f"warply down: {exc}", file=sys.stderr)
        return 1
    print(f"stopped {len(stopped)} process group(s)")
    return 0
