"""Whether a process a test started still runs, read from /proc (tests/vllm, tests/lmcache)."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
