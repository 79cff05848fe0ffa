"""The per-namespace pin budget (`tiering.pin_budget`): the runner refuses any policy's pin that
would take a namespace's pinned bytes, on every tier and worker together, past its budget;
run against the fake plugin control socket of tests/test_tiering.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from test_tiering import Sticky, _setup, fake_plugin

from router.config import ConfigError, PinBudgetConfig, PoolConfig, TieringConfig, load_config
from router.index import MemoryStore, PrefixIndex
from router.metrics.registry import Series, tenant_label
from router.tiering import Action, TierPolicy, TierRunner, TierState
from router.tiering.budget import PinLedger, Refusal
from router.workers import Workers
from warply.launch import free_port
from warply.protocol import BlockStored, DirectiveKind, Tier

BLOCK = 20
"""Bytes per block of `_setup`'s pool (block_size 2 × kv_bytes_per_token 10); its tracked
prefixes have 2 blocks: a pin of one holds 40 bytes."""

_A, _B = tenant_label("a"), tenant_label("b")
"""The /metrics labels of namespaces "a" and "b"."""


async def _runner(
    endpoint: str, budget: PinBudgetConfig, policy: TierPolicy, namespaces: Sequence[str]
) -> tuple[TierRunner, Series]:
    """A runner over w0 (control at `endpoint`) holding one 2-block prefix, tracked twice per
    namespace (the same keys stand for each namespace's own chain)."""
    index, workers = _setup(endpoint)
    await index.apply("w0", [BlockStored([11, 12], None, [1, 2, 3, 4], 2)])
    keys = list(dict.fromkeys(k for k, *_ in index.store.entries()))  # type: ignore[attr-defined]
    series = Series()
    runner = TierRunner(TieringConfig(pin_budget=budget), index, workers, series, policy=policy)
    for namespace in namespaces:
        runner.tracker.record(namespace, keys, "w0", 1, 1.0)
        runner.tracker.record(namespace, keys, "w0", 1, 1.0)
    return runner, series


def test_one_tenant_over_its_budget_is_refused_while_the_other_pins() -> None:
    async def scenario() -> None:
        async with fake_plugin(reject=set()) as (endpoint, seen):
            budget = PinBudgetConfig(default_bytes=1000, namespaces={"a": 30})
            runner, series = await _runner(endpoint, budget, Sticky(), ["a", "b"])
            await runner.round()
            assert [(d.kind, d.namespace) for d in seen] == [(DirectiveKind.PIN, "b")]
            stats = runner.stats()
            assert stats.directives == {"pin": {"applied": 1, "refused": 1}}
            assert stats.pinned_bytes == {"b": 2 * BLOCK}
            text = series.render().decode()
            refused = f'pins_refused_total{{namespace="{_A}",reason="over_budget"}} 1.0'
            assert refused in text
            gauge = f'pinned_bytes{{namespace="{_B}",tier="gpu"}} 40.0'
            assert gauge in text
            state = await runner.snapshot()
            pinned = {p.namespace: p.pinned_on for p in state.prefixes}
            assert pinned == {"a": frozenset(), "b": frozenset({Tier.GPU})}

    asyncio.run(asyncio.wait_for(scenario(), 30))


class _PinOn(TierPolicy):
    """Pins each prefix on each of `tiers` it is not pinned on (gpu: a device pin, cpu: a
    Mooncake store's soft pin), or with `unpin`, unpins it there."""

    name = "pin_on"

    def __init__(self) -> None:
        super().__init__()
        self.tiers: tuple[Tier, ...] = (Tier.GPU, Tier.CPU)
        self.unpin = False

    def decide(self, state: TierState) -> Sequence[Action]:
        if self.unpin:
            kind = DirectiveKind.UNPIN
            return [Action.on(kind, p, t) for p in state.prefixes for t in p.pinned_on]
        return [
            Action.on(DirectiveKind.PIN, p, t)
            for p in state.prefixes
            for t in self.tiers
            if t not in p.pinned_on
        ]


def test_the_budget_spans_tiers() -> None:
    """60 bytes: the gpu pin (40) goes, the cpu pin of the same prefix in the same round would
    make 80 and is refused; once the gpu pin is released the cpu pin fits, and then a gpu pin
    does not."""

    async def scenario() -> None:
        async with fake_plugin(reject=set()) as (endpoint, seen):
            policy = _PinOn()
            budget = PinBudgetConfig(default_bytes=60)
            runner, series = await _runner(endpoint, budget, policy, ["a"])
            await runner.round()
            assert [(d.kind, d.tier) for d in seen] == [(DirectiveKind.PIN, Tier.GPU)]
            assert runner.stats().directives == {"pin": {"applied": 1, "refused": 1}}
            policy.unpin = True
            await runner.round()
            assert (seen[-1].kind, seen[-1].tier) == (DirectiveKind.UNPIN, Tier.GPU)
            assert runner.stats().pinned_bytes == {}
            policy.unpin, policy.tiers = False, (Tier.CPU,)
            await runner.round()
            assert (seen[-1].kind, seen[-1].tier) == (DirectiveKind.PIN, Tier.CPU)
            assert runner.stats().pinned_bytes == {"a": 2 * BLOCK}
            policy.tiers = (Tier.GPU,)
            await runner.round()
            assert len(seen) == 3
            assert runner.stats().directives["pin"] == {"applied": 2, "refused": 2}
            text = series.render().decode()
            assert f'pinned_bytes{{namespace="{_A}",tier="cpu"}} 40.0' in text
            assert f'pinned_bytes{{namespace="{_A}",tier="gpu"}} 0.0' in text

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_zero_budget_allows_no_pin_and_an_override_lifts_the_default() -> None:
    async def scenario() -> None:
        async with fake_plugin(reject=set()) as (endpoint, seen):
            budget = PinBudgetConfig(default_bytes=0, namespaces={"vip": None})
            runner, series = await _runner(endpoint, budget, Sticky(), ["a", "vip"])
            await runner.round()
            assert [d.namespace for d in seen] == ["vip"]
            assert runner.stats().pinned_bytes == {"vip": 2 * BLOCK}
            refused = f'pins_refused_total{{namespace="{_A}",reason="over_budget"}} 1.0'
            assert refused in series.render().decode()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_pin_of_unknown_size_is_refused_under_a_budget_and_charged_0_without() -> None:
    """No bytes per block (no `kv_bytes_per_token`, no engine report): a budget cannot be
    checked, so that namespace's pins are refused (`unknown_bytes`); a namespace without a
    budget pins, charged 0 bytes."""

    async def scenario() -> None:
        async with fake_plugin(reject=set()) as (endpoint, seen):
            pool = PoolConfig.model_validate(
                {"name": "p", "block_size": 2,
                 "workers": [{"name": "w0", "url": "http://127.0.0.1:1", "control": endpoint}]}
            )  # fmt: skip
            index = PrefixIndex("m", MemoryStore())
            await index.apply("w0", [BlockStored([11, 12], None, [1, 2, 3, 4], 2)])
            keys = list(dict.fromkeys(k for k, *_ in index.store.entries()))  # type: ignore[attr-defined]
            config = TieringConfig(pin_budget=PinBudgetConfig(namespaces={"a": 10_000}))
            series = Series()
            runner = TierRunner(config, index, Workers([pool]), series, policy=Sticky())
            for namespace in ("a", "free"):
                runner.tracker.record(namespace, keys, "w0", 1, 1.0)
                runner.tracker.record(namespace, keys, "w0", 1, 1.0)
            await runner.round()
            assert [d.namespace for d in seen] == ["free"]
            assert runner.stats().pinned_bytes == {"free": 0}
            refused = f'pins_refused_total{{namespace="{_A}",reason="unknown_bytes"}} 1.0'
            assert refused in series.render().decode()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_pin_without_an_ack_in_time_keeps_its_charge() -> None:
    async def scenario() -> None:
        silent = f"tcp://127.0.0.1:{free_port()}"  # nothing answers there
        index, workers = _setup(silent)
        await index.apply("w0", [BlockStored([11, 12], None, [1, 2, 3, 4], 2)])
        keys = list(dict.fromkeys(k for k, *_ in index.store.entries()))  # type: ignore[attr-defined]
        config = TieringConfig(
            directive_timeout_s=0.2, pin_budget=PinBudgetConfig(default_bytes=2 * BLOCK)
        )
        runner = TierRunner(config, index, workers, Series(), policy=_PinOn())
        runner.tracker.record("a", keys, "w0", 1, 1.0)
        await runner.round()
        stats = runner.stats()
        assert stats.directives == {"pin": {"timeout": 1, "refused": 1}}
        assert stats.pinned_bytes == {"a": 2 * BLOCK}
        state = await runner.snapshot()
        assert state.prefixes[0].pinned_on == {Tier.GPU}

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_ledger_charges_reservations_and_releases_expired_pins() -> None:
    ledger = PinLedger(PinBudgetConfig(default_bytes=100))
    gpu, cpu = (("a", 1, "w0"), Tier.GPU), (("a", 1, "w0"), Tier.CPU)
    assert ledger.reserve(gpu, 60) is None
    assert ledger.reserve(cpu, 60) is Refusal.OVER_BUDGET  # 60 in flight
    ledger.settle(gpu, 40, until=50.0)  # the ack pinned less than reserved
    assert ledger.reserve(cpu, 60) is None
    ledger.settle(cpu, None, None)  # not applied: its reservation is released
    assert ledger.pinned_bytes() == {("a", Tier.GPU): 40}
    assert ledger.reserve(gpu, 80) is None  # a re-pin is charged the difference (40)
    ledger.settle(gpu, 80, until=50.0)
    ledger.expire(49.0)
    assert ledger.tiers(("a", 1, "w0")) == {Tier.GPU}
    ledger.expire(50.0)
    assert ledger.pinned_bytes() == {} and len(ledger) == 0
    assert ledger.reserve(gpu, None) is Refusal.UNKNOWN_BYTES


def test_pin_budget_config_errors_name_the_field(tmp_path: Path) -> None:
    config: dict[str, Any] = {
        "model": "m",
        "tokenizer": "m",
        "pools": [{"name": "p", "block_size": 2, "workers": [{"name": "w0", "url": "http://x"}]}],
        "tiering": {"pin_budget": {"default_bytes": -1, "namespaces": {"a": "lots"}}},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "tiering.pin_budget.default_bytes: Input should be greater than or equal to 0" in str(
        err.value
    )
    assert "tiering.pin_budget.namespaces.a: Input should be a valid integer" in str(err.value)
    config["tiering"]["pin_budget"] = {"default_bytes": 0, "namespaces": {"vip": None, "b": 5}}
    path.write_text(yaml.safe_dump(config))
    tiering = load_config(path).tiering
    assert tiering is not None
    budget = tiering.pin_budget
    assert (budget.limit("vip"), budget.limit("b"), budget.limit("other")) == (None, 5, 0)
