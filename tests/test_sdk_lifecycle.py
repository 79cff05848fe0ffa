"""`up()` refusing what this host cannot run, before starting anything, and `down()` without a
run. Real starts and failures: tests/vllm/test_sdk_lifecycle.py, tests/lmcache/test_sdk_up.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import warply as wp
from warply.lifecycle import down


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text("{}")
    return str(folder)


def test_an_engine_environment_without_the_modules_is_named(
    model_dir: str, tmp_path: Path
) -> None:
    spec = wp.DisaggEngine(model=model_dir, prefill=wp.Pool("cpu"), decode=wp.Pool("cpu"),
                           routing=wp.CacheRouting(tiering=wp.KVTier(l2="cpu")))  # fmt: skip
    with pytest.raises(wp.UpError) as err:
        spec.up(run_dir=tmp_path, vllm=str(tmp_path / "env" / "bin" / "vllm"), progress=None)
    assert str(err.value) == (
        "no vLLM environment has what this spec needs (vllm, nixl, lmcache): "
        f"{tmp_path / 'env' / 'bin' / 'vllm'} lacks vllm, nixl, lmcache "
        "(pass vllm=PATH or set WARPLY_VLLM)"
    )
    assert not list(tmp_path.glob("*.log")) and not (tmp_path / "state.json").exists()


def test_gpu_pools_on_a_host_without_gpus(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    spec = wp.Engine(model=model_dir, pool=wp.Pool("2xH100"))
    with pytest.raises(wp.UpError, match=r"needs 2 GPUs \(engine 1×2xH100\) but this host has 0"):
        spec.up(run_dir=tmp_path, progress=None)


def test_down_without_a_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no running deployment in"):
        down(tmp_path, progress=None)
