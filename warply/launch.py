"""Engine processes (and the shared index store's server, simulated workers, and the router)
started by Warply (demo, benchmarks, tests): start, wait healthy, stop.

Engines run as child processes in their own session, so `stop()` can end the whole process
group (vLLM's API server plus its EngineCore children) by the PID we started. Nothing here
imports an engine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from warply.common.files import write_private

if TYPE_CHECKING:
    from prometheus_client.samples import Sample

HOST = "127.0.0.1"

# vLLM 0.32 on CPU: without VLLM_CPU_KVCACHE_SPACE the KV cache takes 0.9x RAM; two instances
# must bind different cores (both default to core 0). No hub access exists here.
VLLM_CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": HOST,
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


_GIVEN: set[int] = set()
"""Ports `free_port` handed out in this process (never handed out twice)."""


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (Linux: ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now. Taken below the kernel's ephemeral range:
    outgoing connections get their ports from that range, so one of them could take a port
    handed out here before its server binds it (seen as "Address already in use" at start-up)."""
    low = _ephemeral_low()
    for _ in range(500):
        port = random.randrange(20000, low) if low > 21000 else 0
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _GIVEN.add(port)
        return port
    raise OSError("no free TCP port on 127.0.0.1")


_TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def exit_on_termination() -> Callable[[], None]:
    """SIGTERM and SIGHUP end this program as Ctrl-C would, by raising `SystemExit` (exit code
    128 + the signal) in its main thread, so the `finally` blocks, context managers and `atexit`
    hooks that stop the processes it started still run. Without it `timeout`, a cancelled CI
    job or a closed terminal ends the program at once and leaves its engines and servers
    running. Only signals still at their default action are taken (a program's own handlers,
    and `nohup`'s ignored SIGHUP, stay), and only from the main thread (the only one that may
    set handlers). Returns what puts back the handlers it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    taken = [sig for sig in _TERMINATING if signal.getsignal(sig) == signal.SIG_DFL]
    for sig in taken:
        signal.signal(sig, _exit_for_signal)

    def restore() -> None:
        for sig in taken:
            if signal.getsignal(sig) is _exit_for_signal:
                signal.signal(sig, signal.SIG_DFL)

    return restore


def _exit_for_signal(signum: int, frame: object) -> None:
    signal.signal(signum, signal.SIG_IGN)  # a second one must not interrupt the clean-up
    raise SystemExit(128 + signum)


def http_json(method: str, url: str, body: Any = None, timeout: float = 120) -> tuple[int, Any]:
    """One HTTP request with a JSON body; returns (status, parsed JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class EngineProcess:
    """One engine server process with its log file; a context manager that always stops it."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        url: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cpus: Collection[int] = (),
    ) -> None:
        self.cmd = list(cmd)
        self.url = url
        self.log_path = log_path
        self.cpus = set(cpus) & os.sched_getaffinity(0)
        """Cores the process (and all it starts) is confined to: those of `cpus` this process
        may use; none (no confinement) when that leaves none."""
        # unbuffered: the last lines of a process that is killed are the ones worth reading
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log: IO[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> EngineProcess:
        """Launch the process (in its own session, so its children share its process group)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self._env,
            start_new_session=True,
        )
        if self.cpus:
            # set as soon as the process exists: vLLM starts its engine core, workers and
            # their threads seconds later, and they inherit it
            os.sched_setaffinity(self.proc.pid, self.cpus)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def wait_healthy(self, timeout_s: float = 240, path: str = "/health") -> float:
        """Poll `path` until it answers 200; returns seconds since start (raises with the log)."""
        assert self.proc is not None, "not started"
        while time.monotonic() - self.started_at < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.cmd[0]} exited with {self.proc.returncode}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if http_json("GET", self.url + path, timeout=2)[0] == 200:
                    return time.monotonic() - self.started_at
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(
            f"not healthy after {timeout_s:.0f}s; log {self.log_path}:\n{self.log_tail()}"
        )

    def wait_exit(self, timeout_s: float) -> int | None:
        """For a process expected to fail: its exit code, or None if still up (then stopped)."""
        assert self.proc is not None, "not started"
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.stop()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGINT, then SIGTERM, then SIGKILL to the process group we started; closes the log."""
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.pid, sig)
                    self.proc.wait(timeout=wait_s)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.proc is not None:
            try:  # children outliving the leader (EngineCore) share its group
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> EngineProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class KvEvents:
    """A vLLM engine's stock KV-event stream (`--kv-events-config`: ZMQ PUB and its replay
    socket, topic `kv`) on two free loopback ports, as the engine and the router each write it."""

    pub: int = field(default_factory=free_port)
    replay: int = field(default_factory=free_port)

    def engine_config(self) -> dict[str, Any]:
        """The engine's `kv_events_config`."""
        return {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{self.pub}",
                "replay_endpoint": f"tcp://{HOST}:{self.replay}", "topic": "kv"}  # fmt: skip

    def worker(self, name: str, url: str) -> dict[str, Any]:
        """The router's worker entry for the engine at `url`."""
        return {"name": name, "url": url, "events": f"tcp://{HOST}:{self.pub}",
                "replay": f"tcp://{HOST}:{self.replay}", "topic": "kv"}  # fmt: skip


