"""`--kv-transfer-config '{"kv_connector": "warply"}'` (and the dotted
`--kv-transfer-config.kv_connector warply`) is a complete configuration: a real `vllm serve`
starts with the default endpoints, `warply watch` with no endpoint sees its blocks, and its
control socket answers a directive. The engines use the fixed default ports, so they run one
after the other; the test is skipped when another process holds one of those ports."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, complete, engine, send_directive, start_all

from vllm_connector.config import parse_config
from warply.protocol import Directive
from warply.protocol.endpoints import parse_endpoint
from warply.protocol.plugin import DEFAULT_ENDPOINTS, LOCAL_EVENTS_ENDPOINT

_PORTS = [parse_endpoint(str(e)).port for k, e in DEFAULT_ENDPOINTS.items()
          if k.endswith("_endpoint")]  # fmt: skip
_CONTROL = str(DEFAULT_ENDPOINTS["control_endpoint"])


def _taken(port: int | None) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port or 0))
        except OSError:
            return True
    return False


def test_defaults_apply_to_the_short_name_only() -> None:
    assert parse_config({}).warply.events_endpoint is None  # WarplyConnector: as before
    short = parse_config({}, defaults=True).warply
    assert {k: getattr(short, k) for k in DEFAULT_ENDPOINTS} == DEFAULT_ENDPOINTS
    assert short.events_bind  # loopback, yet bound: `warply watch` and a router connect to it
    mixed = parse_config(
        {"warply": {"events_endpoint": "tcp://*:6001", "control_endpoint": None}}, defaults=True
    ).warply
    assert mixed.events_endpoint == "tcp://*:6001"
    assert mixed.replay_endpoint == DEFAULT_ENDPOINTS["replay_endpoint"]
    assert mixed.control_endpoint is None  # an explicit null keeps it off


@pytest.mark.parametrize("spelling", ["json", "dotted"])
def test_short_name_is_a_complete_configuration(
    spelling: str, tiny_model: str, tmp_path: Path
) -> None:
    if any(_taken(p) for p in _PORTS):
        pytest.skip(f"a default port ({_PORTS}) is taken by another process on this host")
    if spelling == "json":
        server = engine(tiny_model, tmp_path / "vllm.log", kv_transfer={"kv_connector": "warply"})
    else:
        args = ["--kv-transfer-config.kv_connector", "warply"]
        server = engine(tiny_model, tmp_path / "vllm.log", extra_args=args)
    watch = subprocess.Popen(
        [sys.executable, "-m", "warply", "watch", "--duration", "300"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        start_all([server])
        prompt = list(range(100, 164))  # two full blocks of 32
        complete(server, prompt, max_tokens=2)
        stored = _first_stored(watch, deadline=time.monotonic() + 60)
        ack = send_directive(_CONTROL, Directive(id="pin-1", kind="pin", token_ids=prompt))
        assert (ack.applied, ack.blocks) == (True, 2), ack.reason
        assert send_directive(_CONTROL, Directive(id="unpin-1", kind="unpin", token_ids=prompt))
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=30)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        server.stop()
    assert stored["event"] == "BlockStored" and stored["token_ids"] == "<64 tokens>"
    assert watch.returncode == 0 and "Traceback" not in err, err
    summary = json.loads(out.splitlines()[-1])
    assert summary["event"] == "summary" and summary["counts"]["LoadSnapshot"] >= 1
    assert f"default endpoints, {LOCAL_EVENTS_ENDPOINT}" in _help()


def _first_stored(watch: subprocess.Popen[str], deadline: float) -> dict[str, Any]:
    """The first BlockStored line `warply watch` prints (its stdout read line by line)."""
    assert watch.stdout is not None
    while time.monotonic() < deadline:
        line = watch.stdout.readline()
        if not line:
            break
        event = json.loads(line)
        if event["event"] == "BlockStored":
            return dict(event)
    raise AssertionError("warply watch printed no BlockStored event")


def _help() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "warply", "watch", "--help"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return " ".join(out.stdout.split())
