#!/usr/bin/env python3
"""Capture real SGLang KV-event streams as test fixtures.

Runs inside the SGLang venv (``bash scripts/setup_envs.sh sglang``; then
``.venvs/sglang/bin/python scripts/capture_sglang_events.py``). No GPU and no model
are needed: the script builds SGLang's own ``UnifiedRadixCache`` on ``device="cpu"``
with SGLang's real memory pools (``ReqToTokenPool``, ``MHATokenToKVPool``,
``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``) and KV-event recording
enabled, drives a short scenario (inserts, a shared prefix, match_prefix, lock/unlock,
eviction, reset), drains the recorded events with ``take_events()`` exactly as the
scheduler does, and publishes them through SGLang's ``ZmqEventPublisher`` (created by
``EventPublisherFactory``) bound on 127.0.0.1. A ZMQ SUB socket in this script records
every raw multipart frame; the replay ROUTER endpoint is exercised too.

Output (one file per page size): tests/data/events/sglang-<version>-page<N>.msgpack, a
msgpack map with engine, engine_version, block_size, hash_algo, model, sequences,
frames ([[topic, seq, payload], ...]) and notes. See tests/data/events/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import sys
import time
from array import array
from pathlib import Path

from warply.common.argtypes import number_list, output_folder

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "data" / "events"


def log(msg: str) -> None:
    print(f"[capture-sglang] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- scenario


def make_sequences() -> list[dict]:
    """Deterministic token sequences (ids < 32000, like a small vocabulary)."""

    def run(start: int, n: int, step: int = 7) -> list[int]:
        return [(start + i * step) % 32000 for i in range(n)]

    system = run(1000, 96, 3)  # a shared system prompt
    return [
        {"label": "chat-a", "token_ids": system + run(5000, 104), "cache_salt": None},
        {"label": "chat-b-shared-prefix", "token_ids": system + run(9000, 64), "cache_salt": None},
        {"label": "doc-c", "token_ids": run(20000, 300, 11), "cache_salt": None},
        {"label": "short-d", "token_ids": run(30000, 50, 13), "cache_salt": None},
        {"label": "salted-e", "token_ids": system + run(12000, 40), "cache_salt": "tenant-1"},
    ]


def build_cache(page_size: int, backend: str, pool_tokens: int):
    import torch
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    if page_size == 1:
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator as Alloc
    else:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator as Alloc

    req_pool = ReqToTokenPool(size=8, max_context_len=1024, device="cpu", enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(
        size=pool_tokens,
        page_size=page_size,
        dtype=torch.float16,
        head_num=2,
        head_dim=16,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    if page_size == 1:
        alloc = Alloc(pool_tokens, torch.float16, "cpu", kv_pool, need_sort=False)
    else:
        alloc = Alloc(pool_tokens, page_size, torch.float16, "cpu", kv_pool, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=alloc,
        page_size=page_size,
        enable_kv_cache_events=True,
        tree_components=(ComponentType.FULL,),
        tree_core_backend=backend,
    )
    cache = UnifiedRadixCache(params)
    return cache, alloc


def run_scenario(page_size: int, backend: str, sequences: list[dict]):
    """Drive the cache; returns (list of event batches [list of events], core name, log)."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, alloc = build_cache(page_size, backend, pool_tokens=2048)
    core = type(cache.tree_core).__name__
    batches: list[list] = []
    steps: list[str] = []

    def pump(what: str) -> None:
        evs = cache.take_events()
        batches.append(evs)
        steps.append(f"{what}: {len(evs)} event(s) {[type(e).__name__ for e in evs]}")

    pump("init (constructor reset)")

    def key_of(seq: dict, n: int | None = None) -> RadixKey:
        toks = seq["token_ids"] if n is None else seq["token_ids"][:n]
        return RadixKey(array("q", toks), cache_salt=seq["cache_salt"])

    nodes = {}
    for seq in sequences:
        n = len(seq["token_ids"]) // page_size * page_size  # SGLang caches whole pages
        key = key_of(seq, n)
        match = cache.match_prefix(MatchPrefixParams(key=key))
        prefix = match.device_prefix_len
        new = alloc.alloc(n - prefix)
        assert new is not None, "pool exhausted"
        cached = cache.path_device_indices(match.last_device_node)[:prefix]
        value = torch.cat([cached.to(torch.int64), new.to(torch.int64)])
        res = cache.insert(InsertParams(key=key, value=value))
        # Whatever was already cached beyond the matched prefix is a duplicate: free it.
        if res.prefix_len > prefix:
            alloc.free(new[: res.prefix_len - prefix])
        nodes[seq["label"]] = res.last_device_node
        pump(f"insert {seq['label']} ({n} tokens, matched {prefix})")

    m = cache.match_prefix(MatchPrefixParams(key=key_of(sequences[1])))
    steps.append(f"match_prefix chat-b: device_prefix_len={m.device_prefix_len}")
    pump("match_prefix")

    lock = cache.lock(m.last_device_node)
    steps.append(
        f"lock chat-b: evictable={cache.evictable_size()} protected={cache.protected_size()}"
    )
    r = cache.evict(EvictParams(num_tokens=10_000))
    steps.append(f"evict-all while chat-b locked: evicted={r.num_tokens_evicted}")
    pump("evict while locked")
    cache.unlock(lock)
    steps.append(
        f"unlock chat-b: evictable={cache.evictable_size()} protected={cache.protected_size()}"
    )
    # Re-insert one sequence so the final reset clears a non-empty tree.
    seq = sequences[3]
    n = len(seq["token_ids"]) // page_size * page_size
    new = alloc.alloc(n)
    cache.insert(InsertParams(key=key_of(seq, n), value=new.to(torch.int64)))
    pump("re-insert short-d")
    r = cache.evict(EvictParams(num_tokens=page_size))
    steps.append(f"evict {page_size} token(s) after unlock: evicted={r.num_tokens_evicted}")
    pump("evict one page")
    # One scheduler step can carry several events: store a sequence and evict in one batch.
    seq = sequences[2]
    n = len(seq["token_ids"]) // page_size * page_size
    new = alloc.alloc(n)
    cache.insert(InsertParams(key=key_of(seq, n), value=new.to(torch.int64)))
    r = cache.evict(EvictParams(num_tokens=page_size))
    steps.append(
        f"re-insert doc-c, then evict {page_size} token(s): evicted={r.num_tokens_evicted}"
    )
    pump("mixed batch")
    cache.reset()
    pump("reset")
    return batches, core, steps


