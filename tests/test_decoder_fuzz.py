"""Malformed state-stream input never stops a subscriber: hypothesis over frames (wrong part
counts, bad sequence numbers), payloads (random bytes, random msgpack) and batches shaped like
the engines' and Warply's (wrong types, unknown tags, huge lists). Every frame is either accepted
or rejected and counted once; nothing raises. Derandomized, small example counts (seconds)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_router_api import running, tokenizer_dir  # noqa: F401
from warply.launch import HOST, free_port
from warply.protocol import DecodedBatch, StreamDecoder
from warply.protocol.events import PROTOCOL_VERSION

FUZZ = settings(
    max_examples=200, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip

_SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
_ANY = st.recursive(
    _SCALAR,
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=10) | st.integers(-(2**63), 2**63 - 1), inner, max_size=4),
    max_leaves=25,
)
_TAGS = st.sampled_from(
    ["BlockStored", "BlockRemoved", "AllBlocksCleared", "Unknown", "", "block_stored"]
)
_IDS = st.lists(st.integers(min_value=-(2**63), max_value=2**64 - 1), max_size=40)
_FIELDS = {
    "block_hashes": _IDS | _ANY,
    "parent_block_hash": st.none() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | _ANY,
    "token_ids": _IDS | _ANY,
    "block_size": st.integers(min_value=-2, max_value=64) | _ANY,
    "medium": st.sampled_from([None, "GPU", "CPU", "cpu", "disk", "tape"]) | _ANY,
    "lora_name": st.none() | st.text(max_size=5) | _ANY,
    "cache_salt": st.none() | st.text(max_size=5) | _ANY,
    "extra_keys": st.none() | _ANY,
}
_MAP_EVENT = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    _TAGS,
    st.fixed_dictionaries({}, optional=_FIELDS),
)
_ARRAY_EVENT = st.builds(lambda tag, rest: [tag, *rest], _TAGS, st.lists(_ANY, max_size=12))
_EVENT = _MAP_EVENT | _ARRAY_EVENT | _ANY
_ENGINE_BATCH = st.builds(
    lambda ts, events, as_map: {"ts": ts, "events": events} if as_map else [ts, events],
    st.floats(allow_nan=False) | _ANY,
    st.lists(_EVENT, max_size=6),
    st.booleans(),
)
_WARPLY_BATCH = st.builds(
    lambda version, rest: ["warply", version, *rest],
    st.just(PROTOCOL_VERSION) | _ANY,
    st.lists(_ANY, max_size=5),
)
_PAYLOAD = (
    st.binary(max_size=300)
    | (_ENGINE_BATCH | _WARPLY_BATCH | _ANY).map(msgspec.msgpack.encode)
)
_SEQ = st.integers(min_value=0, max_value=2**64 - 1).map(lambda n: n.to_bytes(8, "big"))
_FRAMES = (
    st.tuples(st.binary(max_size=4), _SEQ, _PAYLOAD).map(list)
    | st.tuples(_SEQ, _PAYLOAD).map(list)
    | st.lists(st.binary(max_size=12), max_size=5)
)


def _counted(decoder: StreamDecoder) -> int:
    return decoder.accepted + sum(
        n for reason, n in decoder.rejected.items() if reason != "unknown_medium"
    )


@FUZZ
@given(frames=_FRAMES)
def test_any_frame_is_accepted_or_rejected_once(frames: list[bytes]) -> None:
    decoder = StreamDecoder("fuzz")
    result = decoder.decode_frames(frames)
    assert result is None or isinstance(result, DecodedBatch)
    assert _counted(decoder) == 1
    assert (result is not None) == (decoder.accepted == 1)


@settings(FUZZ, max_examples=50)
@given(batches=st.lists(_PAYLOAD, min_size=1, max_size=6))
def test_a_stream_of_bad_payloads_keeps_decoding(batches: list[bytes]) -> None:
    decoder = StreamDecoder("fuzz")
    good = msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}]})
    for seq, payload in enumerate(batches):
        decoder.decode_payload(seq, payload)
    assert _counted(decoder) == len(batches)
    assert decoder.decode_payload(len(batches), good) is not None  # the next good one still reads


def test_huge_lists_are_decoded_or_rejected_without_raising() -> None:
    decoder = StreamDecoder("huge")
    n = 200_000
    stored: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(range(n // 16)),
        "parent_block_hash": None,
        "token_ids": list(range(n)),
        "block_size": 16,
        "medium": "GPU",
    }
    many = {"ts": 1.0, "events": [{"type": "AllBlocksCleared"}] * n}
    wrong = {"ts": 1.0, "events": [dict(stored, token_ids=list(range(n + 3)))]}
    # events nested 100k lists deep, written by hand (an encoder refuses such depth)
    head = msgspec.msgpack.encode({"ts": 1.0, "events": None})[:-1]
    deep = head + b"\x91" * 100_000 + b"\x90"
    payloads = [
        msgspec.msgpack.encode({"ts": 1.0, "events": [stored]}),
        msgspec.msgpack.encode(many),
        msgspec.msgpack.encode(wrong),
        b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 G items, with none
        deep,
    ]
    results = [decoder.decode_payload(i, p) for i, p in enumerate(payloads)]
    assert results[0] is not None and len(results[0].events) == 1
    assert results[1] is not None and len(results[1].events) == n
    assert results[2] is None and results[3] is None and results[4] is None
    assert decoder.accepted == 2 and sum(decoder.rejected.values()) == 3


def test_a_routers_stream_rejections_are_on_its_metrics(tokenizer_dir: Path) -> None:  # noqa: F811
    """Garbage published to a router's state-stream socket: counted per worker and reason on
    /metrics (`warply_stream_rejected`), and the router keeps serving."""
    port = free_port()
    pool = {"name": "p", "block_size": 4, "workers": [{
        "name": "w", "url": f"http://{HOST}:{free_port()}",
        "events": f"tcp://{HOST}:{port}", "bind": True}]}  # fmt: skip
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)

    async def scenario() -> None:
        async with running(tokenizer_dir, [], pools=[pool]) as (_r, call, _s, _b):
            pub.connect(f"tcp://{HOST}:{port}")
            line = 'warply_stream_rejected{reason="bad_msgpack",worker="w"}'
            for _ in range(200):  # until the subscription has joined (ZMQ's slow joiner)
                pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1"])
                await asyncio.sleep(0.05)
                text = (await call("GET", "/metrics"))[1]
                if line in text:
                    break
            assert line in text
            assert (await call("GET", "/health"))[0] == 503  # no healthy engine, but answering

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        pub.close()