class VllmServer(EngineProcess):
    """A `vllm serve` process for the CPU build, bound to 127.0.0.1 (call `start()`)."""

    def __init__(
        self,
        vllm_bin: str | Path,
        model: str | Path,
        *,
        log_path: Path,
        port: int | None = None,
        served_name: str = "tiny",
        args: Sequence[str] = (),
        kv_transfer_config: Mapping[str, Any] | None = None,
        kv_events_config: Mapping[str, Any] | None = None,
        cpu_core: int = 0,
        env: Mapping[str, str] | None = None,
        confined: bool = False,
    ) -> None:
        """`cpu_core`: where its OpenMP threads bind; `confined`: the whole process (API server,
        NIXL threads, all it starts) stays on that core too."""
        self.port = port or free_port()
        self.served_name = served_name
        cmd = [
            str(vllm_bin),
            "serve",
            str(model),
            "--served-model-name",
            served_name,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--enforce-eager",
            *args,
        ]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if kv_events_config is not None:
            cmd += ["--kv-events-config", json.dumps(kv_events_config)]
        full_env = {**VLLM_CPU_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(cpu_core), **(env or {})}
        super().__init__(
            cmd,
            url=f"http://{HOST}:{self.port}",
            log_path=log_path,
            env=full_env,
            cpus={cpu_core} if confined else (),
        )

    def completion(self, prompt: str | list[int], **fields: Any) -> dict[str, Any]:
        """POST /v1/completions for the served model; raises with the body on an error status."""
        status, body = http_json(
            "POST",
            self.url + "/v1/completions",
            {"model": self.served_name, "prompt": prompt, **fields},
        )
        if status != 200:
            raise RuntimeError(f"/v1/completions answered {status}: {body}")
        return dict(body)

    def metrics(self, *names: str) -> dict[str, float]:
        """Each named Prometheus sample (e.g. `vllm:prefix_cache_hits_total`) summed over its
        label sets, from one /metrics fetch (0 if absent)."""
        out = dict.fromkeys(names, 0.0)
        for sample in self._samples():
            if sample.name in out:
                out[sample.name] += sample.value
        return out

    def cached_by_source(self) -> Counter[str]:
        """Prompt tokens the engine found cached, per source (`local`, `external`, `p2p`:
        `vllm:prompt_tokens_cached_by_source_total`), from one /metrics fetch."""
        out: Counter[str] = Counter()
        for sample in self._samples():
            if sample.name == "vllm:prompt_tokens_cached_by_source_total":
                out[sample.labels["source"]] += int(sample.value)
        return out

    def _samples(self) -> Iterator[Sample]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            yield from family.samples

    def metric(self, name: str) -> float:
        """One sample summed over its label sets (see `metrics`)."""
        return self.metrics(name)[name]


def sglang_router_cmd(python: str, port: int, workers: Sequence[str], *extra: str) -> list[str]:
    """sglang-router's command line (the benches' reference router, 0.3.2), `cache_aware` over
    `workers`, serving on 127.0.0.1:`port`, with its Prometheus exporter on 127.0.0.1 as well
    and on a port of its own: by default 0.3.2 binds that on 0.0.0.0:29000, beyond loopback,
    and a second one at once (or one left running) fails to start."""
    return [
        python, "-m", "sglang_router.launch_router", "--host", HOST, "--port", str(port),
        "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
        "--policy", "cache_aware", "--worker-urls", *workers, *extra,
    ]  # fmt: skip


