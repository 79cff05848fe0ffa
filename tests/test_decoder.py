"""Decoder over real captured engine streams (vLLM 0.32, SGLang 0.5.23) and malformed input."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from warply.protocol import (
    PROTOCOL_VERSION,
    AllCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    LoadSnapshot,
    Rejection,
    StreamDecoder,
    Tier,
    cache_namespace,
    chain_keys,
    encode_batch,
    engine_block_id,
    prefix_keys,
    request_namespace,
    root_seed,
)

MODEL = "capture-model"


def _namespace(seq: dict[str, Any]) -> str:
    """The namespace the router gives a captured request (its salt and LoRA adapter)."""
    return cache_namespace(seq.get("cache_salt"), seq.get("lora"))


def _decode_all(capture: dict[str, Any]) -> tuple[StreamDecoder, list[Any]]:
    decoder = StreamDecoder(capture["path"].stem)
    events = []
    for frames in capture["frames"]:
        batch = decoder.decode_frames(frames)
        assert batch is not None, decoder.rejected
        assert batch.source == "engine"
        events.extend(batch.events)
    return decoder, events


def test_capture_decodes_without_rejections(capture: dict[str, Any]) -> None:
    decoder, events = _decode_all(capture)
    assert decoder.accepted == len(capture["frames"]) > 0
    assert not decoder.rejected
    kinds = {type(e) for e in events}
    assert BlockStored in kinds and BlockRemoved in kinds
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert all(e.block_size == capture["block_size"] for e in stored)
    assert {e.tier for e in stored} == {Tier.GPU}


def test_capture_sequence_numbers_are_contiguous(capture: dict[str, Any]) -> None:
    seqs = [int.from_bytes(f[1], "big") for f in capture["frames"]]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_capture_key_parity_with_request_side(capture: dict[str, Any]) -> None:
    """Keys rebuilt from the engine's events equal the keys the router computes from prompts."""
    _, events = _decode_all(capture)
    block_size = capture["block_size"]
    key_of: dict[int, int] = {}
    ns_of: dict[int, str] = {}
    removed_unknown = 0
    for ev in events:
        if isinstance(ev, BlockStored):
            if ev.parent_hash is None:
                ns = ev.namespace or ""
                seed = root_seed(MODEL, ns)
            else:
                ns, seed = ns_of[ev.parent_hash], key_of[ev.parent_hash]
            for h, k in zip(
                ev.block_hashes, chain_keys(ev.token_ids, block_size, seed), strict=True
            ):
                key_of[h], ns_of[h] = k, ns
        elif isinstance(ev, BlockRemoved):
            removed_unknown += sum(h not in key_of for h in ev.block_hashes)
    assert removed_unknown == 0, "a removal named a block never reported stored"
    reported = set(key_of.values())
    checked = 0
    for seq in capture["sequences"]:
        expected = prefix_keys(seq["token_ids"], block_size, MODEL, _namespace(seq))
        checked += len(expected)  # a prompt shorter than one block has nothing to cache
        missing = [i for i, k in enumerate(expected) if k not in reported]
        assert not missing, f"{seq['label']}: blocks {missing} of {len(expected)} not in the stream"
    assert checked > 0


def test_salted_sequences_get_their_own_namespace(capture: dict[str, Any]) -> None:
    salted = [s for s in capture["sequences"] if s.get("cache_salt")]
    if not salted:
        pytest.skip(f"{capture['engine']} capture has no salted request")
    _, events = _decode_all(capture)
    roots = {e.namespace for e in events if isinstance(e, BlockStored) and e.parent_hash is None}
    assert {_namespace(s) for s in salted} <= roots
    assert "" in roots


def _vllm_captures() -> list[Any]:
    from conftest import EVENTS_DIR

    return sorted(EVENTS_DIR.glob("vllm-*.msgpack"))


@pytest.mark.parametrize("path", _vllm_captures(), ids=lambda p: p.stem)
def test_vllm_capture_reports_reset_as_all_cleared(path: Any) -> None:
    """`/reset_prefix_cache` is one tier-less clear, published with the next step's batch: with
    the store of the request sent after it (its blocks get the hashes they had before the reset,
    vLLM's hashes being deterministic), or alone when that request fills no block."""
    from conftest import load_capture

    capture = load_capture(path)
    capture["path"] = path
    block_size = capture["block_size"]
    batches = [StreamDecoder().decode_frames(f) for f in capture["frames"]]
    events = [e for b in batches if b is not None for e in b.events]
    clears = [i for i, e in enumerate(events) if isinstance(e, AllCleared)]
    assert len(clears) == 1 and events[clears[0]] == AllCleared(tier=None)
    before, after = events[: clears[0]], events[clears[0] + 1 :]

    hash_of = {k: h for h, k in _keys_by_hash(before).items()}
    last = capture["sequences"][-1]  # the request sent after the reset
    namespace = _namespace(last)
    keys = prefix_keys(last["token_ids"], block_size, MODEL, namespace)
    n = len(keys) * block_size
    expected = [
        BlockStored(
            [hash_of[k] for k in keys], None, last["token_ids"][:n], block_size, Tier.GPU,
            namespace, last.get("lora"),
        )
    ] if keys else []  # fmt: skip
    assert after == expected
    assert batches[-1] is not None and batches[-1].events == [AllCleared(), *expected]


