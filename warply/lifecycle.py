"""Running a deployment on this host: `up` starts its plan (tier services, the router, the
engines), waits for each to answer with progress lines, and on any failure stops everything it
started and raises `UpError` naming the component with its last log lines. `Running.stop` and
`down` end each process group by the PID that was started; `state.json` in the run folder lets
another process (`warply down`) do it. Every process's log stays in the run folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml  # type: ignore[import-untyped]

from warply.admin import call
from warply.common.files import PRIVATE_DIR, write_private
from warply.launch import EngineProcess, http_json
from warply.plan import Binaries, Plan, PlanError, ProcessPlan, check_devices, make_plan
from warply.protocol.api import Where
from warply.protocol.plugin import CONTROL_TOKEN_ENV, CONTROL_TOKEN_MIN_CHARS
from warply.spec.deployment import Deployment, DisaggEngine

if TYPE_CHECKING:
    import openai

    from warply.stats import CacheStatsView

Progress = Callable[[str], None]
_Started = tuple[ProcessPlan, EngineProcess]
_REPO = Path(__file__).resolve().parents[1]
_LOG_LINES = 25
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b[:,]|error: ")


class UpError(RuntimeError):
    """A deployment that did not come up; the message names the component and shows its log's
    last lines. Everything `up` had started is stopped before it is raised."""


def runs_home() -> Path:
    """Where run folders and the `current` pointer live (`$WARPLY_HOME/runs`)."""
    home = os.environ.get("WARPLY_HOME") or Path.home() / ".cache" / "warply"
    return Path(home) / "runs"


def _stderr(msg: str) -> None:
    print(f"[warply] {msg}", file=sys.stderr, flush=True)


class Running:
    """A deployment that is up: its router's URL and admin token, its processes, its logs."""

    def __init__(
        self, spec: Deployment, run_dir: Path, plan: Plan, started: Sequence[_Started]
    ) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.url = plan.router.url
        self.token = plan.token
        self.processes = {p.name: proc for p, proc in started}
        """Component name → its process (a service found already running is not here)."""
        self.stopped = False

    @property
    def pids(self) -> dict[str, int]:
        """Each component's process-group leader (its group holds its children)."""
        return {name: proc.pid for name, proc in self.processes.items()}

    def client(self, **options: Any) -> openai.OpenAI:
        """An OpenAI client at the router (`model=` the spec's served name, "warply")."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.token, **options)

    def async_client(self, **options: Any) -> openai.AsyncOpenAI:
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.token, **options)

    def cache_stats(self) -> CacheStatsView:
        """The router's `/warply/cache_stats`, typed (`warply.stats.CacheStatsView`)."""
        from warply.stats import fetch_cache_stats

        return fetch_cache_stats(self.url, self.token)

    def where(self, prompt: str | list[dict[str, Any]], *, cache_key: str | None = None) -> Where:
        """Which workers hold how much of `prompt` (text, or chat messages) on which tier, and
        what the router would choose and why (each strategy's score per candidate); nothing is
        booked."""
        body: dict[str, Any] = (
            {"prompt": prompt} if isinstance(prompt, str) else {"messages": prompt}
        )
        if cache_key is not None:
            body["warply"] = {"cache_key": cache_key}
        return call(self.url, "/warply/where", Where, body, token=self.token)

    def stop(self) -> None:
        """Stop every process (engines first, services last); idempotent."""
        if self.stopped:
            return
        for proc in reversed(list(self.processes.values())):
            proc.stop()
        self.stopped = True
        _forget(self.run_dir)


