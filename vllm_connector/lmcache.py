"""The LMCache MP server (`lmcache server`, LMCache 0.5.6) behind a wrapped LMCacheMPConnector:
its own byte counts, and evictions and prefetches through its HTTP API.

The server's L1 (host memory) is Warply's cpu tier; its L2 adapters are the lower tiers as
`warply.spec` renders them (`fs` → ssd, `resp` / `s3` → object_store). `GET /status` reports L1's
occupancy as `storage_manager.l1_usage = [used_bytes, total_bytes]` and each adapter's settings
(the `fs` adapter's `base_path`, whose files are the ssd tier's bytes: LMCache 0.5.6 keeps no L2
byte count that survives a restart). The object_store tier's bytes are read back from the store:
the `s3` adapter's bucket listing (`GET /cache/objects`, LMCache's own ListObjectsV2), or the keys
the `resp` adapter wrote to its redis server (its address from `GET /config`; SCAN + STRLEN),
at most every `_STORE_EVERY_S` and up to `_MAX_OBJECTS` objects. A daemon thread polls them all,
so the scheduler thread only reads the last figures.
`DELETE /cache/objects` drops named chunks from L1 (`tier: "l1"`; locked chunks are skipped and
counted) or from one L2 adapter (`tier: "l2"`, `adapter`: its type from `GET /config/adapters`);
`POST /cache/prefetches` loads a prefix's chunks from L2 into L1. Object keys are LMCache's own
chunk hashes: they are resolved here with LMCache's key resolver and token hasher (the server's
`chunk_size` and `hash_algorithm` from `/status`) and the model name and world size the delegate
registered with. LMCache 0.5.6's MP server has no pin API and no L1 → L2 push (its store policy
writes every chunk to every adapter by itself), and its `/quota` scopes only L2 adapters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_connector.backend_poll import BackendError, PolledBackend
from warply.protocol import Tier

_log = logging.getLogger(__name__)
_TIMEOUT_S = 5.0
_ADAPTER_TIERS = {"fs": Tier.SSD, "resp": Tier.OBJECT_STORE, "s3": Tier.OBJECT_STORE}
"""LMCache L2 adapter type → the Warply tier it holds (as `warply.spec` renders them)."""
_STORE_EVERY_S = 5.0
"""The object store is listed at most this often (a bucket listing is paid per request)."""
_MAX_OBJECTS = 100_000
"""Objects read per listing at most; a store holding more reports no byte count."""
_PAGE = 5000
"""LMCache's largest `/cache/objects` page."""


class LMCacheError(BackendError):
    """The server answered with an error, or in a shape LMCache 0.5.6 does not send, or could
    not be reached."""


_SHAPE_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError)
"""What reading a reply that is not in the expected shape raises."""


@contextlib.contextmanager
def _reply(what: str) -> Iterator[None]:
    """Read a reply of `what` (e.g. `GET /status`): one not in its expected shape is an
    `LMCacheError` naming it, not an exception that ends the polling thread or the directive."""
    try:
        yield
    except _SHAPE_ERRORS as exc:
        raise LMCacheError(f"{what}: unexpected reply ({exc!r})") from None