def _keys_by_hash(events: list[Any]) -> dict[int, int]:
    """Engine hash → canonical key of every stored block (the index's ingestion, in short)."""
    key_of: dict[int, int] = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            seed = (
                root_seed(MODEL, ev.namespace or "")
                if ev.parent_hash is None
                else key_of[ev.parent_hash]
            )
            keys = chain_keys(ev.token_ids, ev.block_size, seed)
            key_of.update(zip(ev.block_hashes, keys, strict=True))
    return key_of


def test_vllm_lora_capture_keeps_adapters_apart() -> None:
    """vLLM 0.32 serving adapters `a` and `b` (scripts/capture_vllm_events.py --lora): equal
    prompts under the base model and each adapter are distinct blocks in the engine, so they
    get distinct namespaces and keys; the keys equal the router's for the same requests."""
    from conftest import EVENTS_DIR, load_capture

    capture = load_capture(EVENTS_DIR / "vllm-0.32.0-lora-bs32.msgpack")
    capture["path"] = EVENTS_DIR / "vllm-0.32.0-lora-bs32.msgpack"
    decoder, events = _decode_all(capture)
    assert not decoder.rejected
    roots = [e for e in events if isinstance(e, BlockStored) and e.parent_hash is None]
    by_label = {s["label"]: s for s in capture["sequences"]}
    prompt = by_label["base"]["token_ids"]
    firsts = {
        (r.namespace, r.lora): r.block_hashes[0] for r in roots if r.token_ids[:32] == prompt[:32]
    }
    assert firsts.keys() == {("", None), ("\0a", "a"), ("\0b", "b"), ("tenant-a\0a", "a")}
    assert len(set(firsts.values())) == 4  # the engine's own hashes differ too

    keys = _keys_by_hash(events).values()
    per_request = {}
    for label in ("base", "lora-a", "lora-b", "lora-a-salted"):
        seq = by_label[label]
        body = {"model": seq["lora"] or "tiny", "cache_salt": seq["cache_salt"]}
        per_request[label] = prefix_keys(prompt, 32, MODEL, request_namespace(body, "tiny"))
        assert set(per_request[label]) <= set(keys), label
    assert len({k for ks in per_request.values() for k in ks}) == 4 * (len(prompt) // 32)


def _frames(payload: bytes, seq: int = 0) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), payload]


def test_warply_batch_round_trip() -> None:
    events = [
        BlockStored([11, 12], None, list(range(32)), 16, Tier.CPU, "tenant"),
        BlockRemoved([11], Tier.GPU),
        LoadSnapshot(running=2, waiting=1, kv_usage=0.25, kv_blocks_total=100),
    ]
    decoder = StreamDecoder()
    batch = decoder.decode_frames(_frames(encode_batch(events, 1.5, "w0"), seq=7))
    assert batch is not None and batch.source == "warply"
    assert (batch.seq, batch.ts, batch.events) == (7, 1.5, events)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"\x00" * 8, b"\xc1"], Rejection.BAD_MSGPACK),
        ([b"kv", b"\x00" * 8], Rejection.BAD_FRAME),
        ([b"kv", b"\x00" * 4, b"\x90"], Rejection.BAD_FRAME),
        ([b"kv"], Rejection.BAD_FRAME),
        ([b"a", b"b", b"c", b"d"], Rejection.BAD_FRAME),
        (_frames(encode_batch([LoadSnapshot(1, 0, 0.1)], 1.0)[:-4]), Rejection.BAD_MSGPACK),
        (_frames(b"\xc1"), Rejection.BAD_MSGPACK),
        (
            _frames(msgspec.msgpack.encode(["warply", PROTOCOL_VERSION + 1, 1.0, []])),
            Rejection.UNSUPPORTED_VERSION,
        ),
        (
            _frames(msgspec.msgpack.encode(["warply", PROTOCOL_VERSION, 1.0, [["nope"]]])),
            Rejection.BAD_SCHEMA,
        ),
        (
            _frames(
                msgspec.msgpack.encode(
                    ["warply", PROTOCOL_VERSION, 1.0, [["stored", [1], None, [1, 2], 16]]]
                )
            ),
            Rejection.BAD_SCHEMA,
        ),
        (
            _frames(msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "Mystery"}]})),
            Rejection.BAD_SCHEMA,
        ),
        (
            _frames(msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1] * 15, 16]]])),
            Rejection.BAD_SCHEMA,
        ),
        (
            _frames(msgspec.msgpack.encode([1.0, [["BlockRemoved", [1.5], "GPU"]]])),
            Rejection.BAD_SCHEMA,
        ),
        (_frames(msgspec.msgpack.encode("hello")), Rejection.BAD_SCHEMA),
    ],
)
def test_malformed_input_is_counted_not_raised(frames: list[bytes], reason: Rejection) -> None:
    decoder = StreamDecoder("t")
    assert decoder.decode_frames(frames) is None
    assert decoder.rejected == {reason: 1}
    good = decoder.decode_frames(_frames(encode_batch([LoadSnapshot(1, 0, 0.1)], time.time())))
    assert good is not None and decoder.accepted == 1


