"""Tier policies: each built-in's rule on synthetic state, the registry, the prefix tracker, and
the runner against a fake plugin control socket (ZMQ ROUTER on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from importlib.metadata import EntryPoint
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from router.config import ConfigError, PoolConfig, TieringConfig, TierPolicyConfig
from router.index import MemoryStore, PrefixIndex, StoreUnavailable
from router.metrics.registry import Series
from router.tiering import (
    Action,
    PrefixState,
    PrefixTracker,
    TierPolicy,
    TierRunner,
    TierState,
    WorkerState,
    make_policy,
    policy_class,
)
from router.workers import Workers
from warply.common import loading
from warply.launch import free_port
from warply.protocol import BlockStored, DirectiveAck, DirectiveKind, Tier, decode_directive

NOW = 10_000.0


def _prefix(
    head: int = 1,
    worker: str = "w0",
    namespace: str = "",
    hits: Sequence[float] = (),
    last_use: float = NOW,
    tiers: dict[Tier, int] | None = None,
    requests: int = 1,
    pinned: bool = False,
    copies: frozenset[Tier] = frozenset(),
) -> PrefixState:
    return PrefixState(
        namespace, head, worker, (head, head + 1), requests, tuple(hits), last_use,
        tiers if tiers is not None else {Tier.GPU: 2}, 1000, pinned, copies,
    )  # fmt: skip


def _worker(name: str = "w0", usage: float = 0.5) -> WorkerState:
    return WorkerState(name, "p", usage, 1000, {}, True)


def _kinds(actions: Sequence[Action]) -> list[tuple[str, int, Tier | None]]:
    return [(a.kind.value, a.keys[0] if a.keys else 0, a.tier) for a in actions]


def test_lru_by_tier_demotes_the_least_recent_when_full() -> None:
    policy = make_policy(TierPolicyConfig(name="lru_by_tier", knobs={"max_per_worker": 2}))
    prefixes = [
        _prefix(1, last_use=NOW - 500),
        _prefix(2, last_use=NOW - 900),
        _prefix(3, last_use=NOW - 700),
        _prefix(4, last_use=NOW - 10),  # too recent
        _prefix(5, last_use=NOW - 999, pinned=True),  # pinned
        _prefix(6, last_use=NOW - 999, tiers={Tier.CPU: 2}),  # not on gpu
    ]
    full = TierState(NOW, prefixes, {"w0": _worker(usage=0.95)})
    assert _kinds(policy.decide(full)) == [("offload", 2, Tier.CPU), ("offload", 3, Tier.CPU)]
    assert policy.decide(TierState(NOW, prefixes, {"w0": _worker(usage=0.5)})) == []
    evicting = make_policy(TierPolicyConfig(name="lru_by_tier", knobs={"demote_to": None}))
    assert _kinds(evicting.decide(full))[0] == ("evict", 2, Tier.GPU)


def test_hot_prefix_pin_pins_after_k_hits_and_unpins_when_cold() -> None:
    policy = make_policy(TierPolicyConfig(name="hot_prefix_pin", knobs={"k": 3, "window_s": 60}))
    two = [NOW - 5, NOW - 1]
    three = [NOW - 50, *two]
    assert policy.decide(TierState(NOW, [_prefix(hits=two)], {})) == []
    assert _kinds(policy.decide(TierState(NOW, [_prefix(hits=three)], {}))) == [
        ("pin", 1, Tier.GPU)
    ]
    old = [NOW - 500] * 5  # hot once, outside the window now
    assert policy.decide(TierState(NOW, [_prefix(hits=old)], {})) == []
    cold = _prefix(hits=old, pinned=True)
    assert _kinds(policy.decide(TierState(NOW, [cold], {}))) == [("unpin", 1, None)]
    still_hot = _prefix(hits=three, pinned=True)
    assert policy.decide(TierState(NOW, [still_hot], {})) == []
    on_cpu = _prefix(hits=three, tiers={Tier.CPU: 2})
    assert _kinds(policy.decide(TierState(NOW, [on_cpu], {}))) == [("prefetch", 1, Tier.GPU)]


def test_tenant_quota_offloads_the_excess_and_sends_the_quota_once() -> None:
    knobs = {"quotas": {"a": {"gpu": 3000}}, "default": {"gpu": 100_000}}
    policy = make_policy(TierPolicyConfig(name="tenant_quota", knobs=knobs))
    prefixes = [  # 2 blocks x 1000 bytes each: namespace a holds 6000 gpu bytes
        _prefix(1, namespace="a", last_use=NOW - 30),
        _prefix(2, namespace="a", last_use=NOW - 90),
        _prefix(3, namespace="a", last_use=NOW - 60),
        _prefix(4, namespace="b", last_use=NOW - 999),  # b is under the default
    ]
    state = TierState(NOW, prefixes, {"w0": _worker()})
    actions = policy.decide(state)
    assert actions[0] == Action.quota("w0", "a", Tier.GPU, 3000)
    assert _kinds(actions[1:]) == [("offload", 2, Tier.CPU), ("offload", 3, Tier.CPU)]
    assert _kinds(policy.decide(state)) == [("offload", 2, Tier.CPU), ("offload", 3, Tier.CPU)]
    evict = make_policy(TierPolicyConfig(name="tenant_quota", knobs={**knobs, "action": "evict"}))
    assert _kinds(evict.decide(state)[1:])[0] == ("evict", 2, Tier.GPU)


def test_rag_warm_keeps_shared_prefixes_on_ssd_and_warms_them_after_a_restart() -> None:
    policy = make_policy(TierPolicyConfig(name="rag_warm", knobs={"namespaces": ["docs"]}))
    shared = _prefix(1, namespace="docs", requests=3)
    lone = _prefix(2, namespace="docs", requests=1)
    other = _prefix(3, namespace="chat", requests=9)
    state = TierState(NOW, [shared, lone, other], {})
    assert _kinds(policy.decide(state)) == [("offload", 1, Tier.SSD)]
    assert policy.decide(state) == []  # asked already; not repeated within resend_s
    copied = _prefix(1, namespace="docs", requests=3, copies=frozenset({Tier.SSD}))
    assert policy.decide(TierState(NOW, [copied], {})) == []
    restarted = _prefix(
        1, namespace="docs", requests=3, hits=[NOW - 5], tiers={Tier.SSD: 2},
    )  # fmt: skip
    assert _kinds(policy.decide(TierState(NOW, [restarted], {}))) == [("prefetch", 1, Tier.GPU)]


class Sticky(TierPolicy):
    """A user policy in a few lines: pin every prefix with two requests."""

    name = "sticky"

    def decide(self, state: TierState) -> Sequence[Action]:
        return [Action.on(DirectiveKind.PIN, p) for p in state.prefixes if p.requests >= 2]


class Broken(TierPolicy):
    name = "broken"

    def decide(self, state: TierState) -> Sequence[Action]:
        raise RuntimeError("policy bug")


def test_registry_entry_point_path_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert policy_class("lru_by_tier").name == "lru_by_tier"
    assert policy_class(f"{__name__}:Sticky") is Sticky
    ep = EntryPoint("sticky", f"{__name__}:Sticky", "warply.tier_policies")

    def fake_entry_points(**kw: Any) -> list[EntryPoint]:
        group_ok = kw.get("group") == "warply.tier_policies"
        return [ep] if group_ok and kw.get("name") in (None, "sticky") else []

    monkeypatch.setattr(loading, "entry_points", fake_entry_points)
    assert policy_class("sticky") is Sticky
    with pytest.raises(ConfigError, match="unknown tier policy 'nope' .*sticky"):
        policy_class("nope")
    with pytest.raises(ConfigError, match="is not a router.tiering.TierPolicy subclass"):
        policy_class("router.tiering:Action")
    with pytest.raises(ConfigError, match=r"tiering.policy.knobs.k: Input should be greater"):
        make_policy(TierPolicyConfig(name="hot_prefix_pin", knobs={"k": 0}))
    with pytest.raises(ConfigError, match=r"tiering.policy.knobs.nope: Extra inputs"):
        make_policy(TierPolicyConfig(name="rag_warm", knobs={"nope": 1}))


def test_tracker_splits_prefixes_where_chains_part_and_stays_bounded() -> None:
    tracker = PrefixTracker(max_prefixes=2, max_blocks=3)
    tracker.record("a", [1, 2, 3, 4], "w0", 0, 1.0)
    tracker.record("a", [5], "w0", 0, 3.0)
    tracker.record("a", [6], "w1", 0, 4.0)  # evicts the least recent: head 1
    assert [pid for pid, _ in tracker.items()] == [("a", 5, "w0"), ("a", 6, "w1")]
    tracker = PrefixTracker(max_blocks=3)
    tracker.record("a", [1, 2, 3, 4], "w0", 0, 1.0)
    tracker.record("a", [1, 2, 9], "w0", 2, 2.0)  # shares [1, 2], held by the worker
    tracker.record("a", [1, 2, 9, 7], "w0", 3, 5.0)  # held [1, 2, 9]: the [9] prefix hit too
    tracked = {pid[1]: e for pid, e in tracker.items()}
    assert {h: e.keys for h, e in tracked.items()} == {1: [1, 2], 3: [3], 9: [9]}
    assert (tracked[1].requests, list(tracked[1].hit_times)) == (3, [2.0, 5.0])
    assert (tracked[3].requests, list(tracked[3].hit_times), tracked[3].last_use) == (1, [], 1.0)
    assert (tracked[9].requests, list(tracked[9].hit_times)) == (2, [5.0])
    tracker.record("b", [1, 2], "w0", 0, 6.0)  # another namespace: its own tree
    assert len(tracker) == 4


@contextlib.asynccontextmanager
async def fake_plugin(reject: set[DirectiveKind]) -> AsyncIterator[tuple[str, list[Any]]]:
    """A plugin control socket that acks every directive (rejecting `reject` kinds)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    seen: list[Any] = []

    async def serve() -> None:
        while True:
            *envelope, payload = await sock.recv_multipart()
            d = decode_directive(payload)
            seen.append(d)
            ok = d.kind not in reject
            ack = DirectiveAck(d.id, ok, "" if ok else f"{d.kind.value}: not here", blocks=2)
            await sock.send_multipart([*envelope, msgspec.msgpack.encode(ack)])

    task = asyncio.create_task(serve())
    try:
        yield endpoint, seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()


