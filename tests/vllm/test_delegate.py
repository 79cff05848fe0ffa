"""WarplyConnector around a real delegate (vLLM's ExampleConnector, which runs on CPU), and a
configuration error failing start-up.

Two engines share one fresh storage folder: one is WarplyConnector(delegate=ExampleConnector),
the other a plain ExampleConnector. Each must load what the other saved, so the wrapped
delegate writes the same files and reads them the same way as the bare one.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import complete, engine, start_all

from warply.launch import VllmServer

pytestmark = pytest.mark.timeout(600)

BLOCK = 128


def _prompt(seed: int, n: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 8192) for _ in range(n)]


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("example-connector")


@pytest.fixture(scope="module")
def engines(tiny_model: str, server_logs: Path, storage: Path) -> Iterator[dict[str, Any]]:
    example = {"shared_storage_path": str(storage)}
    wrapped = engine(
        tiny_model,
        server_logs / "warply-example.log",
        block_size=BLOCK,
        kv_transfer={
            "kv_connector": "WarplyConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "delegate": {
                    "kv_connector": "ExampleConnector",
                    "kv_connector_extra_config": example,
                }
            },
        },
        env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
    )
    bare = engine(
        tiny_model,
        server_logs / "bare-example.log",
        block_size=BLOCK,
        kv_transfer={
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": example,
        },
        env={"VLLM_CPU_OMP_THREADS_BIND": "1"},
    )
    bad = engine(
        tiny_model,
        server_logs / "bad-config.log",
        block_size=BLOCK,
        kv_transfer={
            "kv_connector": "WarplyConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"delegate": {"kv_connector": "NoSuchConnector"}},
        },
    )
    bad.start()
    try:
        start_all([wrapped, bare])
        yield {"wrapped": wrapped, "bare": bare, "bad": bad}
    finally:
        for s in (wrapped, bare, bad):
            s.stop()


def _folders(storage: Path) -> set[str]:
    return {p.name for p in storage.iterdir() if p.is_dir()}


def _cached(out: dict[str, Any]) -> int:
    details = out["usage"]["prompt_tokens_details"] or {}
    return int(details.get("cached_tokens") or 0)


@pytest.mark.parametrize(("writer", "reader"), [("wrapped", "bare"), ("bare", "wrapped")])
def test_delegate_saves_and_loads_like_bare_connector(
    engines: dict[str, Any], storage: Path, writer: str, reader: str
) -> None:
    prompt = _prompt(1 if writer == "wrapped" else 2)
    before = _folders(storage)
    written = complete(engines[writer], prompt, max_tokens=16)
    new = _folders(storage) - before
    assert len(new) == 1, f"{writer} should save one prompt folder, got {new}"
    assert any((storage / next(iter(new))).glob("*.safetensors"))

    loaded = complete(engines[reader], prompt, max_tokens=16)
    assert _cached(loaded) == (len(prompt) - 2) // BLOCK * BLOCK  # ExampleConnector's alignment
    assert loaded["choices"][0]["text"] == written["choices"][0]["text"]
    assert _folders(storage) - before == new  # the reader found it: nothing new saved


def test_config_error_fails_startup(engines: dict[str, Any]) -> None:
    bad: VllmServer = engines["bad"]
    code = bad.wait_exit(240)
    assert code not in (None, 0)
    log = bad.log_path.read_text(errors="replace")
    assert (
        "WarplyConnector: invalid kv_connector_extra_config: delegate.kv_connector: "
        "Unsupported connector type: NoSuchConnector" in log
    )
