"""vLLM venv: the `--kv-transfer-config` that `warply.spec.render_vllm` writes is a valid vLLM
0.32 `KVTransferConfig` whose extra config WarplyConnector accepts, naming a delegate vLLM
registers (no server is started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from vllm_connector.config import parse_config
from warply.spec import KVTier, render_vllm


@pytest.mark.parametrize(
    ("tier", "delegate"),
    [
        (
            KVTier(device="cpu", l2="cpu", l2_size_gb=0.25, l3="ssd", ssd_path="/tmp/kv"),
            "LMCacheMPConnector",
        ),
        (
            KVTier(backend="mooncake", l2="cpu", l2_size_gb=1, mooncake_master="127.0.0.1:1"),
            "MooncakeStoreConnector",
        ),
    ],
)
def test_rendered_config_is_valid_for_vllm(tier: KVTier, delegate: str) -> None:
    out = render_vllm(tier, {"events_endpoint": "tcp://127.0.0.1:5557"})
    config = KVTransferConfig(**json.loads(out.engine_args[1]))
    assert config.kv_connector == "WarplyConnector" and config.kv_role == "kv_both"
    parsed = parse_config(config.kv_connector_extra_config)
    assert parsed.delegate is not None and parsed.delegate.kv_connector == delegate
    assert delegate in KVConnectorFactory._registry  # vLLM registers it by this name
    if delegate == "LMCacheMPConnector":
        mp = parsed.delegate.kv_connector_extra_config
        assert mp == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555}


def test_mooncake_store_file_loads_with_vllms_reader(tmp_path: Path) -> None:
    from vllm.distributed.mooncake_store import MooncakeStoreConfig

    tier = KVTier(backend="mooncake", l2="cpu", l2_size_gb=2, mooncake_master="127.0.0.1:50051")
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(render_vllm(tier).mooncake_config))
    config = MooncakeStoreConfig.from_file(str(path))
    assert config.master_server_address == "127.0.0.1:50051"
    assert config.global_segment_size == 2 << 30 and config.mode == "embedded"
