"""WarplyConnector overhead on real vLLM: TTFT p50 and throughput, with vs without the connector.

Starts two `vllm serve` engines with the `small` (~90M) test model on 127.0.0.1 — plain, and
WarplyConnector (no delegate) exporting full state (events + replay + control sockets, a
collector subscribed) — each pinned to its own core, and drives them alternately (never both at
once) with the same requests: cold prompts, their cached repeats, then concurrent batches for
throughput. A second phase restarts both with the cores swapped, so core differences cancel;
numbers are medians over both phases.
Target: Warply/plain TTFT ratio <= 1.03 and plain/Warply throughput ratio <= 1.03.
Bounded: fixed request counts, per-request and overall deadlines; servers are stopped by PID.

    .venvs/vllm/bin/python bench/vllm_connector_overhead.py [--prompts 16] [--max-seconds 900]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq

from warply.common.argtypes import positive
from warply.launch import HOST, VllmServer, exit_on_termination, free_port

ROOT = Path(__file__).resolve().parent.parent


def _server(
    name: str, model: str, log_dir: Path, kv: dict[str, Any] | None, core: int
) -> VllmServer:
    # One core each: vLLM's OpenMP threads spin after work, so engines sharing cores slow each
    # other down even when only one is serving.
    return VllmServer(
        Path(sys.executable).parent / "vllm", model, log_path=log_dir / f"{name}-core{core}.log",
        served_name="m", cpu_core=core, kv_transfer_config=kv,
        args=["--block-size", "128", "--max-model-len", "4096", "--max-num-seqs", "8",
              "--enable-prefix-caching", "--seed", "0"],
    )  # fmt: skip


def _ttft(server: VllmServer, prompt: list[int], max_tokens: int = 1) -> tuple[float, int]:
    """Seconds to the first streamed token, and the number of tokens generated."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    req = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    first, chunks = None, 0
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
    assert first is not None
    return first, chunks


class _Drain:
    """Binds a SUB socket for the Warply engine's state stream and counts messages."""

    def __init__(self) -> None:
        self.endpoint = f"tcp://{HOST}:{free_port()}"
        self.count = 0
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                self._sock.recv_multipart()
                self.count += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 8192) for _ in range(length)] for _ in range(n)]


def _throughput(server: VllmServer, prompts: list[list[int]], out_tokens: int) -> float:
    """Generated tokens per second for `prompts` sent 4 at a time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda p: _ttft(server, p, out_tokens)[1], prompts))
    return sum(done) / (time.perf_counter() - t0)


def _phase(
    servers: dict[str, VllmServer],
    args: argparse.Namespace,
    phase: int,
    deadline: float,
    ttft: dict[str, dict[str, list[float]]],
    tput: dict[str, list[float]],
) -> None:
    """Start both engines, then measure them alternately (fresh prompts per phase)."""
    for s in servers.values():
        s.start()
    for s in servers.values():
        s.wait_healthy(max(1.0, deadline - time.monotonic()))
    order = ["plain", "warply"]
    for s in servers.values():  # warm-up (first-request allocations, kernel setup)
        _ttft(s, _prompts(1, args.prompt_len, 99)[0], 4)
    for i, p in enumerate(_prompts(args.prompts, args.prompt_len, 1 + phase)):
        if time.monotonic() > deadline:
            raise TimeoutError("out of time in the TTFT phase")
        for name in order if i % 2 == 0 else order[::-1]:  # alternate who goes first
            ttft[name]["cold"].append(_ttft(servers[name], p)[0])
            ttft[name]["cached"].append(_ttft(servers[name], p)[0])
    for r in range(args.rounds):
        batch = _prompts(args.batch, args.prompt_len // 2, 100 + 10 * phase + r)
        for name in order if r % 2 == 0 else order[::-1]:
            if time.monotonic() > deadline:
                raise TimeoutError("out of time in the throughput phase")
            tput[name].append(_throughput(servers[name], batch, args.out_tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--prompts", type=positive(int), default=10, help="cold prompts per engine and phase"
    )
    ap.add_argument("--prompt-len", type=positive(int), default=1024, help="tokens per prompt")
    ap.add_argument("--batch", type=positive(int), default=8, help="requests per throughput round")
    ap.add_argument(
        "--out-tokens", type=positive(int), default=32, help="output tokens per request"
    )
    ap.add_argument("--rounds", type=positive(int), default=2, help="throughput rounds per engine")
    ap.add_argument("--max-seconds", type=positive(float), default=1200, help="whole run, at most")
    args = ap.parse_args()
    exit_on_termination()
    deadline = time.monotonic() + args.max_seconds

    model = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tiny_model.py"), "--size", "small"],
        check=True, stdout=subprocess.PIPE, text=True,
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="warply-bench-"))
    drain = _Drain()
    warply_cfg = {
        "kv_connector": "WarplyConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"warply": {
            "events_endpoint": drain.endpoint,
            "replay_endpoint": f"tcp://{HOST}:{free_port()}",
            "control_endpoint": f"tcp://{HOST}:{free_port()}",
        }},
    }  # fmt: skip
    order = ["plain", "warply"]
    ttft: dict[str, dict[str, list[float]]] = {n: {"cold": [], "cached": []} for n in order}
    tput: dict[str, list[float]] = {n: [] for n in order}
    try:
        for phase, cores in enumerate(((0, 1), (1, 0))):
            servers = {
                "plain": _server("plain", model, logs, None, cores[0]),
                "warply": _server("warply", model, logs, warply_cfg, cores[1]),
            }
            try:
                _phase(servers, args, phase, deadline, ttft, tput)
            finally:
                for s in servers.values():
                    s.stop()
    finally:
        drain.close()

    print(f"model small, block 128, 2 phases x {args.prompts} prompts x {args.prompt_len} tokens; "
          f"throughput 2 x {args.rounds} x {args.batch} requests, {args.out_tokens} out tokens, "
          f"concurrency 4; Warply stream messages received: {drain.count}")  # fmt: skip
    p50 = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in ttft.items()}
    tp = {n: statistics.median(v) for n, v in tput.items()}
    for kind in ("cold", "cached"):
        ratio = p50["warply"][kind] / p50["plain"][kind]
        print(f"TTFT p50 {kind:6s}: plain {p50['plain'][kind] * 1000:8.1f} ms  "
              f"warply {p50['warply'][kind] * 1000:8.1f} ms  ratio {ratio:.3f}")  # fmt: skip
    ratio = tp["plain"] / tp["warply"]
    print(f"throughput     : plain {tp['plain']:8.1f} tok/s warply {tp['warply']:8.1f} tok/s "
          f"ratio (plain/warply) {ratio:.3f}")  # fmt: skip
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
