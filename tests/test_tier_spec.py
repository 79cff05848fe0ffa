"""`KVTier`: each impossible combination is rejected with an actionable message, and valid
specs render to exact backend configuration."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from warply.spec import KVTier, render_sglang, render_vllm


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"l1": "cpu"}, "l1 must be 'gpu'"),
        ({"l2": "ssd", "ssd_path": "/x"}, "l2 must be 'cpu' (after l1='gpu'"),
        ({"l2": "cpu", "l2_size_gb": 1, "l3": "cpu"}, "l3 must be 'ssd'"),
        ({"l3": "ssd", "ssd_path": "/x"}, "l2 is empty but l3 is set"),
        ({"l2": "cpu", "l2_size_gb": 0}, "greater than 0"),
        ({"l2": "cpu", "l2_size_gb": 1, "l3": "ssd"}, "l3='ssd' needs ssd_path"),
        ({"ssd_path": "/x"}, "ssd_path is set but no level is 'ssd'"),
        (
            {"l2": "cpu", "l2_size_gb": 1, "l3": "ssd", "ssd_path": "/x", "l4": "object_store"},
            "l4='object_store' needs object_store_url",
        ),
        (
            {"l2": "cpu", "l2_size_gb": 1, "l3": "ssd", "ssd_path": "/x", "l4": "object_store",
             "object_store_url": "ftp://h"},
            "expected s3://BUCKET or redis://HOST:PORT",
        ),
        (
            {"l2": "cpu", "l2_size_gb": 1, "l3": "ssd", "ssd_path": "/x", "l4": "object_store",
             "object_store_url": "s3://bucket/kv"},
            "LMCache's s3 adapter writes at the bucket's root",
        ),
        (
            {"l2": "cpu", "l2_size_gb": 1, "l3": "ssd", "ssd_path": "/x", "l4": "object_store",
             "object_store_url": "redis://h"},
            "give the port",
        ),
        ({"backend": "hicache"}, "'hicache' is SGLang's hierarchical cache"),
        ({"backend": "mooncake"}, "'mooncake' serves l2 on vLLM"),
        ({"backend": "mooncake", "l2": "cpu", "l2_size_gb": 1}, "needs mooncake_master"),
        (
            {"backend": "mooncake", "l2": "cpu", "mooncake_master": "master"},
            "expected HOST:PORT",
        ),
        (
            {"backend": "mooncake", "l2": "cpu", "l2_size_gb": 1, "l3": "ssd", "ssd_path": "/x",
             "mooncake_master": "h:1"},
            "no ssd tier Warply can configure",
        ),
        ({"engine": "sglang", "backend": "lmcache"}, "'lmcache' on SGLang"),
        (
            {"engine": "sglang", "device": "cpu", "l2": "cpu", "l2_size_gb": 1},
            "HiCache's host tier, which needs a GPU",
        ),
        ({"engine": "sglang", "l2": "cpu", "l2_size_gb": 1.5}, "takes whole gigabytes"),
        (
            {"engine": "sglang", "l2": "cpu", "l2_size_gb": 1, "l3": "ssd", "ssd_path": "/x",
             "l4": "object_store", "object_store_url": "s3://b"},
            "HiCache (0.5.23) has one storage tier",
        ),
        (
            {"engine": "sglang", "l2": "cpu", "l2_size_gb": 1, "l3": "ssd", "ssd_path": "/x",
             "ssd_size_gb": 10},
            "has no capacity limit",
        ),
        (
            {"engine": "sglang", "backend": "mooncake", "l2": "cpu", "l2_size_gb": 1},
            "'mooncake' serves SGLang's L3",
        ),
        (
            {"l2": "cpu", "l2_size_gb": 1, "l3": "ssd", "ssd_path": "/x", "ssd_size_gb": 10},
            "fs adapter has no capacity option",
        ),
        ({"l5": "gpu"}, "Extra inputs are not permitted"),
    ],
)
def test_impossible_combinations_say_what_to_change(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as err:
        KVTier.model_validate(spec)
    assert message in str(err.value)


def test_vllm_cpu_with_every_tier_renders_lmcache_mp() -> None:
    tier = KVTier(
        device="cpu", l2="cpu", l2_size_gb=0.25, l3="ssd", ssd_path="/nvme/kv",
        l4="object_store", object_store_url="s3://kv-bucket",
        object_store_endpoint="http://127.0.0.1:9000", lmcache_port=6555, lmcache_http_port=6580,
    )  # fmt: skip
    out = render_vllm(tier, {"events_endpoint": "tcp://*:5557"})
    assert out.kv_transfer_config == {
        "kv_connector": "WarplyConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "delegate": {
                "kv_connector": "LMCacheMPConnector",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://127.0.0.1",
                    "lmcache.mp.port": 6555,
                },
            },
            "warply": {"events_endpoint": "tcp://*:5557", "lmcache_url": "http://127.0.0.1:6580"},
        },
    }
    assert out.engine_args[0] == "--kv-transfer-config"
    assert json.loads(out.engine_args[1]) == out.kv_transfer_config
    assert out.lmcache_server == [
        "lmcache", "server", "--host", "127.0.0.1", "--port", "6555",
        "--http-host", "127.0.0.1", "--http-port", "6580", "--chunk-size", "256",
        "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
        "--supported-transfer-mode", "engine_driven",
        "--l2-adapter", '{"type":"fs","base_path":"/nvme/kv"}',
        "--l2-adapter",
        '{"type":"s3","s3_endpoint":"s3://kv-bucket.127.0.0.1:9000","s3_region":"us-east-1",'
        '"disable_tls":true}',
    ]  # fmt: skip
    # The bucket's host name resolves nowhere: plain-HTTP requests go through the endpoint.
    proxy = "http://127.0.0.1:9000"
    assert out.lmcache_env == {"HTTP_PROXY": proxy, "http_proxy": proxy}
    assert out.mooncake_config is None


def test_vllm_redis_and_gpu_only() -> None:
    tier = KVTier(
        l2="cpu", l2_size_gb=8, l3="ssd", ssd_path="/d", l4="object_store",
        object_store_url="redis://kv:secret@10.0.0.5:6379",
    )  # fmt: skip
    server = render_vllm(tier).lmcache_server
    assert server is not None and "--supported-transfer-mode" not in server  # GPU: the default
    assert json.loads(server[-1]) == {
        "type": "resp", "host": "10.0.0.5", "port": 6379, "username": "kv", "password": "secret",
    }  # fmt: skip
    assert render_vllm(tier).lmcache_env == {}  # redis: no proxy
    aws = KVTier(l2="cpu", l3="ssd", ssd_path="/d", l4="object_store", object_store_url="s3://b")
    assert render_vllm(aws).lmcache_env == {}  # AWS: BUCKET.s3.REGION.amazonaws.com resolves
    plain = render_vllm(KVTier())
    assert plain.kv_transfer_config == {"kv_connector": "WarplyConnector", "kv_role": "kv_both"}
    assert plain.lmcache_server is None


def test_vllm_mooncake_store_file() -> None:
    tier = KVTier(backend="mooncake", l2="cpu", l2_size_gb=2, mooncake_master="127.0.0.1:50051")
    out = render_vllm(tier)
    assert out.kv_transfer_config["kv_load_failure_policy"] == "recompute"
    assert out.kv_transfer_config["kv_connector_extra_config"] == {
        "delegate": {"kv_connector": "MooncakeStoreConnector"},
        "warply": {"mooncake_url": "http://127.0.0.1:9003"},
    }
    assert out.mooncake_master == [
        "mooncake_master", "--rpc_address=127.0.0.1", "--rpc_port=50051",
        "--metrics_host=127.0.0.1", "--metrics_port=9003",
    ]  # fmt: skip
    assert out.mooncake_config == {
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": "127.0.0.1:50051",
        "protocol": "tcp",
        "device_name": "",
        "mode": "embedded",
        "global_segment_size": 2 << 30,
    }
    assert out.lmcache_server is None
    http = KVTier(
        backend="mooncake", l2="cpu", mooncake_master="10.0.0.2:50051", mooncake_metrics_port=9100,
        mooncake_metadata_server="http://10.0.0.2:8080/metadata",
    )  # fmt: skip
    rendered = render_vllm(http, {"mooncake_url": "http://mc:1"})
    assert rendered.mooncake_master is not None
    assert rendered.mooncake_master[-3:] == [
        "--enable_http_metadata_server=true", "--http_metadata_server_host=10.0.0.2",
        "--http_metadata_server_port=8080",
    ]  # fmt: skip
    assert rendered.kv_transfer_config["kv_connector_extra_config"]["warply"] == {
        "mooncake_url": "http://mc:1"
    }


def test_sglang_hicache_with_warply_l3_and_mooncake() -> None:
    tier = KVTier(engine="sglang", l2="cpu", l2_size_gb=16, l3="ssd", ssd_path="/nvme/l3")
    assert render_sglang(tier).server_args == [
        "--enable-hierarchical-cache", "--hicache-size", "16",
        "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
        '{"backend_name":"warply","module_path":"sglang_hook.storage",'
        '"class_name":"WarplyL3Storage","store":"file","path":"/nvme/l3"}',
    ]  # fmt: skip
    moon = KVTier(
        engine="sglang", backend="mooncake", l2="cpu", l2_size_gb=4, l3="ssd", ssd_path="/m",
        mooncake_master="127.0.0.1:50051",
    )  # fmt: skip
    args = render_sglang(moon).server_args
    assert args[3:5] == ["--hicache-storage-backend", "mooncake"]
    assert json.loads(args[-1]) == {
        "master_server_address": "127.0.0.1:50051", "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp", "enable_ssd_offload": True, "ssd_offload_path": "/m",
    }  # fmt: skip
    assert render_sglang(KVTier(engine="sglang")).server_args == []
    with pytest.raises(ValueError, match="this KVTier is for sglang"):
        render_vllm(tier)
