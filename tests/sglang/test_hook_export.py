"""SGLang venv: the real radix cache's events leave SGLang's scheduler pump as Warply events.

Builds SGLang's `UnifiedRadixCache` on CPU (scripts/capture_sglang_events.py), installs the
plugin's hooks with SGLang's own `HookRegistry`, and drives the real
`SchedulerKvEventsPublisher` with `--kv-events-config '{"publisher": "warply", ...}'`. A SUB socket
bound on 127.0.0.1 plays the router's collector; `router.index.PrefixIndex` is fed from it.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import threading
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
import zmq
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.runtime_context import get_parallel

import sglang_hook.settings as settings_mod
import warply_plugins.sglang as plugin
from router.control import send_payload
from router.index import MemoryStore, PrefixIndex, completed
from warply.launch import free_port
from warply.protocol import (
    BlockRemoved,
    BlockStored,
    Directive,
    DirectiveAck,
    DirectiveKind,
    LoadSnapshot,
    StreamDecoder,
    Tier,
    cache_namespace,
    prefix_keys,
)
from warply.protocol.control import sign
from warply.protocol.directives import encode_directive

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"


def _capture_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "capture", ROOT / "scripts" / "capture_sglang_events.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


build_cache = _capture_module().build_cache


def insert(
    cache: Any, alloc: Any, tokens: list[int], salt: str | None = None, extra_key: str | None = None
) -> None:
    """Insert whole pages of `tokens` the way the scheduler caches a finished request."""
    n = len(tokens) // cache.page_size * cache.page_size
    key = RadixKey(array("q", tokens[:n]), extra_key=extra_key, cache_salt=salt)
    match = cache.match_prefix(MatchPrefixParams(key=key))
    new = alloc.alloc(n - match.device_prefix_len)
    cached = cache.path_device_indices(match.last_device_node)[: match.device_prefix_len]
    res = cache.insert(InsertParams(key=key, value=torch.cat([cached.long(), new.long()])))
    if res.prefix_len > match.device_prefix_len:
        alloc.free(new[: res.prefix_len - match.device_prefix_len])


@pytest.fixture(scope="module", autouse=True)
def hooks() -> None:
    plugin.register()
    HookRegistry.apply_hooks()


@pytest.fixture
def collectors() -> Iterator[dict[str, tuple[zmq.Socket[bytes], str]]]:
    """One bound SUB per worker, as the router subscribes per worker (`StateSubscriber`)."""
    out = {}
    for worker in ("w0", "w1"):
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        port = free_port()
        sub.bind(f"tcp://127.0.0.1:{port}")
        out[worker] = (sub, f"tcp://127.0.0.1:{port}")
    yield out
    for sub, _ in out.values():
        sub.close()


def scheduler_publisher(
    cache: Any,
    router: str,
    worker: str,
    control: str | None = None,
    snapshot_s: float = 3600,
    control_token: str = "",
) -> Any:
    """SGLang's scheduler-side publisher, as `Scheduler.init_kv_events_publisher` makes it."""
    from sglang.srt.managers.scheduler_components.kv_events_publisher import (
        SchedulerKvEventsPublisher,
    )

    from sglang_hook.publisher import WarplyEventPublisher

    WarplyEventPublisher.settings = settings_mod.WarplySettings(
        events_endpoint=router,
        worker=worker,
        model=MODEL,
        control_endpoint=control,
        snapshot_interval_s=snapshot_s,
        control_token=control_token,
    )
    stats = SimpleNamespace(
        num_running_reqs=SimpleNamespace(total=1),
        num_queue_reqs=SimpleNamespace(total=2),
        token_usage=0.25,
    )
    with get_parallel().override(
        pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0, dp_rank=0
    ):
        kv = SchedulerKvEventsPublisher(
            kv_events_config=settings_mod.kv_events_config(WarplyEventPublisher.settings),
            tree_cache=cache,
            send_metrics_from_scheduler=None,
            max_running_requests=8,
            max_total_num_tokens=2048,
            get_stats=lambda: stats,
        )
    assert isinstance(kv.kv_event_publisher, WarplyEventPublisher)
    kv.publish_kv_events()
    return kv


def handshake(kv: Any, sub: zmq.Socket[bytes]) -> None:
    """Report until one batch arrives, then drain: the stream is live from here on."""
    for _ in range(50):
        kv.kv_event_publisher.report([LoadSnapshot(0, 0, 0.0)])
        kv.kv_event_publisher.flush()
        if sub.poll(100):
            break
    receive(sub, StreamDecoder("handshake"), 300)


def receive(sub: zmq.Socket[bytes], decoder: StreamDecoder, timeout_ms: int = 3000) -> list[Any]:
    """All batches that arrive until the stream is quiet."""
    out = []
    while sub.poll(timeout_ms):
        batch = decoder.decode_frames(sub.recv_multipart())
        assert batch is not None, decoder.rejected
        out.append(batch)
        timeout_ms = 300
    return out


