"""The simulated worker (`replay.serve`) against real vLLM CPU engines on one small workload.

The same scripted multi-turn conversations (two of them sharing a system prompt) go, one
request at a time, through the router in front of two real engines (stock
`--kv-events-config` streams) and through the router in front of two simulated workers, with
the same block size and model folder. Per request, the engine-reported cached tokens
(`usage.prompt_tokens_details.cached_tokens`) and the router's predicted hit
(`X-Warply-Predicted-Cached`) must agree between the two stacks within one block (tolerance),
and the prompt token counts exactly. Nothing is evicted (both caches are far larger than the
workload), so agreement is expected to be exact; the tolerance absorbs one block of event lag.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import engine, start_all

from warply.launch import HOST, EngineProcess, RouterServer, SimWorkers, free_port

BLOCK = 32  # vLLM 0.32 CPU attention takes multiples of 32 only
SYSTEMS = [
    "You are a careful assistant for cache engineers. Answer in short, exact sentences. " * 4,
    "You review prefix caches and block tables; every answer cites the block it means. " * 4,
]
CONVERSATIONS = [(0, "Alpha"), (0, "Bravo"), (1, "Charlie"), (1, "Delta")]
"""(system prompt, topic): conversations 0 and 1 share the first system prompt, 2 and 3 the
second, so a new conversation can hit another one's prefix."""
TURNS = 3
Turn = tuple[int, int, str, int, int, int]
"""(conversation, turn, worker, prompt tokens, engine cached tokens, predicted cached)."""


def _router(workers: list[dict[str, str]], model: str, tag: str, logs: Path) -> EngineProcess:
    port = free_port()
    config = {
        "model": "tiny",
        "tokenizer": model,
        "port": port,
        "strategy": {"name": "prefix_affinity"},
        "pools": [{"name": tag, "block_size": BLOCK, "workers": workers}],
    }
    return RouterServer(config, logs, name=f"router-{tag}")


@pytest.fixture(scope="module")
def stacks(tiny_model: str, server_logs: Path) -> Iterator[dict[str, EngineProcess]]:
    """Two vLLM engines and two simulated workers, each pair behind its own router."""
    engines, workers = [], []
    for i in range(2):
        pub, replay = free_port(), free_port()
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://{HOST}:{replay}",
            "topic": "kv",
        }
        engines.append(
            engine(
                tiny_model,
                server_logs / f"vllm{i}.log",
                block_size=BLOCK,
                extra_args=["--kv-events-config", json.dumps(events)],
                env={"VLLM_CPU_OMP_THREADS_BIND": str(i)},
            )
        )
        workers.append(
            {
                "name": f"v{i}",
                "url": engines[-1].url,
                "topic": "kv",
                "events": f"tcp://{HOST}:{pub}",
                "replay": f"tcp://{HOST}:{replay}",
            }
        )
    sim = SimWorkers(
        sys.executable,
        "tiny",
        tiny_model,
        workers=2,
        log_path=server_logs / "sim.log",
        args=["--block-size", str(BLOCK), "--max-model-len", "2048"],
    )
    routers: list[EngineProcess] = []
    try:
        simulated = sim.start().wait_ready()
        start_all(engines)
        routers = [
            _router(workers, tiny_model, "vllm", server_logs),
            _router(simulated, tiny_model, "sim", server_logs),
        ]
        for r in routers:
            r.start()
        for r in routers:
            r.wait_healthy(60)
        yield {"vllm": routers[0], "sim": routers[1]}
    finally:
        for r in routers:
            r.stop()
        sim.stop()
        for e in engines:
            e.stop()


def _chat(url: str, messages: list[dict[str, str]]) -> tuple[str, int, int, int]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
        worker, predicted = (
            r.headers["X-Warply-Worker"],
            int(r.headers["X-Warply-Predicted-Cached"]),
        )
    usage = out["usage"]
    return (
        worker,
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        predicted,
    )


def _workload(url: str) -> list[Turn]:
    """Every conversation's turn t before any turn t + 1; scripted assistant replies (the same
    prompts on both stacks), a pause after each request for the events to reach the router."""
    histories = [[{"role": "system", "content": SYSTEMS[s]}] for s, _ in CONVERSATIONS]
    turns: list[Turn] = []
    for t in range(TURNS):
        for c, (_, topic) in enumerate(CONVERSATIONS):
            histories[c].append(
                {
                    "role": "user",
                    "content": f"{topic} question {t}: which block "
                    f"holds token {c * 100 + t}, and why does it stay cached?",
                }
            )
            worker, prompt, cached, predicted = _chat(url, histories[c])
            turns.append((c, t, worker, prompt, cached, predicted))
            histories[c].append(
                {
                    "role": "assistant",
                    "content": f"Block {t} of {topic}, kept because its prefix is shared.",
                }
            )
            time.sleep(0.5)
    return turns


def test_simulated_workers_match_vllm_on_a_small_workload(
    stacks: dict[str, EngineProcess],
) -> None:
    real = _workload(stacks["vllm"].url)
    sim = _workload(stacks["sim"].url)
    print("conv turn | prompt | vllm cached predicted | sim cached predicted")
    for r, s in zip(real, sim, strict=True):
        print(f"{r[0]:4} {r[1]:4} | {r[3]:6} | {r[4]:11} {r[5]:9} | {s[4]:10} {s[5]:9}")
    assert [t[3] for t in sim] == [t[3] for t in real]  # one tokenizer, one template
    assert sum(t[4] for t in real) > 0, real  # the workload does reuse prefixes
    for r, s in zip(real, sim, strict=True):
        assert abs(s[4] - r[4]) <= BLOCK, (r, s)  # engine-reported cached tokens
        assert abs(s[5] - r[5]) <= BLOCK, (r, s)  # the router's prediction
    # conversations stay on one worker on both stacks
    for turns in (real, sim):
        for c in range(len(CONVERSATIONS)):
            assert len({w for conv, _, w, *_ in turns if conv == c}) == 1, turns
