"""SGLang venv: the L3 backend round-trips pages through files and S3 (moto on 127.0.0.1).

Built through SGLang's own `StorageBackendFactory.create_backend("dynamic", ...)`. Stores are
reported on the worker's Warply stream as tier ssd / object_store, keyed from the device tier's
events, so the router's `PrefixIndex` sees the L3 tier.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str
from test_hook_export import (
    DOC,
    MODEL,
    build_cache,
    collectors,  # noqa: F401  (fixture)
    handshake,
    hooks,  # noqa: F401  (fixture)
    insert,
    pump,
    scheduler_publisher,
)

from router.index import MemoryStore, PrefixIndex, completed
from sglang_hook import storage
from warply.protocol import BlockRemoved, BlockStored, Tier, prefix_keys

PAGE = 16


def _moto_command(port: int) -> list[str] | None:
    """moto's server from this venv, or the system's (the SGLang lock does not pin moto)."""
    for python in (sys.executable, shutil.which("python3")):
        if (
            python
            and subprocess.run([python, "-c", "import moto.server"], capture_output=True).returncode
            == 0
        ):
            return [python, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    return None


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("boto3")
    from warply.launch import free_port

    port = free_port()
    cmd = _moto_command(port)
    if cmd is None:
        pytest.skip("moto is not installed (pip install moto[server])")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(url, timeout=0.5)
                break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


def _backend(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=MODEL,
        extra_config={
            "backend_name": "warply",
            "module_path": "sglang_hook.storage",
            "class_name": "WarplyL3Storage",
            **extra,
        },
    )
    return StorageBackendFactory.create_backend("dynamic", config, None)


def _page_keys(tokens: list[int]) -> list[str]:
    """HiCache's L3 keys for unsalted pages: SGLang's own sha256 page chain."""
    keys: list[str] = []
    prior = None
    for i in range(0, len(tokens) // PAGE * PAGE, PAGE):
        prior = get_hash_str(tokens[i : i + PAGE], prior)
        keys.append(prior)
    return keys


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    if request.param == "file":
        return {"store": "file", "path": str(tmp_path / "l3")}
    endpoint = request.getfixturevalue("s3_endpoint")
    import boto3

    bucket = f"warply-{os.getpid()}-{time.monotonic_ns()}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )
    client.create_bucket(Bucket=bucket)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    return {
        "store": "s3",
        "bucket": bucket,
        "prefix": "pages/",
        "endpoint_url": endpoint,
        "region_name": "us-east-1",
    }


def _held_on_store(extra: dict[str, Any]) -> int:
    if extra["store"] == "file":
        return sum(
            p.stat().st_size for p in Path(extra["path"]).iterdir() if not p.name.startswith(".")
        )
    import boto3

    client = boto3.client("s3", endpoint_url=extra["endpoint_url"], region_name="us-east-1")
    listing = client.list_objects_v2(Bucket=extra["bucket"], Prefix=extra["prefix"])
    return sum(int(o["Size"]) for o in listing.get("Contents", []))


def test_pages_round_trip_and_bytes_match(store: dict[str, Any]) -> None:
    backend = _backend(store)
    keys = _page_keys(DOC)
    pages = [torch.randn(2, 2, PAGE, 16, dtype=torch.float16) for _ in keys]
    assert backend.batch_set(keys, pages)
    for key, page in zip(keys, pages, strict=True):
        assert backend.exists(key)
        out = torch.empty_like(page)
        assert torch.equal(backend.get(key, out), page)
    assert backend.get("missing") is None and not backend.exists("missing")
    per_page = pages[0].numel() * pages[0].element_size()
    assert backend.bytes_held == len(keys) * per_page == _held_on_store(store)
    assert _backend(store).bytes_held == backend.bytes_held  # a restart sees what is there
    backend.delete(keys[:3])
    assert backend.bytes_held == (len(keys) - 3) * per_page == _held_on_store(store)
    backend.clear()
    assert backend.bytes_held == 0 == _held_on_store(store)


def test_a_file_store_needs_its_folder_and_keeps_pages_to_its_owner(tmp_path: Path) -> None:
    """No default folder (one in /tmp would take pages another local user put there); the
    folder it makes and the pages it writes are its owner's alone (a page is a tenant's KV)."""
    for extra, missing in (({"store": "file"}, "'path'"), ({"store": "file", "path": ""},
                           "'path'"), ({"store": "s3"}, "'bucket'")):  # fmt: skip
        with pytest.raises(ValueError, match=f"needs {missing}"):
            _backend(extra)
    root = tmp_path / "l3"
    backend = _backend({"store": "file", "path": str(root)})
    assert backend.batch_set(_page_keys(DOC)[:2], [torch.zeros(PAGE, 8) for _ in range(2)])
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert [stat.S_IMODE(p.stat().st_mode) for p in root.iterdir()] == [0o600, 0o600]


@contextmanager
def _w0(subs: Any) -> Iterator[tuple[Any, Any, Any, Any, PrefixIndex]]:
    """Worker w0: a radix cache (and its allocator), its scheduler publisher with a live stream
    to w0's SUB socket in `subs` (the `collectors` fixture), and the router's index of it; the
    publisher shut down after."""
    cache, alloc = build_cache(PAGE, "rust", 2048)
    sub, router = subs["w0"]
    kv = scheduler_publisher(cache, router, "w0")
    handshake(kv, sub)
    try:
        yield cache, alloc, kv, sub, PrefixIndex(MODEL, MemoryStore())
    finally:
        kv.kv_event_publisher.shutdown()


def test_l3_stores_reach_the_index_as_their_tier(store: dict[str, Any], collectors: Any) -> None:  # noqa: F811
    with _w0(collectors) as (cache, alloc, kv, sub, index):
        insert(cache, alloc, DOC)
        pump(kv, sub, index, "w0")  # device stores feed the page book
        backend = _backend(store)
        keys = _page_keys(DOC)
        backend.batch_set(keys, [torch.zeros(PAGE, 8) for _ in keys])
        tier = Tier.SSD if store["store"] == "file" else Tier.OBJECT_STORE
        events = pump(kv, sub, index, "w0")
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert stored and all(e.tier is tier for e in stored)
        assert sum(len(e.block_hashes) for e in stored) == len(keys)
        # The device copy goes; the L3 copy keeps the prefix routable, on its tier.
        cache.evict(EvictParams(num_tokens=10_000))
        pump(kv, sub, index, "w0")
        match = completed(index.match(prefix_keys(DOC, PAGE, MODEL)))["w0"]
        assert match.blocks == len(keys) and match.by_tier == {tier: len(keys)}
        backend.delete(keys)
        removed = pump(kv, sub, index, "w0")
        assert any(isinstance(e, BlockRemoved) and e.tier is tier for e in removed)
        assert completed(index.match(prefix_keys(DOC, PAGE, MODEL)))["w0"].blocks == 0


def test_salted_l3_pages_reach_the_index_in_their_namespace(
    tmp_path: Path,
    collectors: Any,  # noqa: F811
) -> None:
    """A tenant's pages: HiCache keys them in L3 by a storage chain seeded with the salt's
    namespace seed, its events by another; the page book maps one to the other, so they are
    reported in the tenant's namespace and never match another tenant's (or no tenant's)
    prompt."""
    with _w0(collectors) as (cache, alloc, kv, sub, index):
        insert(cache, alloc, DOC, salt="tenant-a")
        device = [e for e in pump(kv, sub, index, "w0") if isinstance(e, BlockStored)]
        n = len(DOC) // PAGE * PAGE
        # The keys HiCache 0.5.23 gives these pages in L3 (its own storage-key function).
        keys = get_storage_hash_str(
            RadixKey(array("q", DOC[:n]), cache_salt="tenant-a"), None, page_size=PAGE
        )
        assert isinstance(keys, list) and len(keys) == n // PAGE
        event_ids = {h for e in device for h in e.block_hashes}
        assert not event_ids & {storage._page_id(k) for k in keys}  # the chains differ
        backend = _backend({"store": "file", "path": str(tmp_path / "l3")})
        backend.batch_set(keys, [torch.zeros(PAGE, 8) for _ in keys])
        stored = [e for e in pump(kv, sub, index, "w0") if isinstance(e, BlockStored)]
        assert [e.tier for e in stored] == [Tier.SSD]
        assert stored[0].namespace == "tenant-a" and set(stored[0].block_hashes) == event_ids
        cache.evict(EvictParams(num_tokens=10_000))
        pump(kv, sub, index, "w0")
        mine = prefix_keys(DOC, PAGE, MODEL, "tenant-a")
        match = completed(index.match(mine))["w0"]
        assert match.blocks == len(keys) and match.by_tier == {Tier.SSD: len(keys)}
        for other in ("tenant-b", ""):
            assert completed(index.match(prefix_keys(DOC, PAGE, MODEL, other)))["w0"].blocks == 0
        backend.delete(keys)
        removed = pump(kv, sub, index, "w0")
        assert any(isinstance(e, BlockRemoved) and e.tier is Tier.SSD for e in removed)
        assert completed(index.match(mine))["w0"].blocks == 0
