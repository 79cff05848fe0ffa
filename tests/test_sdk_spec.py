"""The SDK's deployment specs: each bad spec is refused with its own actionable message; valid
ones read back from YAML unchanged; `import warply` stays light; the spec's strategy and
tier-policy names are the router's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import warply as wp
from warply.spec import deployment

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text("{}")
    return str(folder)


def _disagg(model: str, **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": model, "prefill": {"accelerator": "cpu"},
                            "decode": {"accelerator": "cpu"}}  # fmt: skip
    spec.update(over)
    return spec


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("Engine", {"pool": {"accelerator": "H100"}}, "write 'cpu' or COUNTxGPU, e.g. '1xH100'"),
    ("Engine", {"pool": {"accelerator": "H100x1"}}, "accelerator 'H100x1': write"),
    ("Engine", {"pool": {"accelerator": "2xT1000"}}, "unknown GPU 'T1000'; known: A10"),
    ("Engine", {"pool": {"accelerator": "3xH200"}}, "tensor parallelism takes 1, 2, 4 or 8"),
    ("Engine", {"pool": {"accelerator": "cpu", "replicas": 0}}, "greater than or equal to 1"),
    ("Engine", {"pool": {"replicas": 65}}, "less than or equal to 64"),
    ("Engine", {"pool": {"engine_args": ["--port", "1"]}},
     "pool.engine_args: '--port' is set by Warply"),
    ("Engine", {"pool": {"engine_args": ["--kv-transfer-config={}"]}},
     "'--kv-transfer-config' is set by Warply"),
    ("Engine", {"pool": {"gpus": 2}}, "Extra inputs are not permitted"),
    ("Engine", {"routing": {"strategy": "prefix-affinity"}},
     "unknown strategy 'prefix-affinity'; known: adaptive"),
    ("Engine", {"routing": {"strategy": "my.module:"}}, "a path is written module:Class"),
    ("Engine", {"routing": {"tier_policy": "lru"}}, "unknown tier policy 'lru'; known:"),
    ("Engine", {"routing": {"tier_policy_knobs": {"x": 1}}}, "but tier_policy is not"),
    ("Engine", {"routing": {"min_hit_ratio": 1.5}}, "less than or equal to 1"),
    ("Engine", {"routing": {"tiering": {"l1": "gpu", "l2": "ssd", "ssd_path": "/x"}}},
     "l2 must be 'cpu' (after l1='gpu'"),
    ("Engine", {"routing": {"tiering": {"l3": "ssd", "ssd_path": "/x"}}},
     "l2 is empty but l3 is set"),
    ("Engine", {"routing": {"tiering": {"l2": "cpu", "l3": "ssd"}}}, "l3='ssd' needs ssd_path"),
    ("Engine", {"routing": {"tiering": {"engine": "sglang"}}},
     "routing.tiering.engine is 'sglang' but backend is 'vllm'"),
    ("Engine", {"routing": {"tiering": {"device": "gpu"}}},
     "routing.tiering.device is 'gpu' but the pools run on 'cpu'"),
    ("Engine", {"backend": "sglang"}, "Warply runs SGLang on GPUs only"),
    ("Engine", {"backend": "sglang", "pool": {"accelerator": "1xH100"},
                "routing": {"tiering": {"l2": "cpu", "backend": "lmcache"}}},
     "with backend 'sglang': backend 'lmcache' on SGLang"),
    ("Engine", {"backend": "trtllm"}, "Input should be 'vllm' or 'sglang'"),
    ("DisaggEngine", {"kv_transfer": "mooncake"},
     "kv_transfer 'mooncake' with backend 'vllm': Warply hands vLLM 0.32 prompts off over "
     "NixlConnector only"),
    ("DisaggEngine", {"kv_transfer": "lmcache"}, "LMCache is a tier backend in Warply"),
    ("DisaggEngine", {"kv_transfer": "rdma"}, "expected 'nixl' or 'mooncake'"),
    ("DisaggEngine", {"decode": {"accelerator": "1xH100"}},
     "pools mix 'cpu' and GPU accelerators"),
    ("DisaggEngine", {"decode": None}, "decode"),
    ("DisaggEngine", {"prefill": {"engine_args": ["--served-model-name", "x"]}},
     "prefill.engine_args: '--served-model-name' is set by Warply"),
]


@pytest.mark.parametrize(("kind", "fields", "message"), BAD, ids=[m for _, _, m in BAD])
def test_bad_specs_say_what_to_change(
    model_dir: str, kind: str, fields: dict[str, Any], message: str
) -> None:
    cls = {"Engine": wp.Engine, "DisaggEngine": wp.DisaggEngine}[kind]
    data = _disagg(model_dir) if kind == "DisaggEngine" else {"model": model_dir}
    data.update(fields)
    with pytest.raises(ValidationError) as err:
        cls.model_validate(data)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("/no/such/model", "model '/no/such/model': no such folder"),
        ("./models/missing", "model './models/missing': no such folder"),
        ("not a hub id", "a hub id is written org/name"),
    ],
)
def test_a_missing_model_folder_is_not_taken_for_a_hub_id(model: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        wp.Engine(model=model)


def test_a_folder_without_config_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="has no config.json"):
        wp.Engine(model=str(tmp_path))


def test_the_design_example_validates(model_dir: str) -> None:
    engine = wp.DisaggEngine(
        model=model_dir, backend="vllm", kv_transfer="nixl",
        prefill=wp.Pool("cpu", replicas=1), decode=wp.Pool("cpu", replicas=1),
        routing=wp.CacheRouting(strategy="prefix_affinity", min_hit_ratio=0.6,
                                tiering=wp.KVTier(l1="gpu", l2="cpu")),
    )  # fmt: skip
    assert list(engine.pools) == ["prefill", "decode"]
    tier = engine.tier
    assert tier is not None and tier.device == "cpu" and tier.engine == "vllm"
    assert tier.l2_gb == 1.0
    hub = wp.DisaggEngine(model="meta-llama/Llama-3.1-8B", backend="sglang",
                          prefill=wp.Pool("1xH100", replicas=2),
                          decode=wp.Pool("2xh200", replicas=2))  # fmt: skip
    assert hub.decode.accelerator == "2xH200" and hub.decode.gpus_per_replica == 2
    assert hub.model == "meta-llama/Llama-3.1-8B"


def test_yaml_round_trip(model_dir: str, tmp_path: Path) -> None:
    engine = wp.Engine(
        model=model_dir,
        pool=wp.Pool("cpu", replicas=2, engine_args=["--max-model-len", "2048"]),
        routing=wp.CacheRouting(tier_policy="hot_prefix_pin",
                                tiering=wp.KVTier(l2="cpu", l2_size_gb=0.5)),
    )  # fmt: skip
    path = tmp_path / "spec.yaml"
    path.write_text(engine.model_dump_yaml())
    assert wp.load_spec(path) == wp.load_spec(str(path)) == engine  # a path as text too


def test_a_spec_that_is_not_text_says_so(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_bytes(b"\xff\xfe\x00")  # a UnicodeDecodeError traceback before
    with pytest.raises(wp.SpecError, match="is not UTF-8 text"):
        wp.load_spec(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kind: Cluster\nmodel: m\n", "kind must be Engine or DisaggEngine, not 'Cluster'"),
        ("- a\n", "the top level must be a mapping"),
        ("kind: Engine\nmodel: [\n", "is not valid YAML"),
        ("kind: Engine\nmodel: /no/such\npool: {replicas: 0}\n",
         "  model: model '/no/such': no such folder"),
    ],
)
def test_spec_files_name_the_bad_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(wp.SpecError) as err:
        wp.load_spec(path)
    assert message in str(err.value)
    if "replicas" in text:
        assert "pool.replicas: Input should be greater than or equal to 1" in str(err.value)


def test_spec_names_equal_the_routers_builtins() -> None:
    from router.strategies.builtin import BUILTIN as strategies
    from router.tiering.builtin import BUILTIN as policies

    assert sorted(deployment.STRATEGIES) == sorted(strategies)
    assert sorted(deployment.TIER_POLICIES) == sorted(policies)


def test_import_warply_stays_light() -> None:
    code = ("import sys, warply; heavy = {'pydantic', 'zmq', 'torch', 'vllm', 'openai', 'yaml'}; "
            "print(sorted(heavy & set(sys.modules)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)  # fmt: skip
    assert out.stdout.strip() == "[]"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        wp.Nope  # noqa: B018


def test_lazy_exports_are_the_public_names() -> None:
    import warply.spec

    public = {name: getattr(wp, name) for name in wp.__all__}
    specs = {name for name in wp.__all__ if name not in wp._HOMES and name != "__version__"}
    assert specs <= set(warply.spec.__all__)
    assert all(public[name] is getattr(warply.spec, name) for name in specs)
    assert dir(wp) == sorted(wp.__all__)
