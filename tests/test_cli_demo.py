"""`warply demo`'s usage errors: one line, exit 2, before anything starts (the real run is
tests/vllm/test_cli_demo.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from warply.cli.demo import _run_forwarding_signals

ROOT = Path(__file__).resolve().parents[1]


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "warply", "demo", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_demo_without_vllm_is_a_usage_error(tmp_path: Path) -> None:
    done = _demo("--vllm", str(tmp_path / "vllm"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"warply demo: no vllm command ({tmp_path / 'vllm'}): pass --vllm, "
        "or run `bash scripts/setup_envs.sh vllm`, which installs it\n"
    )


def test_demo_unknown_model_size_is_a_usage_error(tmp_path: Path) -> None:
    vllm = tmp_path / "vllm"
    vllm.write_text("")
    done = _demo("--vllm", str(vllm), "--model", "huge")
    assert done.returncode == 2
    assert done.stderr == "warply demo: --model 'huge': not tiny, small or a model folder\n"


def test_demo_passes_a_termination_on_and_lets_the_demo_stop_itself(tmp_path: Path) -> None:
    """SIGTERM to `warply demo` reaches the demo (which stops its engines and router, then
    exits), and `warply demo` returns when it has: the demo is not killed under its servers."""
    ready, stopped = tmp_path / "ready", tmp_path / "stopped"
    demo = (
        "import signal, sys, time\n"
        "from pathlib import Path\n"
        "def stop(signum, frame):\n"
        "    time.sleep(0.5)  # the clean-up\n"
        f"    Path({str(stopped)!r}).write_text(str(signum))\n"
        "    sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"Path({str(ready)!r}).write_text('')\n"
        "time.sleep(60)\n"
    )

    def terminate_when_ready() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    sender = threading.Thread(target=terminate_when_ready)
    sender.start()
    try:
        assert _run_forwarding_signals([sys.executable, "-c", demo]) == 7
    finally:
        sender.join()
    assert stopped.read_text() == str(int(signal.SIGTERM))
    assert signal.getsignal(signal.SIGTERM) is before
