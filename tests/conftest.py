"""Shared fixtures: captured engine event streams under tests/data/events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

EVENTS_DIR = Path(__file__).parent / "data" / "events"


def load_capture(path: Path) -> dict[str, Any]:
    """A capture file written by scripts/capture_{vllm,sglang}_events.py."""
    data: dict[str, Any] = msgspec.msgpack.decode(path.read_bytes())
    return data


def _captures(engine: str) -> list[Path]:
    return sorted(EVENTS_DIR.glob(f"{engine}-*.msgpack"))


@pytest.fixture(params=_captures("vllm") + _captures("sglang"), ids=lambda p: p.stem)
def capture(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Each committed engine capture in turn."""
    data = load_capture(request.param)
    data["path"] = request.param
    return data
