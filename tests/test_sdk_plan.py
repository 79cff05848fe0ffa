"""What a spec becomes on one host (`warply.plan`): the engines' flags and connector configs,
the services, the router's config (validated by the router's own model), device mapping, and
the errors for what this host cannot run. Real runs: tests/lmcache/test_sdk_up.py and
tests/vllm/test_sdk_lifecycle.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import warply as wp
from router.config import RouterConfig
from warply.plan import Binaries, PlanError, ProcessPlan, make_plan

BINS = Binaries(vllm="/env/bin/vllm", sglang_python="/sg/bin/python", router_python="/py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text("{}")
    return str(folder)


def _flag(p: ProcessPlan, flag: str) -> str:
    return p.argv[p.argv.index(flag) + 1]


def _kv(p: ProcessPlan) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(_flag(p, "--kv-transfer-config"))
    return config


def test_the_design_example_on_cpu(model_dir: str, tmp_path: Path) -> None:
    spec = wp.DisaggEngine(
        model=model_dir, backend="vllm", kv_transfer="nixl",
        prefill=wp.Pool("cpu", engine_args=["--max-model-len", "2048"]), decode=wp.Pool("cpu"),
        routing=wp.CacheRouting(strategy="prefix_affinity", min_hit_ratio=0.6,
                                tiering=wp.KVTier(l1="gpu", l2="cpu")),
    )  # fmt: skip
    plan = make_plan(spec, BINS, tmp_path, cpu_cores=2)
    assert [p.name for p in plan.services] == ["lmcache-prefill-0", "lmcache-decode-0"]
    assert plan.services[0].argv[:2] == ["/env/bin/lmcache", "server"]
    assert _flag(plan.services[0], "--supported-transfer-mode") == "engine_driven"
    prefill, decode = plan.engines
    assert prefill.argv[:3] == ["/env/bin/vllm", "serve", model_dir]
    assert prefill.argv[-2:] == ["--max-model-len", "2048"]  # the escape hatch goes last
    assert _flag(prefill, "--served-model-name") == "warply"
    assert _flag(prefill, "--block-size") == "256"  # = LMCache's chunk size
    assert (prefill.env["VLLM_CPU_OMP_THREADS_BIND"], decode.env["VLLM_CPU_OMP_THREADS_BIND"]) == (
        "0", "1")  # fmt: skip
    assert (prefill.cpus, decode.cpus) == ((0,), (1,))  # each engine confined to its core
    for proc, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        kv = _kv(proc)
        assert kv["kv_connector"] == "WarplyConnector" and kv["kv_role"] == role
        assert kv["kv_load_failure_policy"] == "recompute"
        extra = kv["kv_connector_extra_config"]
        assert extra["delegate"]["kv_connector"] == "MultiConnector"
        nixl, lmcache = extra["delegate"]["kv_connector_extra_config"]["connectors"]
        assert nixl == {"kv_connector": "NixlConnector", "kv_role": role,
                        "kv_buffer_device": "cpu"}  # fmt: skip
        assert lmcache["kv_connector"] == "LMCacheMPConnector" and lmcache["kv_role"] == "kv_both"
        assert extra["warply"]["worker"] == proc.name and extra["warply"]["model"] == "warply"
        assert extra["warply"]["lmcache_url"].startswith("http://127.0.0.1:")
        assert proc.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    config = RouterConfig.model_validate(plan.router_config)
    assert config.model == "warply" and config.strategy.name == "prefix_affinity"
    assert config.alerts.min_hit_ratio == 0.6
    assert [(p.name, p.role, p.block_size) for p in config.pools] == [
        ("prefill", "prefill", 256), ("decode", "decode", 256)]  # fmt: skip
    worker = config.pools[0].workers[0]
    assert worker.bind and worker.events == _kv(prefill)["kv_connector_extra_config"]["warply"][
        "events_endpoint"]  # fmt: skip
    assert plan.router.argv[:3] == ["/py", "-m", "router"]


def test_aggregated_without_tiers_has_no_delegate(model_dir: str, tmp_path: Path) -> None:
    spec = wp.Engine(model=model_dir, pool=wp.Pool("cpu", replicas=3),
                     routing=wp.CacheRouting(tier_policy="lru_by_tier"))  # fmt: skip
    plan = make_plan(spec, BINS, tmp_path, cpu_cores=2)
    assert plan.services == [] and [p.name for p in plan.engines] == [
        "engine-0", "engine-1", "engine-2"]  # fmt: skip
    assert [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in plan.engines] == ["0", "1", "0"]
    assert [p.cpus for p in plan.engines] == [(0,), (1,), (0,)]
    assert plan.router.cpus == ()
    kv = _kv(plan.engines[0])
    assert kv["kv_role"] == "kv_both" and "delegate" not in kv["kv_connector_extra_config"]
    assert _flag(plan.engines[0], "--block-size") == "32"
    config = RouterConfig.model_validate(plan.router_config)
    assert config.pools[0].role == "both" and config.tiering is not None
    assert config.tiering.policy.name == "lru_by_tier"


def test_engines_that_trust_request_chat_templates_make_the_router_trust_them(
    model_dir: str, tmp_path: Path
) -> None:
    """The router renders a request's own template only when the engines do (vLLM's flag in
    every pool's `engine_args`); otherwise it refuses such requests as they would."""
    flag = ["--trust-request-chat-template"]
    trusting = wp.Engine(model=model_dir, pool=wp.Pool("cpu", engine_args=flag))
    default = wp.Engine(model=model_dir)
    for spec, trusted in ((trusting, True), (default, False)):
        config = RouterConfig.model_validate(make_plan(spec, BINS, tmp_path).router_config)
        assert config.trust_request_chat_template is trusted


