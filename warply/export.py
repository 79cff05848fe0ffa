"""Kubernetes manifests for a deployment spec (`export_yaml`): an NVIDIA Dynamo
`DynamoGraphDeployment` for teams on Dynamo, or plain Deployments and Services otherwise; both
with the router's ConfigMap and token Secret.

The processes are the ones `up()` starts (`warply.plan`), laid out on a cluster: every listener
on all interfaces, fixed ports, and one Service per engine replica, so the router reaches each
replica (and its state-stream sockets) by a stable name. The engine image must hold the engine
and Warply (`pip install warply`), which registers the engine plugins.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path, PurePosixPath
from typing import Any, Literal, TypedDict, Unpack

import yaml  # type: ignore[import-untyped]

from warply import __version__
from warply.plan import Binaries, Layout, Plan, ProcessPlan, make_plan
from warply.protocol.api import AUTH_TOKEN_ENV
from warply.protocol.plugin import CONTROL_TOKEN_ENV
from warply.spec.deployment import Deployment

Target = Literal["kubernetes", "dynamo"]

_PORTS = {
    "http": 8000, "replay": 5558, "control": 5559, "nixl": 5600, "lmcache": 6555,
    "lmcache_http": 6556, "bootstrap": 8998,
}  # fmt: skip
"""Container ports by purpose (each engine has its own pod, so they repeat across engines)."""
_ROUTER_PORT = 8080
_EVENTS_BASE = 7000
"""The router binds one state-stream port per engine: 7000, 7001, ..."""
_CONFIG_DIR = PurePosixPath("/etc/warply")
_TOKENIZER_DIR = "/warply/tokenizer"
_MODELS_DIR = PurePosixPath("/models")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
"""A Kubernetes DNS-1123 label; a subdomain is such labels joined by dots."""
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class ExportError(ValueError):
    """The spec cannot be laid out on a cluster as it is; the message says what to change."""


class _Cluster(Layout):
    """A cluster's layout: pods listen on every interface at fixed ports; a process is reached
    at its Service, `RELEASE-PROCESS`; the device plugin picks GPUs."""

    bind_host = "0.0.0.0"
    advertise = "$(POD_IP)"
    """Kubernetes expands `$(POD_IP)` from the env var the pod template defines first."""
    pick_gpus = False

    def __init__(self, release: str, tokenizer: str) -> None:
        self.release = release
        self._tokenizer = tokenizer
        self._events: dict[str, int] = {}

    def port(self, process: str, purpose: str) -> int:
        if purpose == "events":
            return self._events.setdefault(process, _EVENTS_BASE + len(self._events))
        return _ROUTER_PORT if process == "router" else _PORTS[purpose]

    def host(self, process: str) -> str:
        return f"{self.release}-{process}"

    def tokenizer(self, model: str) -> str:
        return self._tokenizer

    @property
    def events_ports(self) -> list[int]:
        return sorted(self._events.values())


class Options(TypedDict, total=False):
    """`export_yaml`'s and `manifests`' options.

    `name` prefixes every object (default "warply"); `image` is the engine + Warply image
    (default `warply:VERSION-BACKEND`); `namespace` is set on every object (default: none); a
    local model folder is read from the PersistentVolumeClaim `model_pvc` (default
    `NAME-models`) mounted at /models; `token` is the router's admin token and `control_token`
    signs its directives to the engines' control sockets (default: fresh random ones; both go
    in a Secret)."""

    name: str
    image: str | None
    namespace: str | None
    model_pvc: str | None
    token: str | None
    control_token: str | None


def export_yaml(spec: Deployment, target: Target = "kubernetes", **options: Unpack[Options]) -> str:
    """The manifests for `spec` as one multi-document YAML: `target` "kubernetes" (Deployments
    + Services) or "dynamo" (one DynamoGraphDeployment, plus the Services that name each engine
    replica); `options`: see `Options`."""
    docs = manifests(spec, target, **options)
    return str(yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False))


def _check_name(what: str, value: str, limit: int, why: str, dots: bool = False) -> None:
    """Refuse a value Kubernetes would refuse as an object's name (a DNS-1123 label, or with
    `dots` a subdomain), saying what it may hold."""
    pattern, chars = (_SUBDOMAIN, "digits, '-' and '.'") if dots else (_NAME, "digits and '-'")
    if not pattern.match(value) or len(value) > limit:
        raise ExportError(
            f"{what} {value!r}: lowercase letters, {chars}, at most {limit} characters ({why})"
        )


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]
    """Multi-line strings (the router's config in the ConfigMap) as literal blocks."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


def manifests(
    spec: Deployment, target: Target = "kubernetes", **options: Unpack[Options]
) -> list[dict[str, Any]]:
    """The objects `export_yaml` writes, as dicts (in apply order)."""
    name = options.get("name", "warply")
    image, namespace = options.get("image"), options.get("namespace")
    model_pvc = options.get("model_pvc")
    token, control_token = options.get("token"), options.get("control_token")
    if target not in ("kubernetes", "dynamo"):
        raise ExportError(f"target {target!r}: expected 'kubernetes' or 'dynamo'")
    _check_name("name", name, 40, "it prefixes every object's name")
    if namespace:
        _check_name("namespace", namespace, 63, "a Kubernetes namespace")
    if model_pvc:
        _check_name("model_pvc", model_pvc, 253, "a claim's name", dots=True)
    tier = spec.tier
    if tier is not None and tier.object_store_url is not None and re.search(
        r"//(127\.0\.0\.1|localhost)[:/]", tier.object_store_url
    ):
        raise ExportError(
            f"routing.tiering object store {tier.object_store_url!r} is on loopback: give a URL "
            "the cluster's pods can reach"
        )
    local_model = Path(spec.model).is_absolute()
    model = str(_MODELS_DIR / Path(spec.model).name) if local_model else spec.model
    layout = _Cluster(name, model if local_model else _TOKENIZER_DIR)
    # model_copy skips validation: the folder exists on the volume, not on this host.
    placed = spec.model_copy(update={"model": model})
    plan = make_plan(placed, Binaries("vllm", "python3", "python3"), Path(str(_CONFIG_DIR)),
                     gpus=None, cpu_cores=1, layout=layout)  # fmt: skip
    plan.router_config.pop("auth_token", None)
    pods = _Pods(
        spec, plan, layout, image or f"warply:{__version__}-{spec.backend}",
        model_pvc or f"{name}-models" if local_model else None,
    )
    meta = {"namespace": namespace} if namespace else {}
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Secret",
         "metadata": {"name": f"{name}-token", **meta, "labels": pods.labels("router")},
         "type": "Opaque", "stringData": {"token": token or secrets.token_hex(16),
                                          "control-token": control_token or secrets.token_hex(16)}},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": f"{name}-config", **meta, "labels": pods.labels("router")},
         "data": {"router.yaml": yaml.safe_dump(plan.router_config, sort_keys=False),
                  **plan.files}},
    ]  # fmt: skip
    processes = [plan.router, *plan.engines]
    docs += [pods.service(p, meta) for p in processes]
    if target == "kubernetes":
        docs += [pods.deployment(p, meta) for p in processes]
    else:
        docs.append(pods.graph(processes, meta))
    return docs