class LMCacheServer(PolledBackend):
    """HTTP client of one LMCache MP server; `start()` begins polling `/status`."""

    def __init__(self, url: str, poll_interval_s: float) -> None:
        super().__init__("LMCache /status", poll_interval_s, _TIMEOUT_S)
        self.url = url.rstrip("/")
        self._layout: tuple[int, str] | None = None
        self._hasher: Any = None
        """LMCache's TokenHasher for the server's chunk size and hash algorithm (built once)."""
        self._fs_root: Path | None = None
        """The `fs` adapter's folder (from `/status`)."""
        self._adapters: list[str] | None = None
        """The server's L2 adapter types, in its order (read once)."""
        self._redis: Any = None
        """A redis-py client of the `resp` adapter's server (made once)."""
        self._store_bytes: int | None = None
        self._store_read_at = float("-inf")
        self._store_error = ""

    def status(self) -> dict[str, Any]:
        """`GET /status` (raises `LMCacheError`)."""
        status: dict[str, Any] = self._request("GET", "/status")
        with _reply("GET /status"):
            self._layout = (int(status["chunk_size"]), str(status["hash_algorithm"]))
            manager = status["storage_manager"]
            found = {Tier.CPU: int(manager["l1_usage"][0])}
            for adapter in manager.get("l2_adapters", []):
                if adapter.get("type") == "FSL2Adapter":
                    self._fs_root = Path(adapter["base_path"])
                    found[Tier.SSD] = _folder_bytes(self._fs_root)
        store = self._object_store_bytes()
        if store is not None:
            found[Tier.OBJECT_STORE] = store
        self._bytes = found
        return status

    def held(
        self, tier: Tier, token_ids: list[int], cache_salt: str, model_name: str, world_size: int
    ) -> tuple[int, int]:
        """(whole chunks of `token_ids` the adapter holding `tier` has, whole chunks in all),
        read from the store: the `fs` adapter's files, the `resp` adapter's redis keys, or the
        adapter's own listing (`s3`); raises `LMCacheError`."""
        objects = self._object_keys(token_ids, cache_salt, model_name, world_size)
        keys = [_key_id(k) for k in objects]
        adapter = self.adapter(tier)
        if adapter == "resp":
            return self._in_redis(keys), len(keys)
        if adapter == "fs":
            if self._fs_root is None:
                self.status()
            assert self._fs_root is not None
            files = {_file_key(f.name) for f in self._fs_root.glob("*@*.data")}
            return sum((*k[:4], "") in files for k in keys), len(keys)
        entries = self._listing(adapter, model_name)
        with _reply("GET /cache/objects"):
            listed = {_key_id(e["key"]) for e in entries}
        return sum(k in listed for k in keys), len(keys)

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
        with _reply("DELETE /cache/objects"):
            return int(reply["deleted"]), int(reply["skipped"])

    def prefetch(
        self, token_ids: list[int], cache_salt: str, model_name: str, world_size: int
    ) -> int:
        """Start loading the prefix's chunks from L2 into L1; the chunks the server will load."""
        body = {"model_name": model_name, "world_size": world_size, "token_ids": token_ids,
                "cache_salt": cache_salt, "source_tier": "l2", "target_tier": "l1"}  # fmt: skip
        reply = self._request("POST", "/cache/prefetches", body)
        with _reply("POST /cache/prefetches"):
            return int(reply.get("chunks", 0))

    def adapter(self, tier: Tier) -> str:
        """The type name of the server's L2 adapter that holds `tier` (raises `LMCacheError`)."""
        adapters = self._adapter_types()
        for name in adapters:
            if _ADAPTER_TIERS.get(name) is tier:
                return name
        raise LMCacheError(f"no L2 adapter holds the {tier.value} tier (adapters: {adapters})")

    def _adapter_types(self) -> list[str]:
        if self._adapters is None:
            reply = self._request("GET", "/config/adapters")
            with _reply("GET /config/adapters"):
                self._adapters = [str(a["type_name"]) for a in reply["adapters"]]
        return self._adapters

    def _object_store_bytes(self) -> int | None:
        """The object_store tier's bytes as of its last reading (taken again when due); None:
        no such adapter, or its store could not be read (logged when the reason changes)."""
        now = time.monotonic()
        if now - self._store_read_at < _STORE_EVERY_S:
            return self._store_bytes
        self._store_read_at = now
        error = ""
        try:
            kinds = self._adapter_types()
            if "s3" in kinds:
                entries = self._listing("s3")
                with _reply("GET /cache/objects"):
                    self._store_bytes = sum(int(e["size_bytes"]) for e in entries)
            elif "resp" in kinds:
                self._store_bytes = self._redis_bytes()
        except LMCacheError as exc:
            self._store_bytes, error = None, str(exc)
        if error and error != self._store_error:
            _log.warning("Warply: LMCache's object store unreadable: %s", error)
        self._store_error = error
        return self._store_bytes

    def _listing(self, adapter: str, model_name: str | None = None) -> list[dict[str, Any]]:
        """Every object the adapter lists (`GET /cache/objects`; raises `LMCacheError` where it
        cannot list, or past `_MAX_OBJECTS`)."""
        entries: list[dict[str, Any]] = []
        query: dict[str, str] = {"tier": "l2", "adapter": adapter, "page_size": str(_PAGE)}
        if model_name is not None:
            query["model_name"] = model_name
        while True:
            page = self._request("GET", "/cache/objects?" + urllib.parse.urlencode(query))
            with _reply("GET /cache/objects"):
                entries += list(page["entries"])
                token = page.get("next_page_token")
            if len(entries) > _MAX_OBJECTS:
                raise LMCacheError(f"the {adapter} adapter holds over {_MAX_OBJECTS} objects")
            if not token:
                return entries
            query["page_token"] = str(token)

    def _redis_bytes(self) -> int:
        """Bytes of the values LMCache's `resp` adapter wrote to its redis server: its keys are
        `MODEL@RANK@GROUP@HASH[@SALT]` (LMCache 0.5.6), its values the raw chunks."""
        import redis  # in the LMCache venv only, like lmcache itself

        try:
            self._connect_redis()
            total = seen = 0
            batch: list[bytes] = []
            for key in self._redis.scan_iter(match="*@*@*@*", count=1000):
                batch.append(key)
                if len(batch) == 1000:
                    total += self._strlen(batch)
                    seen, batch = seen + len(batch), []
                    if seen > _MAX_OBJECTS:
                        raise LMCacheError(f"redis holds over {_MAX_OBJECTS} LMCache objects")
            return total + (self._strlen(batch) if batch else 0)
        except redis.RedisError as exc:
            raise LMCacheError(f"redis: {exc}") from None

    def _connect_redis(self) -> None:
        """A client of the `resp` adapter's server, at the address in `GET /config` (once)."""
        import redis

        if self._redis is not None:
            return
        adapters = self._adapter_types()
        config = self._request("GET", "/config")
        with _reply("GET /config (the resp adapter's address)"):
            configs = config["storage_manager"]["l2_adapter_config"]["adapters"]
            conf = configs[adapters.index("resp")]
            self._redis = redis.Redis(
                host=conf["host"], port=int(conf["port"]), username=conf["username"] or None,
                password=conf["password"] or None, socket_timeout=_TIMEOUT_S,
            )  # fmt: skip

    def _in_redis(self, keys: list[_KeyId]) -> int:
        """How many of `keys` the `resp` adapter's redis server holds (one EXISTS)."""
        import redis

        try:
            self._connect_redis()
            names = [_redis_name(k) for k in keys]
            return int(self._redis.exists(*names)) if names else 0
        except redis.RedisError as exc:
            raise LMCacheError(f"redis: {exc}") from None

    def _strlen(self, keys: list[bytes]) -> int:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        return sum(int(n) for n in pipe.execute())

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

    def _read(self) -> None:
        self.status()

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


