"""The LMCache MP server (`lmcache server`, LMCache 0.5.6) behind a wrapped LMCacheMPConnector:
its own byte counts, and evictions and prefetches through its HTTP API.

The server's L1 (host memory) is Warply's cpu tier; its L2 adapters are the lower tiers as
`warply.spec` renders them (`fs` → ssd, `resp` / `s3` → object_store). `GET /status` reports L1's
occupancy as `storage_manager.l1_usage = [used_bytes, total_bytes]` and each adapter's settings
(the `fs` adapter's `base_path`, whose files are the ssd tier's bytes: LMCache 0.5.6 keeps no L2
byte count); a daemon thread polls both, so the scheduler thread only reads the last figures.
`DELETE /cache/objects` drops named chunks from L1 (`tier: "l1"`; locked chunks are skipped and
counted) or from one L2 adapter (`tier: "l2"`, `adapter`: its type from `GET /config/adapters`);
`POST /cache/prefetches` loads a prefix's chunks from L2 into L1. Object keys are LMCache's own
chunk hashes: they are resolved here with LMCache's key resolver and token hasher (the server's
`chunk_size` and `hash_algorithm` from `/status`) and the model name and world size the delegate
registered with. LMCache 0.5.6's MP server has no pin API and no L1 → L2 push (its store policy
writes every chunk to every adapter by itself), and its `/quota` scopes only L2 adapters.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from warply.protocol import Tier

_log = logging.getLogger(__name__)
_TIMEOUT_S = 5.0
_ADAPTER_TIERS = {"fs": Tier.SSD, "resp": Tier.OBJECT_STORE, "s3": Tier.OBJECT_STORE}
"""LMCache L2 adapter type → the Warply tier it holds (as `warply.spec` renders them)."""


class LMCacheError(RuntimeError):
    """The server answered with an error, or could not be reached."""


class LMCacheServer:
    """HTTP client of one LMCache MP server; `start()` begins polling `/status`."""

    def __init__(self, url: str, poll_interval_s: float) -> None:
        self.url = url.rstrip("/")
        self._interval = poll_interval_s
        self._bytes: dict[Tier, int] | None = None
        self._layout: tuple[int, str] | None = None
        self._hasher: Any = None
        """LMCache's TokenHasher for the server's chunk size and hash algorithm (built once)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="warply-lmcache", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(_TIMEOUT_S)

    @property
    def tier_bytes(self) -> dict[Tier, int] | None:
        """The server's bytes per tier at the last poll (None: not read yet)."""
        return self._bytes

    def status(self) -> dict[str, Any]:
        """`GET /status` (raises `LMCacheError`)."""
        status: dict[str, Any] = self._request("GET", "/status")
        try:
            self._layout = (int(status["chunk_size"]), str(status["hash_algorithm"]))
            manager = status["storage_manager"]
            found = {Tier.CPU: int(manager["l1_usage"][0])}
            for adapter in manager.get("l2_adapters", []):
                if adapter.get("type") == "FSL2Adapter":
                    found[Tier.SSD] = _folder_bytes(Path(adapter["base_path"]))
            self._bytes = found
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LMCacheError(f"GET /status: unexpected reply ({exc!r})") from None
        return status

    def evict(
        self, tier: Tier, token_ids: list[int], cache_salt: str, model_name: str, world_size: int
    ) -> tuple[int, int]:
        """Drop the chunks of `token_ids`' whole chunks from `tier` (cpu: L1; ssd,
        object_store: the L2 adapter holding it); returns (deleted, skipped as locked)."""
        keys = self._object_keys(token_ids, cache_salt, model_name, world_size)
        if not keys:
            return 0, 0
        body: dict[str, Any] = {"keys": keys, "tier": "l1"}
        if tier is not Tier.CPU:
            body = {"keys": keys, "tier": "l2", "adapter": self.adapter(tier)}
        reply = self._request("DELETE", "/cache/objects", body)
        return int(reply["deleted"]), int(reply["skipped"])

    def prefetch(
        self, token_ids: list[int], cache_salt: str, model_name: str, world_size: int
    ) -> int:
        """Start loading the prefix's chunks from L2 into L1; the chunks the server will load."""
        body = {"model_name": model_name, "world_size": world_size, "token_ids": token_ids,
                "cache_salt": cache_salt, "source_tier": "l2", "target_tier": "l1"}  # fmt: skip
        reply = self._request("POST", "/cache/prefetches", body)
        return int(reply.get("chunks", 0))

    def adapter(self, tier: Tier) -> str:
        """The type name of the server's L2 adapter that holds `tier` (raises `LMCacheError`)."""
        adapters = [a["type_name"] for a in self._request("GET", "/config/adapters")["adapters"]]
        for name in adapters:
            if _ADAPTER_TIERS.get(name) is tier:
                return str(name)
        raise LMCacheError(f"no L2 adapter holds the {tier.value} tier (adapters: {adapters})")

    def _object_keys(
        self, token_ids: list[int], cache_salt: str, model_name: str, world_size: int
    ) -> list[dict[str, Any]]:
        # LMCache's own key derivation (lmcache 0.5.6), imported here: only the engine's process
        # has lmcache installed.
        from lmcache.v1.multiprocess.cache_control.key_resolver import resolve_object_keys
        from lmcache.v1.multiprocess.token_hasher import TokenHasher

        if self._hasher is None:
            if self._layout is None:
                self.status()
            assert self._layout is not None
            chunk_size, algorithm = self._layout
            self._hasher = TokenHasher(chunk_size=chunk_size, hash_algorithm=algorithm)
        keys, _ = resolve_object_keys(self._hasher, model_name, world_size, token_ids, cache_salt)
        return [
            {
                "chunk_hash_hex": k.chunk_hash.hex(),
                "model_name": k.model_name,
                "kv_rank": k.kv_rank,
                "object_group_id": k.object_group_id,
                "cache_salt": k.cache_salt,
            }
            for k in keys
        ]

    def _poll(self) -> None:
        failures = 0
        while not self._stop.wait(self._interval):
            try:
                self.status()
                failures = 0
            except LMCacheError as exc:
                failures += 1
                if failures == 1:
                    _log.warning("Warply: LMCache /status unreadable: %s", exc)

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=_TIMEOUT_S) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raise LMCacheError(f"{method} {path}: HTTP {err.code} {err.read()[:200]!r}") from None
        except (OSError, ValueError) as exc:
            raise LMCacheError(f"{method} {path}: {exc}") from None


def _folder_bytes(root: Path) -> int:
    """Bytes of the files under `root` (the `fs` adapter's chunk files; 0 if it is missing)."""
    total = 0
    for path in root.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:  # a chunk deleted while walking
            continue
    return total
