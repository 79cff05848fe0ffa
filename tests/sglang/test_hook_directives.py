"""SGLang venv: directives on the real `UnifiedRadixCache` (CPU), and over the control socket."""

from __future__ import annotations

from array import array
from typing import Any

import msgspec
import pytest
import zmq
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from test_hook_export import CHAT_A, CHAT_B, DOC, build_cache, insert

from sglang_hook.applier import DirectiveApplier
from warply.launch import free_port
from warply.protocol import Directive, DirectiveAck, DirectiveKind, Tier, encode_directive
from warply.protocol.control import ControlServer


def _cache(backend: str, page: int) -> tuple[Any, DirectiveApplier]:
    cache, alloc = build_cache(page, backend, 2048)
    insert(cache, alloc, CHAT_A)
    insert(cache, alloc, CHAT_B)
    insert(cache, alloc, DOC)
    return cache, DirectiveApplier(cache, max_pinned_fraction=0.5)


def _cached(cache: Any, tokens: list[int]) -> int:
    return int(
        cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_prefix_len
    )


@pytest.mark.parametrize("backend", ["rust", "python"])
@pytest.mark.parametrize("page", [1, 16])
def test_pin_survives_a_sweep_and_unpin_releases(backend: str, page: int) -> None:
    cache, applier = _cache(backend, page)
    ack = applier.apply(Directive("p1", DirectiveKind.PIN, token_ids=CHAT_A))
    full = len(CHAT_A) // page * page
    assert ack.applied and ack.blocks == full // page, ack
    cache.evict(EvictParams(num_tokens=100_000))
    assert _cached(cache, CHAT_A) == full
    assert _cached(cache, DOC) == 0
    ack = applier.apply(Directive("u1", DirectiveKind.UNPIN, token_ids=CHAT_A))
    assert ack.applied and ack.blocks == full // page
    cache.evict(EvictParams(num_tokens=100_000))
    assert _cached(cache, CHAT_A) == 0


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_unknown_prefix_and_unsupported_moves_are_rejected(backend: str) -> None:
    cache, applier = _cache(backend, 16)
    unknown = [7] * 64
    for kind in (DirectiveKind.PIN, DirectiveKind.UNPIN, DirectiveKind.EVICT):
        ack = applier.apply(Directive(f"x-{kind}", kind, token_ids=unknown))
        assert not ack.applied and ack.reason == "no cached blocks for this prefix"
    ack = applier.apply(Directive("k", DirectiveKind.PIN, keys=[1, 2]))
    assert not ack.applied and "token_ids" in ack.reason
    for kind in (DirectiveKind.PREFETCH, DirectiveKind.OFFLOAD):
        ack = applier.apply(Directive(f"m-{kind}", kind, token_ids=CHAT_A, tier=Tier.CPU))
        assert not ack.applied and "host tier is not enabled" in ack.reason
    ack = applier.apply(Directive("salted", DirectiveKind.PIN, token_ids=CHAT_A, namespace="t1"))
    assert not ack.applied  # cached without a salt: another namespace does not see it


def test_pin_ttl_expires() -> None:
    cache, applier = _cache("python", 16)
    assert applier.apply(Directive("p", DirectiveKind.PIN, token_ids=DOC, ttl_s=1e-6)).applied
    applier.expire()
    assert applier.pinned_tokens == 0
    cache.evict(EvictParams(num_tokens=100_000))
    assert _cached(cache, DOC) == 0


def test_pin_cap() -> None:
    cache, _ = _cache("rust", 16)
    applier = DirectiveApplier(cache, max_pinned_fraction=0.05)  # 102 of 2048 tokens
    ack = applier.apply(Directive("p", DirectiveKind.PIN, token_ids=DOC))
    assert not ack.applied and "max_pinned_fraction" in ack.reason


def test_evict_drops_a_leaf_on_the_python_core_and_is_refused_on_rust() -> None:
    cache, applier = _cache("python", 16)
    ack = applier.apply(Directive("e", DirectiveKind.EVICT, token_ids=DOC))
    assert ack.applied and ack.blocks == len(DOC) // 16, ack
    assert _cached(cache, DOC) == 0 and _cached(cache, CHAT_A) == len(CHAT_A) // 16 * 16
    # The shared system prompt has cached continuations: not a leaf.
    ack = applier.apply(Directive("e2", DirectiveKind.EVICT, token_ids=CHAT_A[:96]))
    assert not ack.applied and "leaf" in ack.reason
    applier.apply(Directive("p", DirectiveKind.PIN, token_ids=CHAT_B))
    ack = applier.apply(Directive("e3", DirectiveKind.EVICT, token_ids=CHAT_B))
    assert not ack.applied and "locked" in ack.reason

    rust, rust_applier = _cache("rust", 16)
    ack = rust_applier.apply(Directive("e", DirectiveKind.EVICT, token_ids=DOC))
    assert not ack.applied and "Python tree core" in ack.reason
    assert _cached(rust, DOC) == len(DOC) // 16 * 16


def test_control_socket_round_trip() -> None:
    cache, applier = _cache("rust", 16)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = ControlServer(endpoint)
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(endpoint)
    try:
        client.send(encode_directive(Directive("p", DirectiveKind.PIN, token_ids=CHAT_A)))
        client.send(b"\xc1garbage")
        got = []
        for _ in range(200):
            try:
                got.append(server.inbox.get(timeout=0.05))
            except Exception:  # queue.Empty
                if len(got) == 1:
                    break
        assert len(got) == 1
        envelope, directive = got[0]
        server.reply(envelope, applier.apply(directive))
        replies = []
        while client.poll(2000) and len(replies) < 2:
            replies.append(msgspec.msgpack.decode(client.recv(), type=DirectiveAck))
        assert {(r.directive_id, r.applied) for r in replies} == {("p", True), ("", False)}
    finally:
        client.close()
        server.close()
        applier.release_all()


def test_quota_is_rejected_with_a_reason() -> None:
    _, applier = _cache("python", 16)
    quota = Directive("q1", DirectiveKind.QUOTA, namespace="tenant-a", quota_bytes=1 << 20)
    ack = applier.apply(quota)
    assert not ack.applied and "no per-namespace quota" in ack.reason