def test_the_engines_chat_template_flags_reach_the_router(model_dir: str, tmp_path: Path) -> None:
    """`--chat-template`, `--chat-template-content-format` and `--default-chat-template-kwargs`
    in the pools' `engine_args` become the router's settings (a file's path made absolute), so
    it renders chats as the engines do; pools that disagree, or kwargs that are not JSON, are a
    `PlanError` before anything starts."""
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}")
    flags = [f"--chat-template={template}", "--chat-template-content-format", "openai",
             "--default-chat-template-kwargs", '{"enable_thinking": false}',
             "--exclude-tools-when-tool-choice-none",
             "--anthropic-disabled-thinking-effort=none"]  # fmt: skip
    spec = wp.DisaggEngine(model=model_dir, backend="vllm", kv_transfer="nixl",
                           prefill=wp.Pool("cpu", engine_args=flags),
                           decode=wp.Pool("cpu", engine_args=flags))  # fmt: skip
    config = RouterConfig.model_validate(make_plan(spec, BINS, tmp_path).router_config)
    assert (config.chat_template, config.chat_template_content_format) == (str(template), "openai")
    assert config.default_chat_template_kwargs == {"enable_thinking": False}
    assert config.exclude_tools_when_tool_choice_none
    assert config.anthropic_disabled_thinking_effort == "none"
    plain_plan = make_plan(wp.Engine(model=model_dir), BINS, tmp_path)
    plain = RouterConfig.model_validate(plain_plan.router_config)
    assert plain.chat_template is None and plain.default_chat_template_kwargs == {}
    assert not plain.exclude_tools_when_tool_choice_none
    assert plain.anthropic_disabled_thinking_effort == "auto"
    split = spec.model_copy(update={"decode": wp.Pool("cpu")})
    with pytest.raises(PlanError, match="chat-template flags differently .*decode: none"):
        make_plan(split, BINS, tmp_path)
    bad = wp.Engine(model=model_dir, pool=wp.Pool(
        "cpu", engine_args=["--default-chat-template-kwargs", "{x"]))  # fmt: skip
    with pytest.raises(PlanError, match="--default-chat-template-kwargs"):
        make_plan(bad, BINS, tmp_path)