_KeyId = tuple[str, int, int, str, str]
"""An LMCache object key: chunk hash (hex), kv rank, object group, cache salt, model name."""


def _key_id(key: dict[str, Any]) -> _KeyId:
    """An LMCache object key (its JSON shape) as a comparable value."""
    return (str(key["chunk_hash_hex"]), int(key["kv_rank"]), int(key["object_group_id"]),
            str(key["cache_salt"]), str(key["model_name"]))  # fmt: skip


def _redis_name(key: _KeyId) -> str:
    """The `resp` adapter's redis key of an object (LMCache 0.5.6: `MODEL@RANK@GROUP@HASH`, 8
    hex digits of rank, `@SALT` when salted)."""
    chunk, rank, group, salt, model = key
    name = f"{model}@{rank:08x}@{group:x}@{chunk}"
    return f"{name}@{salt}" if salt else name


def _file_key(name: str) -> _KeyId | None:
    """The object an `fs` adapter file holds (LMCache 0.5.6:
    `SAFE_MODEL@0xRANK@GROUP@HASH[@SALT].data`, `/` in the model name replaced); the model name
    is left empty, so files match keys by everything else (one server's folder)."""
    parts = name.removesuffix(".data").split("@")
    if len(parts) not in (4, 5):
        return None
    try:
        rank, group = int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None
    return (parts[3], rank, group, parts[4] if len(parts) == 5 else "", "")


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