def up(
    spec: Deployment,
    *,
    run_dir: str | os.PathLike[str] | None = None,
    vllm: str | None = None,
    sglang_python: str | None = None,
    router_python: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600,
    progress: Progress | None = _stderr,
) -> Running:
    """Start `spec` on this host and wait until the router sees every engine healthy.

    `vllm` (else `$WARPLY_VLLM`, else the first of the project's `.venvs/{vllm,lmcache}`, this
    Python's folder and PATH whose Python has the modules the spec needs), `sglang_python` and
    `router_python` pick the programs; `env` is added to every process's environment."""
    say = progress or (lambda _: None)
    extra_env = dict(env or {})
    run_dir = Path(run_dir or runs_home() / time.strftime(f"%Y%m%d-%H%M%S-{os.getpid()}"))
    try:
        run_dir.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    except OSError as exc:
        raise UpError(f"cannot make the run folder {run_dir}: {exc.strerror}") from None
    try:
        control_token = _control_token(spec, extra_env)
        gpus = _gpu_count(spec)
        check_devices(spec, gpus)
        bins = _binaries(spec, vllm, sglang_python, router_python, extra_env)
        plan = _signed(make_plan(spec, bins, run_dir, gpus=gpus), control_token)
    except PlanError as exc:
        raise UpError(str(exc)) from None
    for name, text in plan.files.items():
        write_private(run_dir / name, text)
    write_private(run_dir / "router.yaml", yaml.safe_dump(plan.router_config, sort_keys=False))
    say(f"run folder {run_dir} (one log per process)")
    started: list[_Started] = []
    try:
        for group in (plan.services, [plan.router], plan.engines):
            for p in group:
                if p.kind == "redis" and _redis_ping(p.url):
                    say(f"{p.name}: {p.url} already answers; using it")
                    continue
                q = p.with_env(extra_env)
                proc = EngineProcess(q.argv, url=q.url, log_path=run_dir / f"{p.name}.log",
                                     env=q.env, cpus=q.cpus).start()  # fmt: skip
                started.append((p, proc))
                _write_state(run_dir, plan, started)
                say(f"started {p.name} (pid {proc.pid})")
            _wait_ready(started, timeout_s, say)
        _wait_workers(plan, started, timeout_s, say)
    except BaseException:
        for _, proc in reversed(started):
            proc.stop()
        _forget(run_dir)
        raise
    say(f"up: router {plan.router.url}, model {spec.served_name!r}")
    return Running(spec, run_dir, plan, started)


def _control_token(spec: Deployment, env: Mapping[str, str]) -> str:
    """The one control token of a deployment's router and engines: the `WARPLY_CONTROL_TOKEN`
    that `env` or a pool's `env` gives, else a fresh one (PlanError when a given one is too
    short for the plugins and the router)."""
    pools = [p.env[CONTROL_TOKEN_ENV] for p in spec.pools.values() if CONTROL_TOKEN_ENV in p.env]
    token = env.get(CONTROL_TOKEN_ENV) or next(iter(pools), "")
    if token and len(token) < CONTROL_TOKEN_MIN_CHARS:
        raise PlanError(
            f"{CONTROL_TOKEN_ENV} has {len(token)} characters; the router and the engines' "
            f"plugins take a control token of at least {CONTROL_TOKEN_MIN_CHARS}"
        )
    return token or secrets.token_hex(16)  # 16 random bytes, as the admin token


def _signed(plan: Plan, token: str) -> Plan:
    """`plan` with the router signing its directives with `token` and the engines' plugins
    applying only directives so signed (`warply.protocol.control`): in the router's config file
    and the engines' environment, on no command line."""
    return dataclasses.replace(
        plan,
        router_config={**plan.router_config, "control_token": token},
        engines=[p.with_env({CONTROL_TOKEN_ENV: token}) for p in plan.engines],
    )


def _fail(p: ProcessPlan, proc: EngineProcess, what: str) -> UpError:
    """The error for a failed component: its log's last lines, and before them the error lines
    further up (an engine's root cause often precedes a long traceback of its shutdown)."""
    tail = proc.log_tail(_LOG_LINES)
    seen = [line for line in proc.log_tail(400).splitlines()
            if _ERROR_LINE.search(line) and line not in tail]  # fmt: skip
    errors = "".join(f"  {line.strip()[:300]}\n" for line in dict.fromkeys(seen[-3:]))
    return UpError(
        f"{p.kind} {p.name!r} {what}\n"
        + (f"errors in its log:\n{errors}" if errors else "")
        + f"its log {proc.log_path} ends:\n{tail}"
    )


