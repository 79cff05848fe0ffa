"""HiCache L3 backend that keeps pages in local files or S3 and reports them to the router.

Use with SGLang 0.5.23:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "warply", "module_path": "sglang_hook.storage",
      "class_name": "WarplyL3Storage", "store": "file", "path": "/var/cache/warply-l3"}'

(`"store": "s3", "bucket": ..., "prefix": ..., "endpoint_url": ...` for object storage). SGLang
constructs it as `cls(storage_config, extra_config)`. Each stored or deleted page is reported
on this worker's Warply stream as `BlockStored` / `BlockRemoved` on tier `ssd` (files) or
`object_store` (S3) when the page's tokens are known from the device tier's events
(`sglang_hook.events.PageBook`, which also maps a salted page's storage key to its event page,
so a tenant's pages are reported in its namespace); `bytes_held` counts the payload bytes the
store holds.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.utils import hash_str_to_int64

from sglang_hook import publisher
from warply.common.files import PRIVATE_DIR, write_private
from warply.protocol import BlockRemoved, Event, Tier, engine_block_id


class _Store(Protocol):
    tier: Tier

    def put(self, name: str, data: bytes) -> None: ...
    def get(self, name: str) -> bytes | None: ...
    def delete(self, name: str) -> None: ...
    def sizes(self) -> dict[str, int]: ...


class FileStore:
    """One file per page under `root` (tier ssd), its owner's alone: a page is a tenant's KV."""

    tier = Tier.SSD

    def __init__(self, root: str) -> None:
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)

    def put(self, name: str, data: bytes) -> None:
        tmp = self._root / f".{name}.tmp"
        write_private(tmp, data)
        tmp.replace(self._root / name)  # atomic: a reader never sees half a page

    def get(self, name: str) -> bytes | None:
        try:
            return (self._root / name).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, name: str) -> None:
        (self._root / name).unlink(missing_ok=True)

    def sizes(self) -> dict[str, int]:
        return {
            p.name: p.stat().st_size for p in self._root.iterdir() if not p.name.startswith(".")
        }


class S3Store:
    """One object per page under `prefix` in `bucket` (tier object_store), via boto3."""

    tier = Tier.OBJECT_STORE

    def __init__(self, bucket: str, prefix: str = "", **client_kwargs: Any) -> None:
        import boto3

        self._client = boto3.client("s3", **client_kwargs)
        self._bucket = bucket
        self._prefix = prefix

    def put(self, name: str, data: bytes) -> None:
        self._client.put_object(Bucket=self._bucket, Key=self._prefix + name, Body=data)

    def get(self, name: str) -> bytes | None:
        try:
            reply = self._client.get_object(Bucket=self._bucket, Key=self._prefix + name)
        except self._client.exceptions.NoSuchKey:
            return None
        body: bytes = reply["Body"].read()
        return body

    def delete(self, name: str) -> None:
        self._client.delete_object(Bucket=self._bucket, Key=self._prefix + name)

    def sizes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        pages = self._client.get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self._bucket, Prefix=self._prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(self._prefix) :]] = int(obj["Size"])
        return out


def _make_store(extra: dict[str, Any]) -> _Store:
    """The store the extra config names; a ValueError naming what it lacks (no default folder:
    one in /tmp would take pages another local user put there)."""
    kind = extra.get("store", "file")
    need = {"file": "path", "s3": "bucket"}.get(kind)
    if need is None:
        raise ValueError(f"warply L3 store {kind!r}: expected 'file' or 's3'")
    if not isinstance(extra.get(need), str) or not extra[need]:
        raise ValueError(f"warply L3 store {kind!r} needs {need!r} (a non-empty string)")
    if kind == "file":
        return FileStore(extra["path"])
    client = {k: extra[k] for k in ("endpoint_url", "region_name") if k in extra}
    return S3Store(extra["bucket"], extra.get("prefix", ""), **client)


def _page_id(key: str) -> int:
    """The id of an L3 key's page hash (SGLang: sha256 hex, then suffixes): the page's event id
    when unsalted; `PageBook.page_id` maps a salted one."""
    return engine_block_id(hash_str_to_int64(key))


class WarplyL3Storage(HiCacheStorage):  # type: ignore[misc]
    """Pages as raw tensor bytes, keyed by HiCache's page-hash strings."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        extra = dict(kwargs or {})
        extra.update((storage_config.extra_config or {}) if storage_config else {})
        self._store = _make_store(extra)
        self._sizes = self._store.sizes()  # pages already there survive a restart
        self._lock = threading.Lock()

    @property
    def tier(self) -> Tier:
        """The Warply tier this store's pages are reported on."""
        tier: Tier = self._store.tier
        return tier

    @property
    def bytes_held(self) -> int:
        """Payload bytes of every page the store holds."""
        with self._lock:
            return sum(self._sizes.values())

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        data = self._store.get(key)
        if data is None:
            return None
        page = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if target_location is None:
            return page
        target_location.view(-1).view(torch.uint8).copy_(page)
        return target_location  # type: ignore[no-any-return]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        new: list[int] = []
        for key, value in zip(keys, values, strict=True):
            data = value.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
            self._store.put(key, data)
            with self._lock:
                if key not in self._sizes:
                    new.append(_page_id(key))
                self._sizes[key] = len(data)
        self._report_stored(new)
        return True

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._sizes

    def delete(self, keys: list[str]) -> None:
        """Drop pages (capacity management); reported as removed from this tier."""
        gone: list[int] = []
        for key in keys:
            self._store.delete(key)
            with self._lock:
                if self._sizes.pop(key, None) is not None:
                    gone.append(_page_id(key))
        pub = publisher.active()
        if pub is not None and gone:
            pub.report([BlockRemoved([pub.page_book.page_id(g) for g in gone], self.tier)])

    def clear(self) -> None:
        with self._lock:
            keys = list(self._sizes)
        self.delete(keys)

    def get_stats(self) -> dict[str, int]:
        return {"bytes_held": self.bytes_held, "pages": len(self._sizes)}

    def _report_stored(self, page_ids: list[int]) -> None:
        pub = publisher.active()
        if pub is None or not page_ids:
            return
        page_ids = [pub.page_book.page_id(p) for p in page_ids]
        events: list[Event] = []
        start = 0
        while start < len(page_ids):
            stored = pub.page_book.stored(page_ids[start:], self.tier)
            if stored is None:
                start += 1  # tokens unknown (never on this worker's device tier): not reportable
                continue
            events.append(stored)
            start += len(stored.block_hashes)
        pub.report(events)
