"""Files that hold a deployment's secrets (the router's admin and control tokens, a manifest's
Secret): written readable by their owner only."""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_DIR = 0o700
"""A run folder's mode: its files hold the tokens, its logs the engines' output."""


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600, also over a file that had wider permissions."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text)
