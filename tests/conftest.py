"""Shared fixtures: captured engine event streams under tests/data/events; a redis-server."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from warply.launch import RedisServer

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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on 127.0.0.1 for the session (tests use distinct key prefixes)."""
    if shutil.which("redis-server") is None:
        pytest.fail(
            "redis-server is not installed: scripts/test.sh installs it "
            "(or run `apt-get install -y redis-server`)"
        )
    log = tmp_path_factory.mktemp("redis") / "redis.log"
    with RedisServer(log_path=log) as srv:
        srv.wait_ready()
        yield srv
