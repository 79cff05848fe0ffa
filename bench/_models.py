"""The local models the bench scripts default to. Not a benchmark; the scripts import it from
their own folder."""

from __future__ import annotations

import os
from pathlib import Path


def newest_tiny() -> Path | None:
    """The most recently built tiny model (`scripts/tiny_model.py --size tiny`) under
    $WARPLY_CACHE/models, whose tokenizer the router benches use; None if there is none."""
    models = Path(os.environ.get("WARPLY_CACHE", Path.home() / ".cache" / "warply")) / "models"
    found = sorted(models.glob("tiny-*/tokenizer.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None