SYSTEM = [(1000 + 3 * i) % 32000 for i in range(96)]
CHAT_A = SYSTEM + [(5000 + 7 * i) % 32000 for i in range(104)]
CHAT_B = SYSTEM + [(9000 + 7 * i) % 32000 for i in range(64)]
DOC = [(20000 + 11 * i) % 32000 for i in range(300)]


def pump(kv: Any, sub: zmq.Socket[bytes], index: PrefixIndex, worker: str) -> list[Any]:
    """One scheduler pump on `kv`; the decoded events, applied to `index` as `worker`."""
    kv.publish_kv_events()
    decoder = StreamDecoder(worker)
    events = [e for b in receive(sub, decoder) for e in b.events]
    completed(index.apply(worker, events))
    return events


@pytest.mark.parametrize("backend", ["rust", "python"])
@pytest.mark.parametrize("page", [1, 16])
def test_events_carry_router_keys_and_route(collectors: Any, backend: str, page: int) -> None:
    caches = {w: build_cache(page, backend, 2048) for w in ("w0", "w1")}
    pubs = {w: scheduler_publisher(caches[w][0], collectors[w][1], w) for w in caches}
    for w, kv in pubs.items():
        # libzmq reads a connecting PUB's subscriptions lazily: early batches can be dropped
        # (the router recovers such a gap by replay); the test waits until the stream is live.
        handshake(kv, collectors[w][0])
    index = PrefixIndex(MODEL, MemoryStore())
    try:
        insert(*caches["w0"], CHAT_A)
        insert(*caches["w0"], CHAT_B)
        insert(*caches["w1"], DOC)
        insert(*caches["w1"], CHAT_A[:64], salt="tenant-1")
        events = [e for w in pubs for e in pump(pubs[w], collectors[w][0], index, w)]
        assert {type(e) for e in events} == {BlockStored}

        for tokens, worker in ((CHAT_A, "w0"), (CHAT_B, "w0"), (DOC, "w1")):
            keys = prefix_keys(tokens, page, MODEL)
            match = completed(index.match(keys))
            assert match[worker].blocks == len(keys), (worker, match)
            assert match["w1" if worker == "w0" else "w0"].blocks == 0
        salted = prefix_keys(CHAT_A[:64], page, MODEL, "tenant-1")
        assert completed(index.match(salted))["w1"].blocks == len(salted)
        assert completed(index.match(prefix_keys(CHAT_A[:64], page, MODEL)))["w1"].blocks == 0

        # An eviction sweep on w1 comes out as removals; the index forgets what w1 held.
        cache1, _ = caches["w1"]
        assert cache1.evict(EvictParams(num_tokens=10_000)).num_tokens_evicted > 0
        removed = pump(pubs["w1"], collectors["w1"][0], index, "w1")
        assert any(isinstance(e, BlockRemoved) for e in removed)
        assert completed(index.match(prefix_keys(DOC, page, MODEL)))["w1"].blocks == 0
        assert completed(index.match(salted))["w1"].blocks == 0
    finally:
        for kv in pubs.values():
            kv.kv_event_publisher.shutdown()


