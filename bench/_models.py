"""The local models the bench scripts default to. Not a benchmark; the scripts import it from
their own folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_BUILDER = Path(__file__).resolve().parents[1] / "scripts" / "tiny_model.py"


def newest_tiny() -> Path | None:
    """The most recently built tiny model (`scripts/tiny_model.py --size tiny`) in that
    script's models folder, whose tokenizer the router benches use; None if there is none."""
    spec = importlib.util.spec_from_file_location("tiny_model", _BUILDER)
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    found = sorted(
        builder.models_dir().glob("tiny-*/tokenizer.json"), key=lambda p: p.stat().st_mtime
    )
    return found[-1].parent if found else None