class _Pods:
    """Pod templates, Services and their wrappers for a plan's processes."""

    def __init__(
        self, spec: Deployment, plan: Plan, layout: _Cluster, image: str, model_pvc: str | None
    ) -> None:
        self.spec, self.plan, self.layout = spec, plan, layout
        self.image, self.model_pvc = image, model_pvc
        self.sidecars: dict[str, list[ProcessPlan]] = {}
        for service in plan.services:
            owner = service.name.removeprefix("lmcache-")
            if service.kind != "lmcache" or owner == service.name:
                raise ExportError(f"{service.kind} {service.name!r} has no place in a cluster")
            self.sidecars.setdefault(owner, []).append(service)

    def labels(self, process: str) -> dict[str, str]:
        return {"app.kubernetes.io/name": "warply",
                "app.kubernetes.io/instance": self.layout.release,
                "app.kubernetes.io/component": process}  # fmt: skip

    def _ports(self, p: ProcessPlan) -> list[tuple[str, int]]:
        if p.kind == "router":
            return [("http", _ROUTER_PORT),
                    *((f"events-{i}", port) for i, port in enumerate(self.layout.events_ports))]
        ports = [("http", _PORTS["http"]), ("replay", _PORTS["replay"]),
                 ("control", _PORTS["control"])]  # fmt: skip
        if "--disaggregation-bootstrap-port" in p.argv:
            ports.append(("bootstrap", _PORTS["bootstrap"]))
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" in p.env:
            ports.append(("nixl", _PORTS["nixl"]))
        return ports

    def service(self, p: ProcessPlan, meta: dict[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": self.layout.host(p.name), **meta, "labels": self.labels(p.name)},
            "spec": {"selector": self.labels(p.name),
                     "ports": [{"name": n, "port": port, "targetPort": port, "protocol": "TCP"}
                               for n, port in self._ports(p)]},
        }  # fmt: skip

    def pod_spec(self, p: ProcessPlan) -> dict[str, Any]:
        mounts = [{"name": "config", "mountPath": str(_CONFIG_DIR), "readOnly": True}]
        volumes: list[dict[str, Any]] = [
            {"name": "config", "configMap": {"name": f"{self.layout.release}-config"}}]
        if self.model_pvc is not None:
            mounts.append({"name": "models", "mountPath": str(_MODELS_DIR), "readOnly": True})
            volumes.append({"name": "models", "persistentVolumeClaim": {
                "claimName": self.model_pvc, "readOnly": True}})  # fmt: skip
        main = self._container("main", p, mounts)
        main["env"].append(self._secret(CONTROL_TOKEN_ENV, "control-token"))
        main["ports"] = [{"name": n, "containerPort": port} for n, port in self._ports(p)]
        main["readinessProbe"] = {"httpGet": {"path": p.health, "port": "http"},
                                  "periodSeconds": 5}  # fmt: skip
        pod: dict[str, Any] = {"containers": [main], "volumes": volumes}
        if p.kind == "router":
            main["env"].append(self._secret(AUTH_TOKEN_ENV, "token"))
            if self.model_pvc is None:
                pod["initContainers"] = [self._fetch_tokenizer(mounts)]
                volumes.append({"name": "tokenizer", "emptyDir": {}})
                mounts.append({"name": "tokenizer", "mountPath": _TOKENIZER_DIR})
        else:
            tier = self.spec.tier
            if tier is not None and tier.ssd_path is not None:
                # the SSD tier's folder: the node's local disk, for the pod's lifetime
                volumes.append({"name": "kv-ssd", "emptyDir": {}})
                mounts.append({"name": "kv-ssd", "mountPath": tier.ssd_path})
            gpus = self.spec.pools[p.name.rsplit("-", 1)[0]].gpus_per_replica
            if gpus:
                main["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
            pod["containers"] += [self._container(s.name, s, mounts)
                                  for s in self.sidecars.get(p.name, [])]  # fmt: skip
        return pod

    def _secret(self, env: str, key: str) -> dict[str, Any]:
        """An env var from the deployment's Secret."""
        return {"name": env, "valueFrom": {"secretKeyRef": {
            "name": f"{self.layout.release}-token", "key": key}}}  # fmt: skip

    def _container(self, name: str, p: ProcessPlan, mounts: list[Any]) -> dict[str, Any]:
        env: list[dict[str, Any]] = [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        # vLLM binds the given core; a pod's cores are its cgroup's, so let it choose.
        env += [{"name": k, "value": v} for k, v in p.env.items()
                if k != "VLLM_CPU_OMP_THREADS_BIND"]  # fmt: skip
        return {"name": name, "image": self.image, "command": p.argv[:1], "args": p.argv[1:],
                "env": env, "volumeMounts": mounts}  # fmt: skip

    def _fetch_tokenizer(self, mounts: list[Any]) -> dict[str, Any]:
        """The router never downloads: an init container puts the tokenizer on a volume."""
        fetch = (
            "from huggingface_hub import snapshot_download; "
            f"snapshot_download({self.spec.model!r}, local_dir={_TOKENIZER_DIR!r}, "
            "allow_patterns=['tokenizer*', '*.json', '*.jinja'])"
        )
        return {"name": "tokenizer", "image": self.image, "command": ["python3", "-c", fetch],
                "volumeMounts": [*mounts, {"name": "tokenizer", "mountPath": _TOKENIZER_DIR}]}

    def deployment(self, p: ProcessPlan, meta: dict[str, str]) -> dict[str, Any]:
        labels = self.labels(p.name)
        return {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": self.layout.host(p.name), **meta, "labels": labels},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     # one replica per engine: its Service names it; Recreate never runs two
                     "strategy": {"type": "Recreate"},
                     "template": {"metadata": {"labels": labels}, "spec": self.pod_spec(p)}},
        }  # fmt: skip

    def graph(self, processes: list[ProcessPlan], meta: dict[str, str]) -> dict[str, Any]:
        """One DynamoGraphDeployment (nvidia.com/v1beta1): the router as the frontend, each
        engine replica a component of its role, labelled for the Services above."""
        kinds = {"router": "frontend", "prefill": "prefill", "decode": "decode", "engine": "worker"}
        components = [
            {"name": p.name, "type": kinds[p.name.rsplit("-", 1)[0] if p.kind == "engine"
                                             else "router"],
             "replicas": 1,
             "podTemplate": {"metadata": {"labels": self.labels(p.name)},
                             "spec": self.pod_spec(p)}}
            for p in processes
        ]  # fmt: skip
        return {
            "apiVersion": "nvidia.com/v1beta1", "kind": "DynamoGraphDeployment",
            "metadata": {"name": self.layout.release, **meta,
                         "labels": {"app.kubernetes.io/name": "warply"}},
            "spec": {"backendFramework": self.spec.backend, "components": components},
        }  # fmt: skip

