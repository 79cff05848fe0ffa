"""Warply's main job on this machine: a real vLLM CPU engine, its cache state, the router's view.

Starts `vllm serve` (tiny local model) with its stock KV-event stream, subscribes to it with
Warply's decoder, feeds a prefix index exactly as the router does, and sends a short chat
workload (a conversation's turns, a repeat, and a salted tenant request). For every request it
prints the engine's own cached-token count next to what the index predicted before sending —
the prediction the router routes on — and ends with the decoded stream's counters.

    .venvs/core/bin/python scripts/demo.py --vllm .venvs/vllm/bin/vllm --model DIR
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from router.index import MemoryIndex
from warply.launch import HOST, EngineProcess, free_port, http_json, vllm_server
from warply.protocol import DecodedBatch, prefix_keys
from warply.protocol.subscriber import StateSubscriber

BLOCK_SIZE = 32  # vLLM 0.32 CPU attention needs a multiple of 32
MODEL_NAME = "tiny"
SYSTEM = "You are a careful assistant for a storage team. " * 12
TURNS = [
    "Summarise how the prefix cache helps multi-turn chat.",
    "Now list three risks of sharing a cache across tenants.",
    "And how would you measure the hit rate per tier?",
]


def _log(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


async def _tokens(engine: EngineProcess, messages: list[dict[str, str]]) -> list[int]:
    status, body = await asyncio.to_thread(
        http_json, "POST", engine.url + "/tokenize",
        {"model": MODEL_NAME, "messages": messages, "add_generation_prompt": True})
    if status != 200:
        raise RuntimeError(f"/tokenize answered {status}: {body}")
    return list(body["tokens"])


async def _chat(engine: EngineProcess, messages: list[dict[str, str]], salt: str | None) -> dict:
    req: dict = {"model": MODEL_NAME, "messages": messages, "max_tokens": 24, "temperature": 0}
    if salt:
        req["cache_salt"] = salt
    status, body = await asyncio.to_thread(http_json, "POST", engine.url + "/v1/chat/completions", req)
    if status != 200:
        raise RuntimeError(f"chat answered {status}: {body}")
    return dict(body)


async def _run(args: argparse.Namespace, workdir: Path) -> int:
    pub, replay = free_port(), free_port()
    engine = vllm_server(
        args.vllm, args.model, log_path=workdir / "vllm.log", served_name=MODEL_NAME,
        args=["--block-size", str(BLOCK_SIZE), "--max-model-len", "4096",
              "--enable-prefix-caching", "--enable-prompt-tokens-details"],
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://{HOST}:{replay}",
                          "topic": "kv"},
    )
    index = MemoryIndex(MODEL_NAME)
    counts: dict[str, int] = {}

    def on_batch(worker: str, batch: DecodedBatch) -> None:
        index.apply(worker, batch.events)
        for ev in batch.events:
            counts[type(ev).__name__] = counts.get(type(ev).__name__, 0) + 1

    sub = StateSubscriber("engine-0", f"tcp://{HOST}:{pub}", on_batch, index.drop_worker,
                          replay_endpoint=f"tcp://{HOST}:{replay}", topic=b"kv")
    with engine:
        _log(f"starting vLLM (pid {engine.pid}, log {engine.log_path}) ...")
        _log(f"vLLM healthy after {engine.wait_healthy():.0f}s")
        task = asyncio.create_task(sub.run())
        print(f"{'request':34s} {'prompt':>6s} {'predicted':>9s} {'engine cached':>13s}")
        plan: list[tuple[str, str | None, int]] = [("conversation", None, n) for n in (1, 2, 3)]
        plan += [("conversation (repeat)", None, 3), ("same prompt, tenant-b salt", "tenant-b", 3)]
        history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        answers: list[str] = []
        for label, salt, turn in plan:
            messages = list(history[:1])
            for i in range(turn):
                messages.append({"role": "user", "content": TURNS[i]})
                if i < turn - 1:
                    messages.append({"role": "assistant", "content": answers[i]})
            tokens = await _tokens(engine, messages)
            keys = prefix_keys(tokens, BLOCK_SIZE, MODEL_NAME, salt or "")
            predicted = index.match(keys).get("engine-0")
            body = await _chat(engine, messages, salt)
            if salt is None and len(answers) < turn:
                answers.append(body["choices"][0]["message"]["content"] or "")
            usage = body.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            blocks = predicted.blocks if predicted else 0
            print(f"{label + f' turn {turn}':34s} {len(tokens):6d} {blocks * BLOCK_SIZE:9d} "
                  f"{cached:13d}")
            await asyncio.sleep(0.5)  # let the events of this request arrive
        task.cancel()
        stats = index.stats()
        print(f"\nstate stream: {counts} ; gaps {sub.gaps}, replayed {sub.replayed}, "
              f"rejected {dict(sub.decoder.rejected)}")
        print(f"index: {stats.entries} (block, worker) entries, by tier "
              f"{ {str(t): n for t, n in stats.entries_by_tier.items()} }")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm", required=True, help="the vllm CLI of the engine venv")
    ap.add_argument("--model", required=True, help="model folder (scripts/tiny_model.py)")
    ap.add_argument("--workdir", type=Path, help="where logs go (default: a temp folder)")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="warply-demo-"))
    try:
        return asyncio.run(_run(args, workdir))
    except (RuntimeError, TimeoutError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
