"""`export_yaml`: the manifests for aggregated, P/D and tiered specs, for plain Kubernetes and
for NVIDIA Dynamo, validated against the published schemas vendored in tests/data/schemas
(see its README), and wired so the router reaches every engine by its Service."""

from __future__ import annotations

import json
import stat
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

import warply as wp
from router.config import RouterConfig
from warply.cli import main
from warply.export import ExportError, manifests
from warply.protocol.api import AUTH_TOKEN_ENV
from warply.protocol.plugin import CONTROL_TOKEN_ENV

SCHEMAS = Path(__file__).parent / "data" / "schemas"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("model") / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return str(folder)


def _closed(schema: Any) -> Any:
    """Reject unknown fields as `kubectl apply --validate=strict` does (the API server would
    silently prune them from a structural schema)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):  # fmt: skip
        out["additionalProperties"] = False
    return out


@cache
def _validator(kind: str) -> jsonschema.Validator:
    if kind == "DynamoGraphDeployment":
        schema = json.loads((SCHEMAS / "dynamographdeployment-v1beta1.json").read_text())
        return jsonschema.Draft7Validator(_closed(schema))
    k8s = json.loads((SCHEMAS / "kubernetes-v1.34-strict.json").read_text())
    return jsonschema.Draft202012Validator({"$ref": f"#/$defs/{kind}", "$defs": k8s["$defs"]})


def _errors(doc: dict[str, Any]) -> list[str]:
    return [f"{doc['kind']} {doc['metadata']['name']}: {'/'.join(map(str, e.absolute_path))}: "
            f"{e.message}" for e in _validator(doc["kind"]).iter_errors(doc)]  # fmt: skip


def _specs(model: str) -> dict[str, Any]:
    return {
        "aggregated": wp.Engine(model=model, pool=wp.Pool("1xH100", replicas=2)),
        "pd": wp.DisaggEngine(
            model=model, kv_transfer="nixl",
            prefill=wp.Pool("2xH100", replicas=2), decode=wp.Pool("1xH100", replicas=3),
            routing=wp.CacheRouting(strategy="prefix_affinity", min_hit_ratio=0.6)),
        "tiered": wp.DisaggEngine(
            model=model, prefill=wp.Pool("1xH200"), decode=wp.Pool("1xH200"),
            routing=wp.CacheRouting(tier_policy="rag_warm", tiering=wp.KVTier(
                l1="gpu", l2="cpu", l3="ssd", ssd_path="/kv", l4="object_store",
                object_store_url="s3://kv-bucket"))),
        "sglang": wp.DisaggEngine(
            model="Qwen/Qwen3-0.6B", backend="sglang", prefill=wp.Pool("1xH100"),
            decode=wp.Pool("1xH100"),
            routing=wp.CacheRouting(tiering=wp.KVTier(l1="gpu", l2="cpu", l3="ssd",
                                                      ssd_path="/kv"))),
        "cpu": wp.Engine(model=model, pool=wp.Pool("cpu")),
    }  # fmt: skip


SHAPES = ["aggregated", "pd", "tiered", "sglang", "cpu"]


@pytest.mark.parametrize("target", ["kubernetes", "dynamo"])
@pytest.mark.parametrize("shape", SHAPES)
def test_manifests_validate_against_the_published_schemas(
    model_dir: str, shape: str, target: str
) -> None:
    spec = _specs(model_dir)[shape]
    docs = manifests(spec, target, name="demo", namespace="serving")  # type: ignore[arg-type]
    assert [e for doc in docs for e in _errors(doc)] == []
    kinds = [d["kind"] for d in docs]
    engines = sum(p.replicas for p in spec.pools.values())
    assert kinds.count("Service") == engines + 1  # one per engine replica, one for the router
    if target == "kubernetes":
        assert kinds.count("Deployment") == engines + 1
    else:
        (graph,) = (d for d in docs if d["kind"] == "DynamoGraphDeployment")
        assert graph["spec"]["backendFramework"] == spec.backend
        types = sorted(c["type"] for c in graph["spec"]["components"])
        assert types.count("frontend") == 1 and len(types) == engines + 1


@pytest.mark.parametrize("shape", SHAPES)
def test_the_router_reaches_every_engine_by_its_service(model_dir: str, shape: str) -> None:
    spec = _specs(model_dir)[shape]
    docs = manifests(spec, name="demo", token="s3cret")
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    config = yaml.safe_load(by["ConfigMap", "demo-config"]["data"]["router.yaml"])
    assert "auth_token" not in config  # the token lives in the Secret
    secret = by["Secret", "demo-token"]["stringData"]
    assert secret["token"] == "s3cret" and len(secret["control-token"]) >= 16
    RouterConfig.model_validate(config)  # the router's own model accepts it
    router_ports = {p["port"] for p in by["Service", "demo-router"]["spec"]["ports"]}
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] == "Deployment"}  # fmt: skip
    router_env = {e["name"] for e in pods["demo-router"]["containers"][0]["env"]}
    assert {AUTH_TOKEN_ENV, CONTROL_TOKEN_ENV} <= router_env
    for pool in config["pools"]:
        for worker in pool["workers"]:
            service = by["Service", f"demo-{worker['name']}"]
            ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
            assert worker["url"] == f"http://demo-{worker['name']}:{ports['http']}"
            assert worker["replay"] == f"tcp://demo-{worker['name']}:{ports['replay']}"
            assert worker["control"] == f"tcp://demo-{worker['name']}:{ports['control']}"
            events_port = int(worker["events"].rsplit(":", 1)[1])
            assert worker["events"].startswith("tcp://*:") and events_port in router_ports
            main = pods[f"demo-{worker['name']}"]["containers"][0]
            args = main["args"]
            assert args[args.index("--host") + 1] == "0.0.0.0"
            warply_section = (json.loads(args[args.index("--kv-transfer-config") + 1])
                              ["kv_connector_extra_config"]["warply"]) if spec.backend == "vllm" \
                else {"events_endpoint": args[args.index("--warply-router") + 1]}  # fmt: skip
            # the engine connects to the router's port; LMCache stays on the pod's loopback
            assert warply_section["events_endpoint"] == f"tcp://demo-router:{events_port}"
            # directives to the engine are signed with the token the router has
            assert CONTROL_TOKEN_ENV in {e["name"] for e in main["env"]}
            gpus = spec.pools[pool["name"]].gpus_per_replica
            assert main.get("resources", {}).get("limits") == (
                {"nvidia.com/gpu": str(gpus)} if gpus else None)  # fmt: skip
            if pool.get("kv_handoff") == "vllm":
                env = {e["name"]: e.get("value") for e in main["env"]}
                assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
                assert [e["name"] for e in main["env"]][0] == "POD_IP"  # defined first
    events = [int(w["events"].rsplit(":", 1)[1]) for p in config["pools"] for w in p["workers"]]
    assert len(set(events)) == len(events)  # the router binds one port per engine


def test_tiers_become_sidecars_and_volumes(model_dir: str) -> None:
    docs = manifests(_specs(model_dir)["tiered"], name="demo")
    pod = next(d for d in docs if d["metadata"]["name"] == "demo-prefill-0"
               and d["kind"] == "Deployment")["spec"]["template"]["spec"]  # fmt: skip
    names = [c["name"] for c in pod["containers"]]
    assert names == ["main", "lmcache-prefill-0"]  # LMCache beside its engine, on the pod's lo
    assert {"name": "kv-ssd", "mountPath": "/kv"} in pod["containers"][1]["volumeMounts"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in (
        pod["containers"][0]["volumeMounts"])  # fmt: skip
    assert pod["containers"][0]["args"][1] == "/models/tiny-llama"
    assert {"claimName": "demo-models", "readOnly": True} in [
        v.get("persistentVolumeClaim") for v in pod["volumes"]]  # fmt: skip


def test_a_hub_model_is_fetched_for_the_router(model_dir: str) -> None:
    docs = manifests(_specs(model_dir)["sglang"], name="demo")
    router = next(d for d in docs if d["metadata"]["name"] == "demo-router"
                  and d["kind"] == "Deployment")["spec"]["template"]["spec"]  # fmt: skip
    (init,) = router["initContainers"]
    assert "snapshot_download('Qwen/Qwen3-0.6B'" in init["command"][-1]
    (config_map,) = (d for d in docs if d["kind"] == "ConfigMap")
    config = yaml.safe_load(config_map["data"]["router.yaml"])
    assert config["tokenizer"] == "/warply/tokenizer"
    prefill = next(w for p in config["pools"] if p["name"] == "prefill" for w in p["workers"])
    assert prefill["bootstrap_host"] == "demo-prefill-0"


def test_what_cannot_be_laid_out_says_why(model_dir: str) -> None:
    local_store = wp.Engine(model=model_dir, pool=wp.Pool("1xH100"), routing=wp.CacheRouting(
        tiering=wp.KVTier(l1="gpu", l2="cpu", l3="ssd", ssd_path="/kv", l4="object_store",
                          object_store_url="redis://127.0.0.1:6379")))  # fmt: skip
    with pytest.raises(ExportError, match="on loopback: give a URL the cluster's pods can reach"):
        manifests(local_store)
    with pytest.raises(ExportError, match="lowercase letters, digits and '-'"):
        manifests(_specs(model_dir)["cpu"], name="My_Release")
    with pytest.raises(ExportError, match="namespace 'team a': lowercase letters, digits and '-'"):
        manifests(_specs(model_dir)["cpu"], namespace="team a")
    with pytest.raises(ExportError, match="model_pvc 'Models': lowercase letters, digits, '-' and"):
        manifests(_specs(model_dir)["cpu"], model_pvc="Models")
    assert manifests(_specs(model_dir)["cpu"], namespace="team-a", model_pvc="models.v2")
    with pytest.raises(ExportError, match="expected 'kubernetes' or 'dynamo'"):
        manifests(_specs(model_dir)["cpu"], "helm")  # type: ignore[arg-type]


def test_the_schemas_reject_what_they_should(model_dir: str) -> None:
    """The validators are not vacuous: a wrong field, type or enum fails each kind."""
    docs = manifests(_specs(model_dir)["pd"], "dynamo", name="demo")
    graph = next(d for d in docs if d["kind"] == "DynamoGraphDeployment")
    graph["spec"]["components"][0]["type"] = "router"
    service = next(d for d in docs if d["kind"] == "Service")
    service["spec"]["ports"][0]["port"] = "http"
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    config["data"]["extra"] = 1
    secret = next(d for d in docs if d["kind"] == "Secret")
    secret["stringdata"] = {}
    for doc in (graph, service, config, secret):
        assert _errors(doc), doc["kind"]


def test_cli_export(model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(_specs(model_dir)["pd"].model_dump_yaml())
    out = tmp_path / "k8s.yaml"
    assert main(["export", str(spec), "--target", "dynamo", "--name", "demo", "-o", str(out)]) == 0
    docs = list(yaml.safe_load_all(out.read_text()))
    assert [e for doc in docs for e in _errors(doc)] == []
    assert stat.S_IMODE(out.stat().st_mode) == 0o600  # its Secret holds the router's tokens
    assert main(["export", str(spec), "--name", "Bad_Name"]) == 2
    assert "lowercase letters" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["export", str(spec), "-o", str(tmp_path / "missing" / "k8s.yaml")])
    assert "argument -o/--output" in capsys.readouterr().err
    spec.write_text("kind: Engine\nmodel: /nonexistent/model\n")
    assert main(["export", str(spec)]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_the_spec_method_is_the_same_export(model_dir: str) -> None:
    spec = _specs(model_dir)["aggregated"]
    tokens = {"token": "t", "control_token": "c" * 16}
    text = spec.export_yaml("kubernetes", name="demo", **tokens)
    assert text == wp.export_yaml(spec, "kubernetes", name="demo", **tokens)
    assert len(list(yaml.safe_load_all(text))) == 2 + 2 * 3
