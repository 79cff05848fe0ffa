"""`up()` refusing what this host cannot run, before starting anything, and `down()` without a
run. Real starts and failures: tests/vllm/test_sdk_lifecycle.py, tests/lmcache/test_sdk_up.py."""

from __future__ import annotations

import signal
import stat
from pathlib import Path

import pytest

import warply as wp
from warply.common.files import write_private
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


def test_a_new_run_folder_and_the_token_files_are_the_owners_alone(
    model_dir: str, tmp_path: Path
) -> None:
    """The run folder's router.yaml and state.json hold the router's admin and control tokens."""
    run = tmp_path / "run"
    with pytest.raises(wp.UpError):
        wp.Engine(model=model_dir).up(run_dir=run, vllm=str(tmp_path / "vllm"), progress=None)
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    token_file = tmp_path / "router.yaml"
    token_file.write_text("before")
    token_file.chmod(0o644)
    write_private(token_file, "auth_token: t")
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token_file.read_text() == "auth_token: t"


def test_a_short_control_token_is_named_before_anything_starts(
    model_dir: str, tmp_path: Path
) -> None:
    """`up()` gives its router and engines the WARPLY_CONTROL_TOKEN a caller or pool sets; one
    the router and the plugins would refuse is an UpError naming it, not a router that exits."""
    error = "^WARPLY_CONTROL_TOKEN has 5 characters; .* at least 16$"
    short = {"WARPLY_CONTROL_TOKEN": "short"}
    for spec, env in (
        (wp.Engine(model=model_dir, pool=wp.Pool("cpu", env=short)), {}),
        (wp.Engine(model=model_dir), short),
    ):
        with pytest.raises(wp.UpError, match=error):
            spec.up(run_dir=tmp_path / "run", env=env, progress=None)
    assert not list((tmp_path / "run").iterdir())


def test_gpu_pools_on_a_host_without_gpus(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    spec = wp.Engine(model=model_dir, pool=wp.Pool("2xH100"))
    with pytest.raises(wp.UpError, match=r"needs 2 GPUs \(engine 1×2xH100\) but this host has 0"):
        spec.up(run_dir=tmp_path, progress=None)


def test_a_run_folder_that_cannot_be_made_is_an_up_error(model_dir: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "file" / "run"
    error = f"^cannot make the run folder {run_dir}: Not a directory$"
    for folder in (run_dir, str(run_dir)):  # a path as text too
        with pytest.raises(wp.UpError, match=error):
            wp.Engine(model=model_dir, pool=wp.Pool("cpu")).up(run_dir=folder, progress=None)


def test_down_without_a_run(tmp_path: Path) -> None:
    for run_dir in (tmp_path, str(tmp_path)):  # a path as text too
        with pytest.raises(FileNotFoundError, match="no running deployment in"):
            down(run_dir, progress=None)


def test_up_stops_on_sigterm_while_it_is_up(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a deployment is up, SIGTERM (left at its default by the program) ends the program
    through `SystemExit`, so the `with` block or `atexit` stops the engines; `down()` gives the
    signal back (what SIGTERM then does to a program that started engines: tests/test_launch.py)."""

    class _Running:
        stopped = False

        def stop(self) -> None:
            self.stopped = True

    monkeypatch.setattr("warply.lifecycle.up", lambda spec, **options: _Running())
    monkeypatch.setattr("atexit.register", lambda fn: fn)
    spec = wp.Engine(model=model_dir, pool=wp.Pool("cpu"))
    before = signal.getsignal(signal.SIGTERM)
    assert before == signal.SIG_DFL
    with spec:
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        with pytest.raises(SystemExit) as exit_:
            handler(signal.SIGTERM, None)
        assert exit_.value.code == 128 + signal.SIGTERM
        signal.signal(signal.SIGTERM, handler)
    assert spec._running is not None and spec._running.stopped
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