def _setup(control: str | None) -> tuple[PrefixIndex, Workers]:
    pool = PoolConfig.model_validate(
        {
            "name": "p",
            "block_size": 2,
            "kv_bytes_per_token": 10,
            "workers": [
                {"name": "w0", "url": "http://127.0.0.1:1", "control": control},
                {"name": "w1", "url": "http://127.0.0.1:2"},
            ],
        }
    )
    return PrefixIndex("m", MemoryStore()), Workers([pool])


def test_runner_sends_counts_and_marks_and_survives_a_failing_policy() -> None:
    async def scenario() -> None:
        async with fake_plugin(reject={DirectiveKind.OFFLOAD}) as (endpoint, seen):
            index, workers = _setup(endpoint)
            stored = BlockStored([11, 12], None, [1, 2, 3, 4], 2)
            await index.apply("w0", [stored])
            await index.apply("w1", [stored])
            keys = list(dict.fromkeys(k for k, *_ in index.store.entries()))  # type: ignore[attr-defined]
            series = Series()
            runner = TierRunner(TieringConfig(), index, workers, series, policy=Sticky())
            for worker in ("w0", "w0", "w1", "w1"):
                runner.tracker.record("", keys, worker, 1, 1.0)
            await runner.round()
            assert [d.kind for d in seen] == [DirectiveKind.PIN]
            assert seen[0].keys == keys
            stats = runner.stats()
            assert stats.directives == {"pin": {"applied": 1, "no_control": 1}}
            assert stats.pinned_prefixes == 1
            state = await runner.snapshot()
            w0 = next(p for p in state.prefixes if p.worker == "w0")
            assert w0.pinned and w0.blocks_by_tier == {Tier.GPU: 2} and w0.block_bytes == 20

            runner.policy = Broken()
            await runner.round()
            stats = runner.stats()
            assert stats.policy_failures == 1 and stats.last_error == "RuntimeError: policy bug"

            class Offloader(TierPolicy):
                name = "offloader"

                def decide(self, state: TierState) -> Sequence[Action]:
                    return [Action.on(DirectiveKind.OFFLOAD, p, Tier.CPU) for p in state.prefixes]

            runner.policy = Offloader()
            await runner.round()
            stats = runner.stats()
            assert stats.directives["offload"] == {"rejected": 1, "no_control": 1}
            assert stats.last_rejection == "offload on w0: offload: not here"
            assert stats.rounds == 3
            text = series.render().decode()
            assert 'warply_tiering_directives_total{kind="pin",outcome="applied"} 1.0' in text
            assert "warply_tiering_policy_failures_total 1.0" in text

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_runner_counts_a_timeout() -> None:
    async def scenario() -> None:
        silent = f"tcp://127.0.0.1:{free_port()}"  # nothing answers there
        index, workers = _setup(silent)
        await index.apply("w0", [BlockStored([11], None, [1, 2], 2)])
        config = TieringConfig(directive_timeout_s=0.2)
        runner = TierRunner(config, index, workers, Series(), policy=Sticky())
        keys = list(dict.fromkeys(k for k, *_ in index.store.entries()))  # type: ignore[attr-defined]
        runner.tracker.record("", keys, "w0", 1, 1.0)
        runner.tracker.record("", keys, "w0", 1, 1.0)
        await runner.round()
        assert runner.stats().directives == {"pin": {"timeout": 1}}

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_runner_skips_its_round_while_the_index_store_is_down() -> None:
    """A store that cannot answer matches nothing: no directive rests on that, no pin is
    forgotten, and the runner keeps running."""

    class _Down(MemoryStore):
        down = False

        async def match(self, keys: Any, workers: Any) -> Any:
            if self.down:
                raise StoreUnavailable("store refused")
            return await super().match(keys, workers)

    async def scenario() -> None:
        async with fake_plugin(reject=set()) as (endpoint, seen):
            store = _Down()
            index, workers = PrefixIndex("m", store), _setup(endpoint)[1]
            await index.apply("w0", [BlockStored([11, 12], None, [1, 2, 3, 4], 2)])
            keys = list(dict.fromkeys(k for k, *_ in store.entries()))
            runner = TierRunner(TieringConfig(), index, workers, Series(), policy=Sticky())
            runner.tracker.record("", keys, "w0", 1, 1.0)
            runner.tracker.record("", keys, "w0", 1, 1.0)
            await runner.round()
            assert [d.kind for d in seen] == [DirectiveKind.PIN]
            store.down = True
            await runner.round()
            assert len(seen) == 1 and runner.stats().pinned_prefixes == 1
            assert index.outage.failures["match"] >= 1
            store.down = False
            await runner.round()
            assert runner.stats().pinned_prefixes == 1

    asyncio.run(asyncio.wait_for(scenario(), 30))
