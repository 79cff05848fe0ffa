"""SGLang venv: the HiCache flags `warply.spec.render_sglang` writes parse with SGLang 0.5.23's
own `ServerArgs` parser into the fields they mean."""

from __future__ import annotations

import argparse
import json

from sglang.srt.server_args import ServerArgs

from warply.spec import KVTier, render_sglang


def _parse(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(["--model-path", "dummy", *args])


def test_hicache_with_warply_l3() -> None:
    tier = KVTier(engine="sglang", l2="cpu", l2_size_gb=16, l3="ssd", ssd_path="/nvme/l3")
    ns = _parse(render_sglang(tier).server_args)
    assert ns.enable_hierarchical_cache is True
    assert ns.hicache_size == 16
    assert ns.hicache_storage_backend == "dynamic"
    extra = json.loads(ns.hicache_storage_backend_extra_config)
    assert (extra["module_path"], extra["class_name"]) == ("sglang_hook.storage", "WarplyL3Storage")
    assert extra["store"] == "file" and extra["path"] == "/nvme/l3"


def test_mooncake_storage_config_loads() -> None:
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStoreConfig

    tier = KVTier(
        engine="sglang", backend="mooncake", l2="cpu", l2_size_gb=4, l3="ssd", ssd_path="/m",
        mooncake_master="127.0.0.1:50051",
    )  # fmt: skip
    ns = _parse(render_sglang(tier).server_args)
    assert ns.hicache_storage_backend == "mooncake"
    config = MooncakeStoreConfig.load_from_extra_config(
        json.loads(ns.hicache_storage_backend_extra_config)
    )
    assert config.master_server_address == "127.0.0.1:50051"
    assert config.enable_ssd_offload is True and config.ssd_offload_path == "/m"
    assert config.protocol == "tcp"