def test_engine_encodings_map_and_array_agree() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [b"\x01" * 32],
        "parent_block_hash": None,
        "token_ids": [5] * 16,
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU_TIER1",
        "lora_name": None,
        "extra_keys": [["salt-1"]],
    }
    as_array = [
        "BlockStored",
        [b"\x01" * 32],
        None,
        [5] * 16,
        16,
        None,
        "CPU_TIER1",
        None,
        [["salt-1"]],
    ]
    a = StreamDecoder().decode_frames(
        _frames(msgspec.msgpack.encode({"ts": 1.0, "events": [stored]}))
    )
    b = StreamDecoder().decode_frames(_frames(msgspec.msgpack.encode([1.0, [as_array], 0])))
    assert a is not None and b is not None and a.events == b.events
    ev = a.events[0]
    assert isinstance(ev, BlockStored)
    assert (ev.tier, ev.namespace, ev.block_hashes[0] < 2**64) == (Tier.CPU, "salt-1", True)


def test_an_unknown_medium_skips_that_event_and_keeps_the_batch() -> None:
    """One policy on every path: an event on a medium with no tier is counted and left out;
    the rest of its batch (and its sequence number) goes through."""
    tokens = list(range(16))
    batch = [
        1.0,
        [
            ["BlockStored", [1], None, tokens, 16, None, "TAPE"],
            ["BlockStored", [2], None, tokens, 16, None, "GPU", None, [["salt"]]],
            {"type": "BlockRemoved", "block_hashes": [3], "medium": "TAPE"},
            {"type": "BlockRemoved", "block_hashes": [4], "medium": "STORAGE"},
            {"type": "AllBlocksCleared"},
        ],
    ]
    decoder = StreamDecoder("t")
    got = decoder.decode_frames(_frames(msgspec.msgpack.encode(batch), seq=5))
    assert got == DecodedBatch(
        5,
        1.0,
        [
            BlockStored([2], None, tokens, 16, Tier.GPU, "salt", None),
            BlockRemoved([4], Tier.SSD),
            AllCleared(),
        ],
        "engine",
    )
    assert decoder.rejected == {Rejection.UNKNOWN_MEDIUM: 2}
    assert decoder.accepted == 1
    only_unknown = [1.0, [["BlockRemoved", [3], "TAPE"]]]
    got = decoder.decode_frames(_frames(msgspec.msgpack.encode(only_unknown), seq=6))
    assert got == DecodedBatch(6, 1.0, [], "engine")
    assert decoder.rejected == {Rejection.UNKNOWN_MEDIUM: 3}


def test_lora_adapter_joins_the_namespace() -> None:
    """vLLM 0.32 puts the adapter first in every block's extra keys and the salt after it on
    the root; SGLang 0.5.23 sends `cache_salt` and `lora_name`. Both give one namespace, the one
    the router builds from the request (`model` names the adapter)."""
    tokens = list(range(16))

    def decode(event: dict[str, Any]) -> BlockStored:
        got = StreamDecoder().decode_frames(
            _frames(msgspec.msgpack.encode([1.0, [{"type": "BlockStored", **event}]]))
        )
        assert got is not None and isinstance(got.events[0], BlockStored)
        return got.events[0]

    base = {"block_hashes": [1], "parent_block_hash": None, "token_ids": tokens, "block_size": 16}
    vllm = decode({**base, "lora_name": "a", "extra_keys": [["a", "t"]], "medium": "GPU"})
    sglang = decode({**base, "lora_name": "a", "cache_salt": "t", "medium": "GPU"})
    assert vllm == sglang == BlockStored([1], None, tokens, 16, Tier.GPU, "t\0a", "a")
    assert vllm.namespace == request_namespace({"model": "a", "cache_salt": "t"}, "base-model")
    unsalted = decode({**base, "lora_name": "a", "extra_keys": [["a"]]})
    assert unsalted.namespace == "\0a" == request_namespace({"model": "a"}, "base-model")
    # A salt equal to the adapter's name is still a salt.
    same = decode({**base, "lora_name": "a", "extra_keys": [["a", "a"]]})
    assert same.namespace == "a\0a"
    plain = decode({**base, "extra_keys": [["t"]]})
    assert plain.namespace == "t" == request_namespace({"model": "m", "cache_salt": "t"}, "m")
    child = decode({**base, "parent_block_hash": 7, "lora_name": "a", "extra_keys": [["a"]]})
    assert (child.namespace, child.lora) == (None, "a")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (5, 5),
        (-1, 2**64 - 1),  # SGLang's signed int64 page heads
        (2**64 + 3, 3),
        (b"\x00\x01", 1),
        (b"\x01" * 32, None),  # vLLM digests with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
    ],
)
def test_engine_block_ids_fold_to_u64(value: int | bytes, expected: int | None) -> None:
    import xxhash

    got = engine_block_id(value)
    assert got == (xxhash.xxh3_64_intdigest(value) if expected is None else expected)
    assert 0 <= got < 2**64