def kv_event_engines(
    vllm_bin: str | Path,
    model: str | Path,
    log_dir: Path,
    *,
    count: int = 2,
    served_name: str = "tiny",
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> list[tuple[VllmServer, KvEvents]]:
    """`count` vLLM CPU engines (not started), engine i confined to core i with its log at
    `log_dir/vllm-i.log`, each publishing its stock KV-event stream on its own `KvEvents`
    ports (their `worker()` entries are the router's workers)."""
    engines = []
    for i in range(count):
        events = KvEvents()
        engine = VllmServer(
            vllm_bin, model, log_path=log_dir / f"vllm-{i}.log", served_name=served_name,
            args=args, kv_events_config=events.engine_config(), cpu_core=i, env=env,
            confined=True,
        )  # fmt: skip
        engines.append((engine, events))
    return engines


class RouterServer(EngineProcess):
    """`python -m router` (this interpreter) on `config`, which `start()` writes to
    `<workdir>/<name>.yaml`; its log is `<name>.log` beside it."""

    def __init__(
        self,
        config: Mapping[str, Any],
        workdir: Path,
        *,
        name: str = "router",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.config = dict(config)
        self.config_path = workdir / f"{name}.yaml"
        cmd = [sys.executable, "-m", "router", "--config", str(self.config_path)]
        url = f"http://{HOST}:{self.config['port']}"
        super().__init__(cmd, url=url, log_path=workdir / f"{name}.log", env=env)

    def start(self) -> RouterServer:
        import yaml  # type: ignore[import-untyped]

        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        write_private(self.config_path, yaml.safe_dump(self.config))  # it may hold the tokens
        super().start()
        return self


class RedisServer(EngineProcess):
    """A `redis-server` (or `valkey-server`) on 127.0.0.1 for the shared index store: nothing
    persisted (`--save '' --appendonly no`), no eviction of its own (the store's cap evicts)."""

    def __init__(
        self,
        *,
        log_path: Path,
        server_bin: str = "redis-server",
        port: int | None = None,
        maxmemory: str = "0",
    ) -> None:
        self.port = port or free_port()
        cmd = [
            server_bin,
            "--bind", HOST,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", maxmemory,
            "--maxmemory-policy", "noeviction",
        ]  # fmt: skip
        super().__init__(cmd, url=f"redis://{HOST}:{self.port}/0", log_path=log_path)

    def wait_ready(self, timeout_s: float = 20) -> float:
        """Send PING until the server answers PONG; returns seconds since start."""
        assert self.proc is not None, "not started"
        while time.monotonic() - self.started_at < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[0]} exited: {self.log_tail()}")
            try:
                with socket.create_connection((HOST, self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return time.monotonic() - self.started_at
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.cmd[0]} not ready after {timeout_s:.0f}s: {self.log_tail()}")


class SimWorkers(EngineProcess):
    """`python -m replay.serve`: simulated workers (a simulator, not an engine) in one process;
    `wait_ready` returns their router worker configs from the manifest it writes."""

    def __init__(
        self,
        python: str | Path,
        model: str,
        tokenizer: str | Path,
        *,
        workers: int,
        log_path: Path,
        args: Sequence[str] = (),
    ) -> None:
        self.manifest = log_path.with_suffix(".workers.json")
        cmd = [
            str(python), "-m", "replay.serve", "--model", model, "--tokenizer", str(tokenizer),
            "--workers", str(workers), "--manifest", str(self.manifest), *args,
        ]  # fmt: skip
        super().__init__(cmd, url="", log_path=log_path)

    def start(self) -> SimWorkers:
        self.manifest.unlink(missing_ok=True)
        super().start()
        return self

    def wait_ready(self, timeout_s: float = 120) -> list[dict[str, str]]:
        """Wait until every worker listens; their `{name, url, events, replay}` mappings."""
        assert self.proc is not None, "not started"
        while time.monotonic() - self.started_at < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replay.serve exited: {self.log_tail()}")
            if self.manifest.is_file():
                workers: list[dict[str, str]] = json.loads(self.manifest.read_text())["workers"]
                return workers
            time.sleep(0.1)
        raise TimeoutError(f"simulated workers not up after {timeout_s:.0f}s: {self.log_tail()}")