def _ready(p: ProcessPlan) -> bool:
    if p.kind == "redis":
        return _redis_ping(p.url)
    try:
        return http_json("GET", p.url + p.health, timeout=2)[0] == 200
    except OSError:
        return False


def _check_alive(started: Sequence[_Started], t0: float) -> None:
    for p, proc in started:
        assert proc.proc is not None
        code = proc.proc.poll()
        if code is not None:
            raise _fail(p, proc, f"exited with code {code} after {time.monotonic() - t0:.0f}s")


def _wait_ready(
    started: list[_Started], timeout_s: float, say: Progress
) -> None:
    """Until every started process answers its health check; raises on an exit or timeout."""
    t0 = time.monotonic()
    pending = [(p, proc) for p, proc in started if p.kind != "router" and not _ready(p)]
    last = t0
    while pending:
        _check_alive(started, t0)
        for item in list(pending):
            if _ready(item[0]):
                pending.remove(item)
                say(f"{item[0].name} ready after {time.monotonic() - item[1].started_at:.0f}s")
        now = time.monotonic()
        if pending and now - t0 > timeout_s:
            p, proc = pending[0]
            raise _fail(p, proc, f"not ready after {timeout_s:.0f}s")
        if pending and now - last >= 15:
            last = now
            say(f"waiting for {', '.join(p.name for p, _ in pending)} ({now - t0:.0f}s)")
        time.sleep(0.5)


def _wait_workers(
    plan: Plan, started: list[_Started], timeout_s: float, say: Progress
) -> None:
    """Until the router answers and counts every engine healthy."""
    t0 = time.monotonic()
    want = len(plan.engines)
    router = next(proc for p, proc in started if p.kind == "router")
    while True:
        _check_alive(started, t0)
        try:
            status, body = http_json("GET", plan.router.url + "/health", timeout=2)
        except OSError:
            status, body = 0, {}
        if status == 200 and isinstance(body, dict) and body.get("healthy_workers") == want:
            say(f"router sees {want} healthy engine(s)")
            return
        if time.monotonic() - t0 > timeout_s:
            raise _fail(plan.router, router, f"does not see {want} healthy engines")
        time.sleep(0.5)


def _redis_ping(url: str) -> bool:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


# -- programs --------------------------------------------------------------------------------


def _needs(spec: Deployment) -> list[str]:
    """Modules the engine's Python must have for this spec."""
    if spec.backend == "sglang":
        return ["sglang"]
    mods = ["vllm"]
    if isinstance(spec, DisaggEngine):
        mods.append("nixl")
    tier = spec.tier
    if tier is not None and tier.l2 is not None:
        mods.append("lmcache" if tier.chosen_backend == "lmcache" else "mooncake")
    return mods


