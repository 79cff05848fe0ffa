"""`warply demo`'s usage errors: one line, exit 2, before anything starts (the real run is
tests/vllm/test_cli_demo.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
