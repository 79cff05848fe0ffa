"""`warply demo` for real: the local model, two `vllm serve` engines behind warply-router (one
strategy, a short workload), the cache statistics table, exit 0, nothing left running."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, VLLM_BIN


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "warply", "demo", "--vllm", str(VLLM_BIN),
         "--strategy", "prefix_affinity", "--conversations", "2", "--turns", "2",
         "--workdir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.rsplit(None, 1)[0].strip(): line.rsplit(None, 1)[1]
            for line in done.stdout.splitlines() if line.strip()}  # fmt: skip
    assert rows["cache_stats"] == "prefix_affinity"
    assert rows["requests"] == "4"
    assert float(rows["hit rate (engine-reported)"]) > 0  # second turns follow the first
    assert "Traceback" not in done.stderr
    pids = [int(p) for p in re.findall(r"pid (\d+)", done.stderr)]
    assert len(pids) == 3  # two engines and one router, each stopped by the demo
    for pid in pids:
        assert not _alive(pid), f"process {pid} was left running"
    logs = sorted(p.name for p in tmp_path.iterdir())
    assert logs == ["router-prefix_affinity.log", "router-prefix_affinity.yaml", "vllm-0.log",
                    "vllm-1.log"]  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
