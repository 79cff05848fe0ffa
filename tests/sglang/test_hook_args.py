"""SGLang venv: `--enable-warply` through SGLang's real `prepare_server_args`, hooks applied."""

from __future__ import annotations

import json

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.server_args import prepare_server_args

import sglang_hook.settings as settings_mod
import warply_plugins.sglang as plugin
from warply.protocol import PluginSettings


@pytest.fixture(scope="module", autouse=True)
def hooks() -> None:
    plugin.register()
    HookRegistry.apply_hooks()


def test_enable_warply_selects_the_warply_publisher() -> None:
    args = prepare_server_args(
        [
            "--model-path",
            "dummy",
            "--enable-warply",
            "--warply-router",
            "tcp://127.0.0.1:5599",
            "--warply-control",
            "tcp://127.0.0.1:5600",
            "--warply-worker",
            "w0",
        ]
    )
    config = json.loads(args.kv_events_config)
    assert config["publisher"] == settings_mod.PUBLISHER_NAME
    assert config["endpoint"] == "tcp://127.0.0.1:5599"
    settings = settings_mod.settings_of(args)
    assert settings is not None
    # The same setting names as the vLLM plugin's JSON keys (one plugin contract).
    assert settings == settings_mod.WarplySettings(
        events_endpoint="tcp://127.0.0.1:5599",
        control_endpoint="tcp://127.0.0.1:5600",
        replay_endpoint=None,
        worker="w0",
        model="dummy",
    )
    assert isinstance(settings, PluginSettings)


def test_plain_sglang_is_unaffected() -> None:
    args = prepare_server_args(["--model-path", "dummy"])
    assert args.kv_events_config is None
    assert settings_mod.settings_of(args) is None


@pytest.mark.parametrize(
    "bad", ["127.0.0.1:5599", "tcp://127.0.0.1", "tcp://h:99999", "http://h:1"]
)
def test_bad_router_is_a_one_line_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        prepare_server_args(["--model-path", "dummy", "--enable-warply", "--warply-router", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --warply-router" in err and "Traceback" not in err


def test_enable_warply_needs_a_router() -> None:
    with pytest.raises(SystemExit, match="--warply-router"):
        prepare_server_args(["--model-path", "dummy", "--enable-warply"])


def test_warply_endpoints_without_enable_warply_are_refused() -> None:
    """The plugin stayed off without a word when --enable-warply was forgotten."""
    router = ["--warply-router", "tcp://127.0.0.1:1", "--warply-replay", "tcp://127.0.0.1:2"]
    with pytest.raises(SystemExit, match="--warply-router, --warply-replay given without"):
        prepare_server_args(["--model-path", "dummy", *router])


def test_conflicting_kv_events_config_is_refused() -> None:
    with pytest.raises(SystemExit, match="kv-events-config"):
        prepare_server_args(
            [
                "--model-path",
                "dummy",
                "--enable-warply",
                "--warply-router",
                "tcp://127.0.0.1:1",
                "--kv-events-config",
                '{"publisher": "zmq"}',
            ]
        )
