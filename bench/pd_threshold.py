"""Local prefill on a decode engine vs the P/D round trip, by uncached prompt length: the
measurement behind the router's `pd.local_prefill_tokens` default (docs/router.md).

Starts one prefill and one decode vLLM CPU engine (WarplyConnector wrapping NixlConnector,
kv_producer / kv_consumer, as a P/D deployment runs them) and, for each prompt length, sends
fresh random token prompts (cached nowhere), alternating the two paths:

  * local   the decode engine prefills the prompt itself: streamed /v1/completions, time to the
            first SSE event
  * P/D     the prefill engine computes it (`kv_transfer_params: {"do_remote_decode": true}`,
            max_tokens 1), then the decode engine pulls the KV with the returned params and
            streams: time from the prefill request to decode's first event, split into the
            prefill answer and decode's first event (transfer + first step)

The P/D overhead at a length is P/D − local; a local prefill of L tokens stalls the decode
engine's other requests for about local(L). Below the length where local(L) equals the overhead,
prefilling on decode costs its other requests less than the hand-off costs this one.
Everything binds 127.0.0.1; both engines are stopped by PID. NIXL's CPU path spins a core, so on a
2-core machine repeat runs and read medians.

    .venvs/vllm/bin/python bench/pd_threshold.py \\
        --model $(.venvs/vllm/bin/python scripts/tiny_model.py --size small | tail -1)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from warply.common.argtypes import non_negative, number_list, output_file, positive
from warply.launch import HOST, VllmServer, exit_on_termination, free_port

VOCAB = 8192


def _connector(role: str) -> dict[str, Any]:
    return {
        "kv_connector": "WarplyConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "delegate": {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"},
            "warply": {},
        },
    }


def _server(vllm: Path, model: str, role: str, core: int, logs: Path, block: int) -> VllmServer:
    return VllmServer(
        vllm, model, log_path=logs / f"{role}.log", cpu_core=core, confined=True,
        args=["--block-size", str(block), "--max-model-len", "8192", "--max-num-seqs", "4",
              "--enable-prefix-caching", "--seed", "0", "--enable-prompt-tokens-details"],
        kv_transfer_config=_connector(role),
        env={"VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
             "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
    )  # fmt: skip


async def _first_event(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    """Seconds to the first SSE event of a streamed completion (then drained)."""
    t0 = time.perf_counter()
    first = None
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for _ in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
    assert first is not None
    return first


async def _local(session: aiohttp.ClientSession, decode: str, prompt: list[int]) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    return await _first_event(session, decode, body)


async def _pd(
    session: aiohttp.ClientSession, prefill: str, decode: str, prompt: list[int]
) -> tuple[float, float]:
    """(prefill answer, decode's first event) in seconds."""
    t0 = time.perf_counter()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    async with session.post(prefill + "/v1/completions", json=body) as r:
        out = await r.json()
    params = out["kv_transfer_params"]
    t_prefill = time.perf_counter() - t0
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "kv_transfer_params": params}  # fmt: skip
    return t_prefill, await _first_event(session, decode, body)


async def _measure(
    prefill: str, decode: str, lengths: list[int], reps: int, seed: int
) -> dict[int, dict[str, list[float]]]:
    rng = random.Random(seed)
    out: dict[int, dict[str, list[float]]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        warm = [rng.randrange(10, VOCAB) for _ in range(64)]
        await _local(session, decode, warm)  # first requests pay one-off set-up (NIXL
        await _pd(session, prefill, decode, warm[::-1])  # handshake, allocations)
        for n in lengths:
            row: dict[str, list[float]] = {"local": [], "pd": [], "prefill": [], "decode": []}
            for _ in range(reps):
                a = [rng.randrange(10, VOCAB) for _ in range(n)]
                b = [rng.randrange(10, VOCAB) for _ in range(n)]
                row["local"].append(await _local(session, decode, a))
                p, d = await _pd(session, prefill, decode, b)
                row["pd"].append(p + d)
                row["prefill"].append(p)
                row["decode"].append(d)
            out[n] = row
            med = {k: statistics.median(v) * 1000 for k, v in row.items()}
            print(
                f"{n:6d} tokens  local {med['local']:8.1f} ms   P/D {med['pd']:8.1f} ms "
                f"(prefill {med['prefill']:7.1f} + decode first {med['decode']:7.1f})   "
                f"overhead {med['pd'] - med['local']:+8.1f} ms",
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (scripts/tiny_model.py)")
    ap.add_argument("--vllm", type=Path, default=Path(sys.executable).parent / "vllm",
                    help="the vllm CLI (default: the one next to this python)")
    ap.add_argument("--lengths", type=number_list(int), default="128,256,512,1024,2048,4096",
                    help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--reps", type=positive(int), default=5, help="prompts per length")
    ap.add_argument("--block-size", type=positive(int), default=128,
                    help="the engines' KV block size")
    ap.add_argument("--seed", type=non_negative(int), default=0, help="seed of the random prompts")
    ap.add_argument("--json", type=output_file, help="write the samples here")
    args = ap.parse_args(argv)
    exit_on_termination()
    logs = Path(tempfile.mkdtemp(prefix="pd-threshold-"))
    servers = [
        _server(args.vllm, args.model, "kv_producer", 0, logs, args.block_size),
        _server(args.vllm, args.model, "kv_consumer", 1, logs, args.block_size),
    ]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_healthy(300)
        samples = asyncio.run(
            _measure(servers[0].url, servers[1].url, args.lengths, args.reps, args.seed)
        )
    finally:
        for s in servers:
            s.stop()
    if args.json:
        args.json.write_text(json.dumps(samples, indent=1))
    print(f"logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
