"""`up()` failing and the CLI's `warply up` / `warply down`, on real `vllm serve` processes.

A deliberately broken engine argument: `up()` raises `UpError` as soon as the engine exits
(not at a timeout), naming the engine and showing its log's end, and every process it had
started (router included) is gone. Then `warply up SPEC.yaml` leaves an aggregated deployment
running after it exits, its engine's processes all stay on the engine's core, a request
through the router answers, and `warply down` stops every process group of the run. And a
program terminated (SIGTERM) inside `with spec.up(...)` takes its deployment down with it.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import yaml
from conftest import send_directive
from processes import alive

import warply as wp
from warply.lifecycle import group_members
from warply.protocol import Directive

pytestmark = pytest.mark.timeout(600)

VLLM = str(Path(sys.executable).parent / "vllm")


def test_a_broken_engine_argument_fails_fast_and_leaves_nothing(
    tiny_model: str, tmp_path: Path
) -> None:
    spec = wp.Engine(model=tiny_model, pool=wp.Pool("cpu", engine_args=["--no-such-flag", "1"]))
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(wp.UpError) as err:
        spec.up(run_dir=tmp_path / "run", vllm=VLLM, progress=lines.append)
    print(f"up() failed after {time.monotonic() - t0:.1f}s:\n{err.value}")
    message = str(err.value)
    assert message.startswith("engine 'engine-0' exited with code")
    assert "unrecognized arguments: --no-such-flag" in message
    assert str(tmp_path / "run" / "engine-0.log") in message
    started = {line.split()[1]: int(line.rsplit("pid ", 1)[1].rstrip(")"))
               for line in lines if line.startswith("started ")}  # fmt: skip
    assert set(started) == {"router", "engine-0"}
    assert [p for p in started.values() if alive(p) or group_members(p)] == []
    with pytest.raises(RuntimeError, match="not up"):
        spec.client()


def _warply(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "warply", *args], capture_output=True,
                          text=True, timeout=500)  # fmt: skip


def test_cli_up_leaves_it_running_and_down_stops_it(tiny_model: str, tmp_path: Path) -> None:
    spec = wp.Engine(model=tiny_model, pool=wp.Pool("cpu", engine_args=["--max-model-len", "1024"]),
                     routing=wp.CacheRouting(strategy="least_loaded"))  # fmt: skip
    path = tmp_path / "spec.yaml"
    path.write_text(spec.model_dump_yaml())
    run = tmp_path / "run"
    up = _warply("up", str(path), "--vllm", VLLM, "--run-dir", str(run))
    assert up.returncode == 0, up.stderr
    state = json.loads((run / "state.json").read_text())
    pids = {p["name"]: p["pid"] for p in state["processes"]}
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (run, run / "router.yaml",
                                                             run / "state.json")}  # fmt: skip
    assert modes == {"run": 0o700, "router.yaml": 0o600, "state.json": 0o600}  # the tokens
    try:
        assert set(pids) == {"router", "engine-0"}
        assert all(alive(pid) for pid in pids.values())  # `warply up` has exited
        url = up.stdout.split("router:", 1)[1].split()[0]
        body = json.dumps({"model": "warply", "prompt": "hello", "max_tokens": 2}).encode()
        req = urllib.request.Request(url + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert json.loads(resp.read())["usage"]["prompt_tokens"] > 0
        control = yaml.safe_load((run / "router.yaml").read_text())["pools"][0]["workers"][0]
        pin = {"id": "p", "kind": "pin", "token_ids": list(range(64)), "ttl_s": 1}
        unsigned = send_directive(control["control"], msgspec.convert(pin, Directive))
        assert unsigned.reason.startswith("unauthenticated"), unsigned  # `up` set a token
        admin = {"Authorization": f"Bearer {state['token']}", "Content-Type": "application/json"}
        req = urllib.request.Request(
            url.removesuffix("/v1") + "/warply/directives", headers=admin,
            data=json.dumps({"worker": "engine-0", "directive": pin}).encode(),
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:
            signed = json.loads(resp.read())
        assert not signed["reason"].startswith("unauthenticated"), signed  # the router signs
        members = {m for pid in pids.values() for m in group_members(pid)}
        if {0, 1} <= os.sched_getaffinity(0):  # the plan gives engine-0 core 0
            assert {frozenset(_cores(m)) for m in group_members(pids["engine-0"])} - {
                frozenset()} == {frozenset({0})}  # fmt: skip
            assert _cores(pids["router"]) == os.sched_getaffinity(0)
        down = _warply("down", "--run-dir", str(run))
        assert down.returncode == 0, down.stderr
        assert "stopped 2 process group(s)" in down.stdout
    finally:
        if (run / "state.json").exists():
            _warply("down", "--run-dir", str(run))
    assert [p for p in members if alive(p)] == []
    again = _warply("down", "--run-dir", str(run))
    assert again.returncode == 1 and "no running deployment" in again.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Engine\nmodel: /no/such/model\n")
    refused = _warply("up", str(bad))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "model: model '/no/such/model': no such folder" in refused.stderr


def _cores(pid: int) -> set[int]:
    """The cores `pid` may run on; empty when it has exited since it was listed."""
    try:
        return os.sched_getaffinity(pid)
    except ProcessLookupError:
        return set()


def test_a_terminated_program_takes_its_deployment_down(tiny_model: str, tmp_path: Path) -> None:
    """SIGTERM to a program inside `with spec.up(...)` (its signals left at their default) ends
    it through the `with` block: exit 143, and every process group of the run is gone."""
    program = tmp_path / "program.py"
    program.write_text(
        "import time\n"
        "from pathlib import Path\n"
        "import warply as wp\n"
        f"spec = wp.Engine(model={tiny_model!r}, pool=wp.Pool('cpu', engine_args="
        "['--max-model-len', '1024']))\n"
        f"with spec.up(run_dir=Path({str(tmp_path / 'run')!r}), vllm={VLLM!r}, progress=None):\n"
        "    print(*spec.running.pids.values(), flush=True)\n"
        "    time.sleep(600)\n"
    )
    with subprocess.Popen([sys.executable, str(program)], stdout=subprocess.PIPE,
                          text=True) as proc:  # fmt: skip
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)  # the router and engine-0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert [p for p in pids if alive(p) or group_members(p)] == []