# --------------------------------------------------------------------------- checks


def expected_hashes(token_ids: list[int], page_size: int, cache_salt: str | None) -> list[int]:
    """Recompute SGLang's event hashes independently (hashlib), for a self-check.

    Page chain: d_0 = sha256([seed ||] tokens_0 as little-endian u32), d_i = sha256(d_{i-1} ||
    tokens_i); event hash = first 8 bytes of d_i as a big-endian signed int64. seed = sha256(
    b"sglang-cache-salt-v1\0" + salt) when a cache_salt is set (no seed otherwise).
    """
    prior = (
        hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode()).digest()
        if cache_salt is not None
        else b""
    )
    out = []
    for i in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        prior = hashlib.sha256(prior + array("I", token_ids[i : i + page_size]).tobytes()).digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


def check_events(batches, sequences, page_size) -> list[str]:
    """Every stored hash must match the independent recomputation; returns findings."""
    from sglang.srt.disaggregation.kv_events import BlockStored

    by_hash: dict[int, tuple[str, int]] = {}
    for seq in sequences:
        for i, h in enumerate(expected_hashes(seq["token_ids"], page_size, seq["cache_salt"])):
            by_hash[h] = (seq["label"], i)
    n = 0
    for batch in batches:
        for e in batch:
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    if h not in by_hash:
                        raise SystemExit(f"page {page_size}: hash {h} not reproduced by hashlib")
                    n += 1
    return [f"all {n} stored block hashes reproduced with hashlib (page {page_size})"]


def event_tuple(e) -> tuple:
    import msgspec

    return (type(e).__name__, msgspec.to_builtins(e))


# --------------------------------------------------------------------------- ZMQ


