"""`warply demo`: the project's main job (scripts/demo.py) on this machine: builds the local
model, then runs two real vLLM CPU engines behind `warply-router` per strategy and compares
their cache statistics. `bash scripts/setup_envs.sh core vllm` installs what it needs.
It needs a source checkout (the demo and its workload live under scripts/)."""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from warply.cli.admin import RUNTIME, USAGE, CliError

_ROOT = Path(__file__).resolve().parents[2]
_DEMO = _ROOT / "scripts" / "demo.py"
_MODEL = _ROOT / "scripts" / "tiny_model.py"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `demo` verb."""
    d = sub.add_parser(
        "demo",
        help="run the demo: two vLLM CPU engines behind warply-router, strategies compared",
        description="Build the local model (scripts/tiny_model.py), then run scripts/demo.py: "
        "two `vllm serve` engines behind warply-router for each strategy in turn, a multi-turn "
        "workload from the Mooncake trace, and the routers' cache statistics side by side. "
        "Other options go to scripts/demo.py (--strategy, --conversations, --turns, --workdir, "
        "...). Needs a source checkout and a vLLM install (`bash scripts/setup_envs.sh core "
        "vllm`).",
    )
    d.add_argument(
        "--model",
        default="tiny",
        help="tiny (~1M parameters, default), small (~90M) or a model folder",
    )
    d.add_argument(
        "--vllm",
        help="the vllm command (default: .venvs/vllm/bin/vllm of the checkout, else on PATH)",
    )
    d.set_defaults(func=_demo, passthrough=True)


def _demo(args: argparse.Namespace) -> int:
    if not _DEMO.is_file():
        raise CliError(f"the demo needs a source checkout ({_DEMO} not found)", USAGE)
    vllm = args.vllm or _default_vllm()
    if vllm is None or not Path(vllm).is_file():
        raise CliError(
            f"no vllm command ({vllm or 'none on PATH'}): pass --vllm, or run "
            "`bash scripts/setup_envs.sh vllm`, which installs it",
            USAGE,
        )
    model = args.model if Path(args.model).is_dir() else _build_model(args.model, Path(vllm))
    cmd = [sys.executable, str(_DEMO), "--vllm", str(vllm), "--model", model, *args.extra]
    code = _run_forwarding_signals(cmd)
    return code if code in (0, USAGE) or code > 128 else RUNTIME  # > 128: ended by a signal


def _run_forwarding_signals(cmd: list[str]) -> int:
    """Run the demo and wait for it. SIGTERM and SIGHUP are passed on to it, and Ctrl-C (which
    the terminal sends it as well) is left to it, so that it stops its engines and router
    itself: `subprocess.call` would SIGKILL it on any of them and leave those running."""
    proc = subprocess.Popen(cmd)
    handlers = {
        sig: signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
        for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return proc.wait()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _default_vllm() -> str | None:
    local = _ROOT / ".venvs" / "vllm" / "bin" / "vllm"
    return str(local) if local.is_file() else shutil.which("vllm")


def _build_model(size: str, vllm: Path) -> str:
    """The folder of the local model of `size`, built once by the engine's interpreter."""
    if size not in ("tiny", "small"):
        raise CliError(f"--model {size!r}: not tiny, small or a model folder", USAGE)
    python = vllm.parent / "python"
    done = subprocess.run(
        [str(python if python.is_file() else sys.executable), str(_MODEL), "--size", size],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise CliError(f"building the {size} model failed (scripts/tiny_model.py, see above)")
    return lines[-1]
