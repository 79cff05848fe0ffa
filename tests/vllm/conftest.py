"""Helpers for the vLLM integration tests: real `vllm serve` processes on 127.0.0.1.

Servers run the tiny model from scripts/tiny_model.py with VLLM_CPU_KVCACHE_SPACE=1 and
--enforce-eager, in their own process group, and are stopped by PID. Collectors bind SUB sockets
on 127.0.0.1 (the plugin's PUB connects to them, the engines' convention for concrete hosts).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from router import control
from warply.launch import HOST, VllmServer, free_port
from warply.protocol import Directive, DirectiveAck, StreamDecoder
from warply.protocol.events import Event

ROOT = Path(__file__).resolve().parents[2]
VLLM_BIN = Path(sys.executable).parent / "vllm"
STARTUP_TIMEOUT_S = 240

MODEL_SIZE = os.environ.get("WARPLY_TEST_MODEL_SIZE", "tiny")
"""scripts/tiny_model.py size; vLLM 0.32's CPU attention needs head_dim 32, 64, 80, ..."""


def engine(
    model: str,
    log_path: Path,
    *,
    block_size: int = 32,
    kv_transfer: dict[str, Any] | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    core: int | None = None,
) -> VllmServer:
    """A test `vllm serve` (not started): prefix caching, cached-token usage, stats every 1 s.
    `core`: its OpenMP threads bind there and the whole process is confined to it. Engines that
    pass KV over NIXL need that on 2 cores: with its decode peer paused, a vLLM 0.32 prefill
    engine's worker threads took both cores, mostly in the kernel, for up to 13 s, and every
    other process (router, test) stood still; confined, a 50 ms sleeper beside them was at
    worst 1.7 s late instead of 13.4 s."""
    args = ["--block-size", str(block_size), "--max-model-len", "2048", "--max-num-seqs", "4",
            "--enable-prefix-caching", "--seed", "0", "--enable-prompt-tokens-details",
            *(extra_args or [])]  # fmt: skip
    return VllmServer(VLLM_BIN, model, log_path=log_path, args=args, kv_transfer_config=kv_transfer,
                      env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOG_STATS_INTERVAL": "1",
                           **(env or {})},
                      cpu_core=core or 0, confined=core is not None)  # fmt: skip


def start_all(servers: list[VllmServer]) -> None:
    """Launch servers together (start-up overlaps), then wait for each; stop all on failure."""
    for s in servers:
        s.start()
    try:
        for s in servers:
            s.wait_healthy(STARTUP_TIMEOUT_S)
    except BaseException:
        for s in servers:
            s.stop()
        raise


def complete(
    server: VllmServer, tokens: list[int], *, max_tokens: int = 8, cache_salt: str | None = None
) -> dict[str, Any]:
    """Greedy /v1/completions on token ids, never stopping early at EOS."""
    extra = {} if cache_salt is None else {"cache_salt": cache_salt}
    return server.completion(tokens, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                             **extra)  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Folder of the deterministic test model (built once, cached)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tiny_model.py"), "--size", MODEL_SIZE],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


class Collector:
    """Binds a SUB socket on 127.0.0.1 and keeps every decoded frame (a background thread)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://{HOST}:{self.port}"
        self.events: list[Event] = []
        self.decoder = StreamDecoder("test")
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            frames = self._sock.recv_multipart()
            with self._lock:
                batch = self.decoder.decode_frames(frames)
                if batch is not None:
                    self.events.extend(batch.events)

    def snapshot(self) -> list[Any]:
        with self._lock:
            return list(self.events)

    def wait_for(self, pred: Any, timeout_s: float = 20) -> list[Any]:
        """Poll until `pred(items)` is truthy; return the items."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            items = self.snapshot()
            if pred(items):
                return items
            time.sleep(0.1)
        raise AssertionError(f"timed out; have {len(self.snapshot())} items")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


def send_directive(
    endpoint: str, directive: Directive, timeout_s: float = 30, token: str | None = None
) -> DirectiveAck:
    """One request/reply on the control socket (the router's own client; signed with
    `token`)."""
    return asyncio.run(control.send_directive(endpoint, directive, timeout_s, token))


def send_raw(endpoint: str, payload: bytes, timeout_s: float = 30) -> DirectiveAck:
    """Send arbitrary bytes as a directive (for malformed-input tests)."""
    return asyncio.run(control.send_payload(endpoint, payload, timeout_s))


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


__all__ = ["HOST", "Collector", "complete", "engine", "free_port", "send_directive", "send_raw"]