def publish_and_capture(batches: list[list], topic: str) -> tuple[list[list[bytes]], str]:
    """Publish batches with SGLang's own publisher; record raw frames with a SUB socket."""
    import json

    import zmq
    from sglang.srt.disaggregation.kv_events import (
        EventPublisherFactory,
        KVEventBatch,
        ZmqEventPublisher,
    )

    pub_port, replay_port = free_port(), free_port()
    config = json.dumps(
        {
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{pub_port}",
            "bind": True,
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "topic": topic,
        }
    )
    ctx = zmq.Context.instance()
    publisher = EventPublisherFactory.create(config, attn_dp_rank=0)
    assert isinstance(publisher, ZmqEventPublisher), type(publisher)
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sub.setsockopt(zmq.RCVTIMEO, 3000)
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        time.sleep(0.5)  # let the subscription reach the PUB socket (slow joiner)
        non_empty = [b for b in batches if b]  # the scheduler publishes only non-empty batches
        for b in non_empty:
            publisher.publish(KVEventBatch(ts=time.time(), events=b))
        live: list[list[bytes]] = []
        while len(live) < len(non_empty):
            try:
                live.append(sub.recv_multipart())
            except zmq.Again:
                break
        # Replay from seq 0 over the ROUTER endpoint: request = [b"", seq as 8 bytes BE].
        dealer.setsockopt(zmq.RCVTIMEO, 3000)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replay: list[list[bytes]] = []
        while True:
            msg = dealer.recv_multipart()
            assert msg[0] == b"", msg[:1]
            if msg[2] == ZmqEventPublisher.END_SEQ:
                break
            replay.append(msg[1:])
        if live != replay[: len(live)]:
            raise SystemExit("live frames differ from replayed frames")
        note = (
            f"{len(live)} live frame(s); replay from seq 0 returned {len(replay)} identical "
            "frame(s)"
        )
        frames = live if len(live) == len(non_empty) else replay
        if len(frames) != len(non_empty):
            raise SystemExit(f"captured {len(frames)} of {len(non_empty)} batches")
        return frames, note
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        publisher.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out",
        type=output_folder,
        default=DEFAULT_OUT,
        help="output folder (default: %(default)s)",
    )
    ap.add_argument(
        "--page-sizes",
        type=number_list(int),
        default="1,16",
        help="comma-separated page sizes (default: %(default)s)",
    )
    ap.add_argument(
        "--backend",
        default="rust",
        choices=["rust", "python"],
        help="tree core whose events are written (default: %(default)s, SGLang's default); "
        "the other core is run too and compared when available",
    )
    ap.add_argument(
        "--topic", default="kv", help="ZMQ topic for the publisher (default: %(default)s)"
    )
    ap.add_argument("--dry-run", action="store_true", help="run and check, write nothing")
    args = ap.parse_args()

    import msgspec
    import sglang

    version = sglang.__version__
    sequences = make_sequences()
    args.out.mkdir(parents=True, exist_ok=True)
    for ps in args.page_sizes:
        log(f"page size {ps}: running the scenario on the {args.backend} tree core")
        batches, core, steps = run_scenario(ps, args.backend, sequences)
        for s in steps:
            log("  " + s)
        notes = [f"tree core: {core}"] + steps
        notes += check_events(batches, sequences, ps)
        other = "python" if args.backend == "rust" else "rust"
        try:
            other_batches, other_core, _ = run_scenario(ps, other, sequences)
        except Exception as exc:  # the Rust core may be missing on some installs
            notes.append(f"{other} tree core unavailable: {exc!r}")
        else:
            same = [[event_tuple(e) for e in b] for b in batches] == [
                [event_tuple(e) for e in b] for b in other_batches
            ]
            msg = f"events identical between {core} and {other_core}: {same}"
            notes.append(msg)
            log("  " + msg)
        frames, zmq_note = publish_and_capture(batches, args.topic)
        notes.append(zmq_note)
        log("  " + zmq_note)
        doc = {
            "engine": "sglang",
            "engine_version": version,
            "block_size": ps,
            "hash_algo": "sha256-page-chain-u32le-int64head",
            "model": None,
            "sequences": [
                {"label": s["label"], "token_ids": s["token_ids"], "cache_salt": s["cache_salt"]}
                for s in sequences
            ],
            "frames": [[bytes(f) for f in fr] for fr in frames],
            "notes": "\n".join(
                [
                    "Captured by scripts/capture_sglang_events.py: SGLang's UnifiedRadixCache on "
                    "device=cpu with real pools, enable_kv_cache_events=True, events drained by "
                    "take_events() and published as KVEventBatch by ZmqEventPublisher "
                    f"(EventPublisherFactory, topic {args.topic!r}). Sequences are inserted "
                    "truncated to whole pages, in order.",
                ]
                + notes
            ),
        }
        data = msgspec.msgpack.encode(doc)
        path = args.out / f"sglang-{version}-page{ps}.msgpack"
        if args.dry_run:
            log(f"  dry run: would write {path} ({len(data)} bytes, {len(frames)} frames)")
        else:
            path.write_bytes(data)
            log(f"  wrote {path} ({len(data)} bytes, {len(frames)} frames)")


if __name__ == "__main__":
    main()
