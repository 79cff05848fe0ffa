"""SGLang venv: recapturing SGLang's radix-cache event stream reproduces the committed fixtures.

Runs scripts/capture_sglang_events.py (SGLang's real UnifiedRadixCache and ZMQ publisher on
CPU) into a temp folder and checks that Warply decodes the fresh stream to the same events as
the committed one, so the fixtures the core tests use are what this SGLang release emits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EVENTS_DIR, load_capture

from warply.protocol import StreamDecoder

ROOT = Path(__file__).resolve().parents[2]


def _events(path: Path) -> list[object]:
    decoder = StreamDecoder(path.name)
    out: list[object] = []
    for frames in load_capture(path)["frames"]:
        batch = decoder.decode_frames(frames)
        assert batch is not None, decoder.rejected
        out.extend(batch.events)
    return out


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sglang-capture")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "capture_sglang_events.py"), "--out", str(out)],
        check=True, timeout=600,
    )
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_recapture_matches_committed_fixture(fresh: Path, page_size: int) -> None:
    name = f"sglang-0.5.23-page{page_size}.msgpack"
    committed, new = EVENTS_DIR / name, fresh / name
    assert load_capture(new)["sequences"] == load_capture(committed)["sequences"]
    assert _events(new) == _events(committed)
