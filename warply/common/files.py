"""Files that hold a deployment's secrets (the router's admin and control tokens, a manifest's
Secret) or its tenants' data (KV pages): written readable by their owner only."""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_DIR = 0o700
"""The mode of a folder of such files (a run folder: the tokens, the engines' logs)."""


def write_private(path: Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` with mode 0600, also over a file that had wider
    permissions."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(data.encode() if isinstance(data, str) else data)
