"""The plugin's Mooncake client (`vllm_connector.mooncake`) against a real `mooncake_master` on
loopback, without an engine: objects put by a client with a segment (as an engine's worker
does), read back, removed and soft-pinned by the plugin's client with none, set up from a store
file as the engine's is (`MOONCAKE_CONFIG_PATH`).

Needs `mooncake-transfer-engine-non-cuda` (0.3.13) and the system's libibverbs in this venv.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HOST, free_port

from vllm_connector.mooncake import MooncakeError, MooncakeStore, connect_store
from warply.launch import EngineProcess
from warply.protocol import Tier
from warply.spec import KVTier, render_vllm

store_module = pytest.importorskip(
    "mooncake.store",
    reason="mooncake-transfer-engine-non-cuda (0.3.13) is not installed in this venv",
)

pytestmark = pytest.mark.timeout(120)

MODEL_KEY = "tiny@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:0@{hash}"
"""MooncakeStoreConnector's key shape (vLLM 0.32), for objects put by hand here."""
SIZE = 64 << 10


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The master (render_vllm's argv) and the store file naming it."""
    logs = tmp_path_factory.mktemp("mooncake")
    tier = KVTier(
        device="cpu", backend="mooncake", l2="cpu", l2_size_gb=0.0625,
        mooncake_master=f"{HOST}:{free_port()}", mooncake_metrics_port=free_port(),
    )  # fmt: skip
    rendered = render_vllm(tier)
    assert rendered.mooncake_master is not None and rendered.mooncake_config is not None
    store_file = logs / "mooncake.json"
    store_file.write_text(json.dumps(rendered.mooncake_config))
    binary = Path(str(store_module.__file__)).parent / "mooncake_master"
    url = rendered.kv_transfer_config["kv_connector_extra_config"]["warply"]["mooncake_url"]
    proc = EngineProcess(
        [str(binary), *rendered.mooncake_master[1:]], url=url, log_path=logs / "master.log"
    )
    try:
        proc.start()
        proc.wait_healthy(60, path="/health")
        yield url, store_file
    finally:
        proc.stop()


@pytest.fixture
def clients(
    master: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Any, MooncakeStore]]:
    """A client with a 64 MiB segment (the objects' home) and the plugin's store."""
    url, store_file = master
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(store_file))
    config = json.loads(store_file.read_text())
    owner = store_module.MooncakeDistributedStore()
    assert owner.setup(HOST, config["metadata_server"], 64 << 20, 16 << 20, "tcp", "",
                       config["master_server_address"]) == 0  # fmt: skip
    plugin = MooncakeStore(url, 0.2, connect_store)
    try:
        yield owner, plugin
    finally:
        plugin.close()
        owner.remove_all(True)
        owner.close()


def _put(owner: Any, block_hash: bytes, ranks: int = 1) -> list[str]:
    keys = [MODEL_KEY.format(rank=r, hash=block_hash.hex()) for r in range(ranks)]
    for key in keys:
        assert owner.put(key, bytes([len(key) % 256]) * SIZE) == 0
    return keys


def _soft_pins(plugin: MooncakeStore) -> int:
    with urllib.request.urlopen(plugin.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("master_soft_pin_key_count "):
            return int(float(line.split()[1]))
    raise AssertionError("no master_soft_pin_key_count")


def test_bytes_keys_and_a_removal_as_the_master_reports_them(
    clients: tuple[Any, MooncakeStore],
) -> None:
    owner, plugin = clients
    assert plugin.allocated_bytes() == 0
    a, b, c = bytes(range(32)), bytes(range(1, 33)), bytes(range(2, 34))
    keys_a = _put(owner, a, ranks=2)  # one object per TP rank
    keys_b = _put(owner, b)
    assert plugin.allocated_bytes() == 3 * SIZE
    assert plugin.tier_bytes == {Tier.CPU: 3 * SIZE}
    assert sorted(plugin.keys_for([a, c])) == sorted(keys_a)  # c was never stored

    gone = plugin.remove(plugin.keys_for([a]))
    assert sorted(gone.removed) == sorted(keys_a) and gone.leased == gone.failed == 0
    assert plugin.allocated_bytes() == SIZE
    assert plugin.keys_for([a]) == []

    # A lookup leases the object: the plugin's remove keeps it and says so.
    assert owner.is_exist(keys_b[0]) == 1
    kept = plugin.remove(keys_b)
    assert kept.removed == [] and kept.leased == 1
    assert plugin.allocated_bytes() == SIZE


def test_soft_pin_and_unpin_rewrite_the_objects_the_master_counts(
    clients: tuple[Any, MooncakeStore],
) -> None:
    owner, plugin = clients
    keys = _put(owner, bytes(range(5, 37)), ranks=2)
    assert _soft_pins(plugin) == 0
    assert plugin.soft_pin(keys, pin=True, ttl_s=60) == 2
    assert _soft_pins(plugin) == 2
    assert owner.get(keys[0]) == bytes([len(keys[0]) % 256]) * SIZE  # same bytes after upsert
    assert plugin.soft_pin(keys, pin=False, ttl_s=0) == 2
    assert _soft_pins(plugin) == 0


def test_an_unreachable_master_is_an_error_not_a_crash(
    master: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    plugin = MooncakeStore(f"http://{HOST}:{free_port()}", 0.2, connect_store)
    with pytest.raises(MooncakeError, match="MOONCAKE_CONFIG_PATH"):
        plugin.remove(["tiny@k"])  # no store file: the client cannot be set up
    with pytest.raises(MooncakeError, match="GET /metrics"):
        plugin.allocated_bytes()
    with pytest.raises(MooncakeError, match="GET /get_all_keys"):
        plugin.keys_for([b"\x00" * 32])
    assert plugin.tier_bytes is None
