"""The Mooncake store (mooncake-transfer-engine 0.3.13) behind a wrapped MooncakeStoreConnector:
the master's own byte count, and evictions and soft pins of a prefix's objects.

vLLM 0.32's MooncakeStoreConnector puts every whole device block it computes into the store
(its host-memory pool: Warply's cpu tier) under a key that ends in `@` + the block's vLLM hash in
hex (`{model}@tp_rank:R@pcp0@dcp0@pp_rank:0@group:G@{hash}`; cache_salt is part of the hash, so
tenants never share an object). The master's HTTP admin port (`-metrics_port`) serves
`GET /metrics` (`master_allocated_bytes`: the bytes the store holds) and `GET /get_all_keys`
(one key per line); a daemon thread polls the first, so the scheduler thread only reads the
last figure. Directives need a store client: one with no segment of its own (standalone-store
mode), set up on first use from the engine's store file (`MOONCAKE_CONFIG_PATH`).

Mooncake keeps an object that a client looked up or read within the lease TTL (the master's
`-default_kv_lease_ttl`, 10 s by default): `remove` answers OBJECT_HAS_LEASE and keeps it, as
vLLM's own lookups take leases; such objects are counted, never removed by force. A soft pin
(`SoftPinAction.ENABLE`, set by upserting the object with its own bytes) makes the master evict
the object only after unpinned ones; Mooncake has no tier below memory here (vLLM 0.32 reaches
its SSD offload only through an external `mooncake_client`), so there is nothing to prefetch or
offload.
"""

from __future__ import annotations

import dataclasses
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.mooncake_store import MooncakeStoreConfig, setup_mooncake_store
from vllm.utils.network_utils import get_ip

from vllm_connector.backend_poll import BackendError, PolledBackend
from warply.protocol import Tier

_TIMEOUT_S = 5.0
_ALLOCATED = "master_allocated_bytes"
_CLIENT_BUFFER_BYTES = 64 << 20
"""The directive client's local buffer: a soft pin reads each object (one block) through it."""
_OK, _NOT_FOUND, _HAS_LEASE = 0, -704, -706
"""Mooncake error codes (mooncake-store `types.h`): OBJECT_NOT_FOUND, OBJECT_HAS_LEASE."""


class MooncakeError(BackendError):
    """The master answered with an error, or could not be reached."""


@dataclass(frozen=True)
class Removal:
    """What a `remove` of a prefix's objects did, per object."""

    removed: list[str]
    """The keys removed."""
    leased: int
    """Kept: a client looked them up or read them within the lease TTL."""
    failed: int


class MooncakeStore(PolledBackend):
    """One Mooncake master: its HTTP admin port (`url`) and, for directives, a store client made
    by `connect()` (an object with the `mooncake.store.MooncakeDistributedStore` API)."""

    def __init__(self, url: str, poll_interval_s: float, connect: Callable[[], Any]) -> None:
        super().__init__("Mooncake master /metrics", poll_interval_s, _TIMEOUT_S)
        self.url = url.rstrip("/")
        self._connect = connect
        self._client: Any = None

    def close(self) -> None:
        super().close()
        if self._client is not None:
            self._client.close()
            self._client = None

    def allocated_bytes(self) -> int:
        """`master_allocated_bytes` from `GET /metrics` (raises `MooncakeError`)."""
        for line in self._get("/metrics").splitlines():
            name, _, value = line.partition(" ")
            if name == _ALLOCATED:
                try:
                    found = int(float(value))
                except ValueError:
                    break
                self._bytes = {Tier.CPU: found}
                return found
        raise MooncakeError(f"GET /metrics: no {_ALLOCATED} sample")

    @staticmethod
    def block_hash_hex(key: str) -> str:
        """The vLLM block hash (hex) a store key ends with."""
        return key[key.rfind("@") + 1 :]

    def keys_for(self, hashes: Sequence[bytes]) -> list[str]:
        """The store's keys of these vLLM block hashes (every rank, group and key prefix)."""
        wanted = {h.hex() for h in hashes}
        listed = self._get("/get_all_keys").splitlines()
        return [key for key in listed if self.block_hash_hex(key) in wanted]

    def remove(self, keys: Sequence[str]) -> Removal:
        """Remove these objects (never by force: leased ones are kept and counted)."""
        codes = self._store().batch_remove(list(keys)) if keys else []
        leased = sum(1 for c in codes if c == _HAS_LEASE)
        failed = sum(1 for c in codes if c not in (_OK, _HAS_LEASE, _NOT_FOUND))
        return Removal([k for k, c in zip(keys, codes, strict=True) if c == _OK], leased, failed)

    def soft_pin(self, keys: Sequence[str], pin: bool, ttl_s: float) -> int:
        """Soft-pin (or unpin) these objects by upserting each with its own bytes; returns how
        many were rewritten (an object gone since the listing is skipped)."""
        store = self._store()
        from mooncake.store import ReplicateConfig, SoftPinAction

        config = ReplicateConfig()
        config.soft_pin_action = SoftPinAction.ENABLE if pin else SoftPinAction.DISABLE
        if pin and ttl_s > 0:
            config.soft_pin_ttl_ms = int(ttl_s * 1000)
        done = 0
        for key in keys:
            value = store.get(key)
            if not value:
                continue
            if store.upsert(key, value, config) != _OK:
                raise MooncakeError(f"upsert {key}: refused")
            done += 1
        return done

    def _store(self) -> Any:
        if self._client is None:
            try:
                self._client = self._connect()
            except (ImportError, OSError, ValueError, TypeError, RuntimeError) as exc:
                raise MooncakeError(f"store client: {exc}") from None
        return self._client

    def _read(self) -> None:
        self.allocated_bytes()  # the store's bytes, as the cpu tier's

    def _get(self, path: str) -> str:
        try:
            with urllib.request.urlopen(self.url + path, timeout=_TIMEOUT_S) as resp:
                return str(resp.read().decode())
        except urllib.error.HTTPError as err:
            raise MooncakeError(f"GET {path}: HTTP {err.code} {err.read()[:200]!r}") from None
        except (OSError, ValueError) as exc:
            raise MooncakeError(f"GET {path}: {exc}") from None


def connect_store() -> Any:
    """A store client with no segment of its own, set up from the engine's store file
    (`MOONCAKE_CONFIG_PATH`, read by vLLM 0.32's own reader) on the engine's address; raises
    what the reader or the setup raises (`MooncakeStore` reports it as a `MooncakeError`)."""
    # Imported here (also above): only an engine with a Mooncake delegate has mooncake installed.
    from mooncake.store import MooncakeDistributedStore

    config = dataclasses.replace(
        MooncakeStoreConfig.load_from_config(),
        mode="standalone-store",
        global_segment_size=0,
        local_buffer_size=_CLIENT_BUFFER_BYTES,
    )
    store = MooncakeDistributedStore()
    setup_mooncake_store(store, config, get_ip())
    return store