def missing_modules(python: str, modules: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Which of `modules` `python` cannot import (all of them if it does not run)."""
    code = ("import importlib.util as u, sys; "
            "print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))")  # fmt: skip
    try:
        out = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True,
                             timeout=60, env={**os.environ, **env})  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return list(modules)
    return out.stdout.split() if out.returncode == 0 else list(modules)


def _binaries(
    spec: Deployment,
    vllm: str | None,
    sglang_python: str | None,
    router_python: str | None,
    env: Mapping[str, str],
) -> Binaries:
    router = router_python or sys.executable
    if lacking := missing_modules(router, ["router", "aiohttp"], env):
        raise PlanError(f"the router's Python {router} cannot import {', '.join(lacking)}")
    needs = _needs(spec)
    if spec.backend == "sglang":
        python = sglang_python or os.environ.get("WARPLY_SGLANG_PYTHON") or str(
            _REPO / ".venvs" / "sglang" / "bin" / "python")
        if lacking := missing_modules(python, needs, env):
            raise PlanError(f"SGLang's Python {python} cannot import {', '.join(lacking)}")
        return Binaries(sglang_python=python, router_python=router)
    chosen = vllm or os.environ.get("WARPLY_VLLM")
    candidates = [chosen] if chosen else _vllm_candidates()
    tried = []
    for cand in candidates:
        lacking = missing_modules(str(Path(cand).parent / "python"), needs, env)
        if not lacking:
            return Binaries(vllm=cand, router_python=router)
        tried.append(f"{cand} lacks {', '.join(lacking)}")
    raise PlanError(
        f"no vLLM environment has what this spec needs ({', '.join(needs)}): "
        + ("; ".join(tried) or "no `vllm` found")
        + " (pass vllm=PATH or set WARPLY_VLLM)"
    )


def _vllm_candidates() -> list[str]:
    found = [
        _REPO / ".venvs" / "vllm" / "bin" / "vllm",
        _REPO / ".venvs" / "lmcache" / "bin" / "vllm",
        Path(sys.executable).parent / "vllm",
    ]
    on_path = shutil.which("vllm")
    out: list[str] = []
    for path in [*found, *([Path(on_path)] if on_path else [])]:
        if path.is_file() and str(path) not in out:
            out.append(str(path))
    return out


def _gpu_count(spec: Deployment) -> int:
    if all(p.device == "cpu" for p in spec.pools.values()):
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


# -- state file and `down` ------------------------------------------------------------------------


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def _write_state(
    run_dir: Path, plan: Plan, started: Sequence[_Started]
) -> None:
    state = {
        "router": plan.router.url,
        "token": plan.token,
        "processes": [{"name": p.name, "pid": proc.pid, "start": _start_ticks(proc.pid)}
                      for p, proc in started],
    }  # fmt: skip
    write_private(run_dir / "state.json", json.dumps(state, indent=1))
    home = runs_home()
    home.mkdir(parents=True, exist_ok=True)
    (home / "current").write_text(str(run_dir))


def _forget(run_dir: Path) -> None:
    """The run is over: no state file, and `current` no longer points at it."""
    (run_dir / "state.json").unlink(missing_ok=True)
    current = runs_home() / "current"
    try:
        if current.read_text().strip() == str(run_dir):
            current.unlink()
    except OSError:
        pass


def current_run() -> Path | None:
    """The run folder of the latest `up` that is still up (None: none)."""
    try:
        path = Path((runs_home() / "current").read_text().strip())
    except OSError:
        return None
    return path if (path / "state.json").is_file() else None


def down(
    run_dir: str | os.PathLike[str] | None = None, progress: Progress | None = _stderr
) -> list[str]:
    """Stop every process of a run started by another process (`warply up`): each process
    group, by the PID in its state file, if that PID is still the process that was started.
    Returns the names stopped; raises FileNotFoundError when there is no such run."""
    say = progress or (lambda _: None)
    run_dir = Path(run_dir) if run_dir is not None else current_run()
    if run_dir is None or not (run_dir / "state.json").is_file():
        raise FileNotFoundError(f"no running deployment{f' in {run_dir}' if run_dir else ''}")
    state = json.loads((run_dir / "state.json").read_text())
    stopped = []
    for entry in reversed(state["processes"]):
        pid = int(entry["pid"])
        if _start_ticks(pid) == entry["start"] or group_members(pid):
            _stop_group(pid)
            stopped.append(str(entry["name"]))
            say(f"stopped {entry['name']} (pid {pid})")
    _forget(run_dir)
    return stopped


def _stop_group(pgid: int) -> None:
    """SIGINT, then SIGTERM, then SIGKILL to the group until none of it is left."""
    for sig, wait_s in ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not group_members(pgid):
                return
            time.sleep(0.2)
