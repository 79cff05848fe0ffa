"""Helpers for the vLLM integration tests: real `vllm serve` processes on 127.0.0.1.

Servers run the tiny model from scripts/tiny_model.py with VLLM_CPU_KVCACHE_SPACE=1 and
--enforce-eager, in their own process group, and are stopped by PID. Collectors bind SUB sockets
on 127.0.0.1 (the plugin's PUB connects to them, the engines' convention for concrete hosts).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from vllm_connector.directives import ack_decoder
from vllm_connector.hits import HitBatch, hit_batch_decoder
from warply.protocol import Directive, DirectiveAck, StreamDecoder, encode_directive
from warply.protocol.events import Event

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
VLLM_BIN = Path(sys.executable).parent / "vllm"
MODEL_NAME = "tiny"
STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


MODEL_SIZE = os.environ.get("WARPLY_TEST_MODEL_SIZE", "tiny")
"""scripts/tiny_model.py size; vLLM 0.32's CPU attention needs head_dim 32, 64, 80, ..."""


def start_all(servers: list[VllmServer]) -> None:
    """Launch servers together (start-up overlaps), then wait for each; stop all on failure."""
    for s in servers:
        s.launch()
    try:
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise


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


class VllmServer:
    """One `vllm serve` process; `start()` waits for /health or raises with the log tail."""

    def __init__(
        self,
        model: str,
        log_path: Path,
        *,
        block_size: int = 16,
        kv_transfer: dict[str, Any] | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.env = env or {}
        self.log_path = log_path
        self.cmd = [
            str(VLLM_BIN), "serve", model, "--served-model-name", MODEL_NAME,
            "--host", HOST, "--port", str(self.port), "--enforce-eager",
            "--block-size", str(block_size), "--max-model-len", "2048", "--max-num-seqs", "4",
            "--enable-prefix-caching", "--seed", "0", "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if kv_transfer is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
        self.cmd += extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def launch(self) -> VllmServer:
        """Start the process (returns at once; see `wait_ready`)."""
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_SERVER_DEV_MODE="1",
            VLLM_LOG_STATS_INTERVAL="1",
            **self.env,
        )
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        return self

    def wait_ready(self) -> VllmServer:
        """Wait for /health; on failure stop the server and raise with its log tail."""
        assert self.proc is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vllm serve not healthy in {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def wait_exit(self, timeout_s: float) -> int | None:
        """For servers expected to fail: the exit code (stops it if it is still up)."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.stop()

    def stop(self) -> None:
        """SIGTERM the server's process group (by its PID), SIGKILL after 30 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()

    def log_tail(self, n: int = 60) -> str:
        """The last `n` lines of the server's output."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def complete(
        self, tokens: list[int], *, max_tokens: int = 8, cache_salt: str | None = None
    ) -> dict[str, Any]:
        """Greedy /v1/completions on token ids."""
        body: dict[str, Any] = {
            "model": MODEL_NAME, "prompt": tokens, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True,
        }  # fmt: skip
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        req = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def metric(self, name: str) -> float:
        """Sum of a Prometheus series over its labels on /metrics (0 if absent)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
        return sum(float(v) for v in pattern.findall(text))


@pytest.fixture(scope="module")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


class Collector:
    """Binds a SUB socket on 127.0.0.1 and keeps every decoded frame (a background thread)."""

    def __init__(self, kind: str = "state") -> None:
        self.port = free_port()
        self.endpoint = f"tcp://{HOST}:{self.port}"
        self.events: list[Event] = []
        self.hits: list[HitBatch] = []
        self.decoder = StreamDecoder("test")
        self._kind = kind
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
                if self._kind == "hits":
                    self.hits.append(hit_batch_decoder.decode(frames[-1]))
                else:
                    batch = self.decoder.decode_frames(frames)
                    if batch is not None:
                        self.events.extend(batch.events)

    def snapshot(self) -> list[Any]:
        with self._lock:
            return list(self.hits if self._kind == "hits" else self.events)

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


def send_directive(endpoint: str, directive: Directive, timeout_s: float = 30) -> DirectiveAck:
    """One request/reply on the control socket."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode_directive(directive))
        if not sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no ack for {directive.id} in {timeout_s}s")
        return ack_decoder.decode(sock.recv())
    finally:
        sock.close()


def send_raw(endpoint: str, payload: bytes, timeout_s: float = 30) -> DirectiveAck:
    """Send arbitrary bytes as a directive (for malformed-input tests)."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(payload)
        assert sock.poll(int(timeout_s * 1000)), "no ack"
        return ack_decoder.decode(sock.recv())
    finally:
        sock.close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


__all__ = ["Collector", "VllmServer", "msgspec", "send_directive", "send_raw"]
