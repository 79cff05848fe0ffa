"""The LMCache MP server (`lmcache server`, LMCache 0.5.6) behind a wrapped LMCacheMPConnector:
its own byte count for the cpu tier, and evictions through its HTTP API.

The server's L1 (host memory) is Warply's cpu tier. `GET /status` reports its occupancy as
`storage_manager.l1_usage = [used_bytes, total_bytes]`; a daemon thread polls it, so the
scheduler thread only reads the last figure. `DELETE /cache/objects` with `tier: "l1"` drops
named chunks from L1 (locked chunks are skipped and counted). Its object keys are LMCache's own
chunk hashes: they are resolved here with LMCache's key resolver and token hasher (the server's
`chunk_size` and `hash_algorithm` from `/status`) and the model name and world size the delegate
registered with. LMCache 0.5.6's MP server has no pin API, its `/quota` scopes only L2 adapters
(IsolatedLRU) and `/cache/prefetches` moves only L2 → L1, so evict is what Warply directs there.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

from warply.protocol import Tier

_log = logging.getLogger(__name__)
_TIMEOUT_S = 5.0


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
            self._bytes = {Tier.CPU: int(status["storage_manager"]["l1_usage"][0])}
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LMCacheError(f"GET /status: unexpected reply ({exc!r})") from None
        return status

    def evict(
        self, token_ids: list[int], cache_salt: str, model_name: str, world_size: int
    ) -> tuple[int, int]:
        """Drop the L1 chunks of `token_ids`' whole chunks; returns (deleted, skipped as locked)."""
        keys = self._object_keys(token_ids, cache_salt, model_name, world_size)
        if not keys:
            return 0, 0
        reply = self._request("DELETE", "/cache/objects", {"keys": keys, "tier": "l1"})
        return int(reply["deleted"]), int(reply["skipped"])

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