def test_a_pool_that_binds_its_own_threads_is_not_confined(model_dir: str, tmp_path: Path) -> None:
    spec = wp.Engine(model=model_dir, pool=wp.Pool("cpu", env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"}))
    (engine,) = make_plan(spec, BINS, tmp_path, cpu_cores=2).engines
    assert engine.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and engine.cpus == ()


def test_an_environment_that_rebinds_the_threads_lifts_the_confinement(
    model_dir: str, tmp_path: Path
) -> None:
    (engine,) = make_plan(wp.Engine(model=model_dir), BINS, tmp_path, cpu_cores=2).engines
    assert engine.with_env({}).cpus == engine.with_env({"HF_HOME": "/hf"}).cpus == (0,)
    assert engine.with_env({"VLLM_CPU_OMP_THREADS_BIND": "0"}).cpus == (0,)
    rebound = engine.with_env({"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    assert rebound.cpus == () and rebound.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_an_s3_tier_on_an_http_endpoint_reaches_it_through_the_proxy(
    model_dir: str, tmp_path: Path
) -> None:
    tier = wp.KVTier(l2="cpu", l3="ssd", ssd_path="/kv", l4="object_store",
                     object_store_url="s3://kv", object_store_endpoint="http://127.0.0.1:9000")
    spec = wp.Engine(model=model_dir, pool=wp.Pool("cpu"), routing=wp.CacheRouting(tiering=tier))
    (lmcache,) = make_plan(spec, BINS, tmp_path, cpu_cores=2).services
    assert lmcache.env["HTTP_PROXY"] == "http://127.0.0.1:9000"  # LMCache's BUCKET.HOST
    assert json.loads(lmcache.argv[-1])["s3_endpoint"] == "s3://kv.127.0.0.1:9000"


def test_gpu_pools_take_devices_in_order(model_dir: str, tmp_path: Path) -> None:
    spec = wp.DisaggEngine(model=model_dir, prefill=wp.Pool("1xH100", replicas=2),
                           decode=wp.Pool("2xH100"))  # fmt: skip
    plan = make_plan(spec, BINS, tmp_path, gpus=4)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plan.engines] == ["0", "1", "2,3"]
    assert _flag(plan.engines[2], "--tensor-parallel-size") == "2"
    assert "--enforce-eager" not in plan.engines[0].argv
    with pytest.raises(PlanError, match=r"needs 4 GPUs \(prefill 2×1xH100, decode 1×2xH100\) "
                       "but this host has 3"):  # fmt: skip
        make_plan(spec, BINS, tmp_path, gpus=3)


def test_sglang_disaggregation_flags(model_dir: str, tmp_path: Path) -> None:
    spec = wp.DisaggEngine(
        model=model_dir, backend="sglang", kv_transfer="mooncake",
        prefill=wp.Pool("1xH200", engine_args=["--hf-chat-template-name", "tool_use"]),
        decode=wp.Pool("1xH200", engine_args=["--hf-chat-template-name=tool_use",
                                              "--mem-fraction", "0.8"]),
        routing=wp.CacheRouting(tiering=wp.KVTier(l2="cpu", l2_size_gb=8)),
    )  # fmt: skip
    plan = make_plan(spec, BINS, tmp_path, gpus=2)
    prefill, decode = plan.engines
    assert prefill.argv[:3] == ["/sg/bin/python", "-m", "sglang.launch_server"]
    assert "--enable-warply" in prefill.argv and _flag(prefill, "--warply-worker") == "prefill-0"
    assert _flag(prefill, "--disaggregation-mode") == "prefill"
    assert _flag(decode, "--disaggregation-transfer-backend") == "mooncake"
    assert _flag(decode, "--hicache-size") == "8" and decode.argv[-1] == "0.8"
    config = RouterConfig.model_validate(plan.router_config)
    assert config.pools[0].kv_handoff == "sglang"
    assert config.hf_chat_template_name == "tool_use"  # the router picks SGLang's template too
    assert config.pools[0].workers[0].bootstrap_port == int(
        _flag(prefill, "--disaggregation-bootstrap-port"))  # fmt: skip


def test_a_loopback_redis_object_store_gets_a_server(model_dir: str, tmp_path: Path) -> None:
    tier = wp.KVTier(l2="cpu", l3="ssd", ssd_path="/tmp/kv", l4="object_store",
                     object_store_url="redis://127.0.0.1:6390")  # fmt: skip
    spec = wp.Engine(model=model_dir, routing=wp.CacheRouting(tiering=tier))
    plan = make_plan(spec, BINS, tmp_path)
    assert plan.services[0].name == "redis" and plan.services[0].argv[:2] == [
        "redis-server", "--bind"]  # fmt: skip
    assert _flag(plan.services[0], "--port") == "6390"


def test_a_loopback_mooncake_master_is_started_first(model_dir: str, tmp_path: Path) -> None:
    tier = wp.KVTier(backend="mooncake", l2="cpu", mooncake_master="127.0.0.1:50051")
    spec = wp.Engine(model=model_dir, pool=wp.Pool("cpu", replicas=2),
                     routing=wp.CacheRouting(tiering=tier))  # fmt: skip
    plan = make_plan(spec, BINS, tmp_path)
    assert [s.name for s in plan.services] == ["mooncake-master"]  # one, shared by both engines
    master = plan.services[0]
    assert master.argv[0] == "/env/bin/mooncake_master" and master.url == "http://127.0.0.1:9003"
    assert "--rpc_port=50051" in master.argv
    for engine in plan.engines:
        config = json.loads(_flag(engine, "--kv-transfer-config"))
        assert config["kv_connector_extra_config"]["warply"]["mooncake_url"] == master.url
    remote = tier.model_copy(update={"mooncake_master": "10.0.0.7:50051"})
    spec = wp.Engine(model=model_dir, routing=wp.CacheRouting(tiering=remote))
    assert make_plan(spec, BINS, tmp_path).services == []  # someone else's master


def test_a_hub_model_must_be_in_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    spec = wp.Engine(model="acme/model-7b")
    with pytest.raises(PlanError, match="'acme/model-7b' is not in the Hugging Face cache"):
        make_plan(spec, BINS, tmp_path)
    snap = tmp_path / "hub" / "models--acme--model-7b" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_text("{}")
    assert make_plan(spec, BINS, tmp_path).router_config["tokenizer"] == str(snap)
