"""warply/launch.py without an engine: `VllmServer` reads an engine's counters from its Prometheus
text (here prometheus_client's own exporter on 127.0.0.1, the library vLLM serves /metrics with,
over a registry holding vLLM's metric names); `KvEvents` gives the engine and the router the
same stream, and `kv_event_engines` one stream per engine. Against real engines: tests/vllm/,
tests/lmcache/."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from router.config import WorkerConfig
from warply.launch import HOST, EngineProcess, KvEvents, VllmServer, free_port, kv_event_engines


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[VllmServer]:
    registry = CollectorRegistry()
    by_source = Counter("vllm:prompt_tokens_cached_by_source", "cached prompt tokens",
                        ["engine", "source"], registry=registry)  # fmt: skip
    by_source.labels("0", "local").inc(100)
    by_source.labels("0", "p2p").inc(512)
    by_source.labels("1", "local").inc(28)
    hits = Counter("vllm:prefix_cache_hits", "prefix cache hits", ["engine"], registry=registry)
    hits.labels("0").inc(3)
    hits.labels("1").inc(4)
    port = free_port()
    server, thread = start_http_server(port, addr=HOST, registry=registry)
    try:
        yield VllmServer("vllm", "m", log_path=tmp_path / "engine.log", port=port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_cached_tokens_are_summed_per_source(engine: VllmServer) -> None:
    assert engine.cached_by_source() == {"local": 128, "p2p": 512}


def test_named_samples_are_summed_over_label_sets(engine: VllmServer) -> None:
    got = engine.metrics("vllm:prefix_cache_hits_total", "vllm:absent_total")
    assert got == {"vllm:prefix_cache_hits_total": 7.0, "vllm:absent_total": 0.0}
    assert engine.metric("vllm:prefix_cache_hits_total") == 7.0


def test_the_router_subscribes_where_the_engine_publishes_its_kv_events() -> None:
    events = KvEvents()
    engine = events.engine_config()
    worker = WorkerConfig.model_validate(events.worker("w0", "http://127.0.0.1:1"))
    assert engine["endpoint"] == f"tcp://*:{events.pub}" and not worker.bind
    assert (worker.events, worker.replay) == (
        f"tcp://{HOST}:{events.pub}", engine["replay_endpoint"]
    )  # fmt: skip
    assert worker.topic == engine["topic"] and engine["publisher"] == "zmq"
    assert events.pub != events.replay != KvEvents().pub


def test_kv_event_engines_each_publish_on_their_own_ports_and_core(tmp_path: Path) -> None:
    pairs = kv_event_engines("vllm", "m", tmp_path, count=3, args=["--seed", "0"])
    assert [e.log_path for e, _ in pairs] == [tmp_path / f"vllm-{i}.log" for i in range(3)]
    assert [e._env["VLLM_CPU_OMP_THREADS_BIND"] for e, _ in pairs] == ["0", "1", "2"]
    assert [e.cpus for e, _ in pairs] == [{i} & os.sched_getaffinity(0) for i in range(3)]
    for engine, events in pairs:
        flag = engine.cmd.index("--kv-events-config")
        assert json.loads(engine.cmd[flag + 1]) == events.engine_config()
        assert "--seed" in engine.cmd
    assert len({p for _, ev in pairs for p in (ev.pub, ev.replay)}) == 6


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to confine to one")
def test_a_confined_process_and_what_it_starts_run_on_its_cores_only(tmp_path: Path) -> None:
    """`cpus`: the process and a child it starts later report one allowed core; cores this
    machine does not give us are dropped (none left: not confined)."""
    core = min(os.sched_getaffinity(0))
    child = "import os; print(sorted(os.sched_getaffinity(0)))"
    script = (
        "import os, subprocess, sys, time; time.sleep(0.5); "
        f"print(sorted(os.sched_getaffinity(0))); subprocess.run([sys.executable, '-c', {child!r}])"
    )
    proc = EngineProcess([sys.executable, "-c", script], url="", log_path=tmp_path / "p.log",
                         cpus={core, 100_000})  # fmt: skip
    assert proc.cpus == {core}
    with proc.start():
        assert proc.wait_exit(30) == 0
    assert proc.log_path.read_text().split() == [f"[{core}]", f"[{core}]"]
    unknown = EngineProcess(["true"], url="", log_path=tmp_path / "q.log", cpus={100_000})
    assert unknown.cpus == set()


def test_a_terminated_program_stops_the_processes_it_started(tmp_path: Path) -> None:
    """`exit_on_termination`: SIGTERM to a program that started a process ends the program
    through its `with` block (exit code 143), and that process is stopped, not left running."""
    program = tmp_path / "program.py"
    program.write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "from warply.launch import EngineProcess, exit_on_termination\n"
        "exit_on_termination()\n"
        f"with EngineProcess(['sleep', '600'], url='', log_path=Path({str(tmp_path)!r}) / 's.log')"
        " as p:\n"
        "    print(p.pid, flush=True)\n"
        "    p.proc.wait()\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root}
    with subprocess.Popen([sys.executable, str(program)], stdout=subprocess.PIPE, env=env,
                          text=True) as proc:  # fmt: skip
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        os.kill(child, 0)  # running
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