@pytest.mark.parametrize("page", [1, 16])
def test_load_snapshots_carry_the_pools_bytes_per_block(collectors: Any, page: int) -> None:
    """The test pool: 2 layers x K and V x 2 heads x 16 dims x 2 bytes (fp16) = 256 B/token."""
    cache, _ = build_cache(page, "rust", 2048)
    kv = scheduler_publisher(cache, collectors["w0"][1], "w0", snapshot_s=0.001)
    try:
        handshake(kv, collectors["w0"][0])
        kv.publish_kv_events()
        batches = receive(collectors["w0"][0], StreamDecoder("w0"))
        snaps = [e for b in batches for e in b.events if isinstance(e, LoadSnapshot)]
        assert snaps and {s.kv_bytes_per_block for s in snaps} == {256 * page}
        assert {s.kv_blocks_total for s in snaps} == {2048 // page}
    finally:
        kv.kv_event_publisher.shutdown()


def _lora_cache(page: int, backend: str, adapters: dict[str, str]) -> tuple[Any, Any]:
    """A radix cache whose event recorder knows `adapters` (LoRA id → name), as the scheduler
    registers them (`KvEventLoraNames`, shared through `CacheInitParams`)."""
    import sglang.srt.mem_cache.cache_init_params as init
    from sglang.srt.mem_cache.events import KvEventLoraNames

    names = KvEventLoraNames()
    params = functools.partial(init.CacheInitParams, kv_event_lora_names=names)
    with mock.patch.object(init, "CacheInitParams", params):
        cache, alloc = build_cache(page, backend, 2048)
    for lora_id, name in adapters.items():
        # SGLang appends the adapter's 32-character id to the request's extra_key.
        names.register(SimpleNamespace(lora_id=lora_id, extra_key=lora_id), name)
    return cache, alloc


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_lora_adapters_get_their_own_keys(collectors: Any, backend: str) -> None:
    """Equal prompts under the base model and two adapters are three prefixes in SGLang's tree;
    the router keys them apart by namespace (salt + adapter), as it keys the requests."""
    page = 16
    ids = {"a" * 32: "adapter-a", "b" * 32: "adapter-b"}
    caches = {w: _lora_cache(page, backend, ids) for w in ("w0", "w1")}
    pubs = {w: scheduler_publisher(caches[w][0], collectors[w][1], w) for w in caches}
    for w, kv in pubs.items():
        handshake(kv, collectors[w][0])
    index = PrefixIndex(MODEL, MemoryStore())
    try:
        for extra_key in (None, "a" * 32, "b" * 32):
            insert(*caches["w0"], CHAT_A, extra_key=extra_key)
        insert(*caches["w1"], CHAT_A, extra_key="b" * 32)
        events = [e for w in pubs for e in pump(pubs[w], collectors[w][0], index, w)]
        roots = sorted((e.namespace, e.lora) for e in events if isinstance(e, BlockStored))
        assert roots == [
            ("", None),
            ("\0adapter-a", "adapter-a"),
            ("\0adapter-b", "adapter-b"),
            ("\0adapter-b", "adapter-b"),
        ]
        n = len(CHAT_A) // page
        for lora, holders in ((None, {"w0"}), ("adapter-a", {"w0"}), ("adapter-b", {"w0", "w1"})):
            keys = prefix_keys(CHAT_A, page, MODEL, cache_namespace(None, lora))
            match = completed(index.match(keys))
            assert {w for w, m in match.items() if m.blocks == n} == holders, lora
            assert all(m.blocks in (0, n) for m in match.values())
    finally:
        for kv in pubs.values():
            kv.kv_event_publisher.shutdown()


def test_unknown_medium_is_skipped_and_counted_on_the_scheduler_thread(collectors: Any) -> None:
    """SGLang's pump hands the publisher a batch with an event on a medium no tier maps: it is
    left out and counted (`skipped`), the rest of the batch is sent, nothing raises."""
    from sglang.srt.disaggregation.kv_events import BlockRemoved as SgRemoved
    from sglang.srt.disaggregation.kv_events import BlockStored as SgStored
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    cache, _ = build_cache(16, "python", 2048)
    kv = scheduler_publisher(cache, collectors["w0"][1], "w0")
    sub = collectors["w0"][0]
    handshake(kv, sub)
    publisher = kv.kv_event_publisher
    tokens = list(range(16))
    try:
        batch = KVEventBatch(
            ts=time.time(),
            events=[
                SgStored([-2], None, tokens, 16, None, medium="TAPE"),
                SgStored([-3], None, tokens, 16, None, medium="CPU_PINNED", cache_salt="t"),
                SgRemoved([-2], medium="TAPE"),
                SgRemoved([-4], medium="DISK"),
            ],
        )
        publisher.publish(batch)
        events = [e for b in receive(sub, StreamDecoder("w0")) for e in b.events]
    finally:
        publisher.shutdown()
    assert events == [
        BlockStored([2**64 - 3], None, tokens, 16, Tier.CPU, "t", None),
        BlockRemoved([2**64 - 4], Tier.SSD),
    ]
    assert publisher.skipped == {"unknown_medium": 2}


def test_signed_directives_reach_the_radix_cache(collectors: Any) -> None:
    """With a control token, the hook's directive socket applies a signed pin to the radix cache
    (on the scheduler's pump) and refuses the same pin unsigned, or replayed, unapplied."""
    cache, alloc = build_cache(16, "python", 2048)
    insert(cache, alloc, DOC)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    token = "sglang-control-token"
    kv = scheduler_publisher(
        cache, collectors["w0"][1], "w0", control=endpoint, control_token=token
    )
    pin = encode_directive(Directive("p", DirectiveKind.PIN, token_ids=DOC))
    signed = sign(pin, token)
    acks: list[DirectiveAck] = []

    def send(payload: bytes) -> None:
        sender = threading.Thread(
            target=lambda: acks.append(asyncio.run(send_payload(endpoint, payload, 10)))
        )
        sender.start()
        while sender.is_alive():
            kv.publish_kv_events()  # the scheduler's pump applies what the socket queued
            sender.join(0.02)

    try:
        for payload in (pin, signed, signed):
            send(payload)
    finally:
        kv.kv_event_publisher.shutdown()
    assert [(a.applied, a.reason.partition(":")[0]) for a in acks] == [
        (False, "unauthenticated"), (True, ""), (False, "unauthenticated")]  # fmt: skip
    assert acks[1].blocks == len(DOC) // 16
