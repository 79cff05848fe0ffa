"""Faults through `warply-router` in front of two real vLLM CPU engines (stock KV event streams).

One stack serves the module and the tests run in order, each leaving it as the next expects:

  1. the router restarted under load: every request is answered (the one in flight at the stop
     finishes in the router's drain), its index is rebuilt from the engines' replay buffers
     (the hit rate before and after is printed, the first requests after it hit);
  2. an engine that accepts connections but never answers (SIGSTOP): requests time out
     (504), its circuit breaker opens after `breaker.failures` of them, placement stops
     choosing it, and it is closed again once the engine answers (SIGCONT);
  3. an engine SIGKILLed with one stream started and one request queued: the stream ends
     with an error event, the queued request is answered by the other engine, the dead
     worker's index entries are dropped (`fallback`, worker_down);
  4. the engine restarted on the same ports: parity checked again, and a prompt its old
     process held is predicted cached nowhere (stale blocks attract nothing);
  5. zero lost requests: every request sent since the router restart is completed or failed
     with an error at the client, and the counts equal the router's `warply_router_requests`;
  6. a second router over a shared index (`index.store: redis`), stopped while an engine
     restarts: started again, it keeps what the other engine holds and drops what the
     restarted one's old process left;
  7. the router stopped with a stream open: after its drain the stream ends with a 503 error
     event, and the engine aborts the request.

~5 min on 2 cores shared with other jobs.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port

from warply.launch import KvEvents, RedisServer, RouterServer, VllmServer

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
VLLM_BIN = Path(sys.executable).parent / "vllm"
BLOCK = 32
IDLE_TIMEOUT_S = 10
BREAKER_FAILURES = 2
LEDGER: Counter[str] = Counter()
"""Client-side outcomes (`ok`, `failed`) of the requests sent to the current router process."""
_ROUTER = [0]
"""Which router process requests are sent to now (a request sent to an earlier one is not
counted: that process and its counters are gone)."""


def _record(sent_to: int, failed: bool) -> None:
    if sent_to == _ROUTER[0]:
        LEDGER["failed" if failed else "ok"] += 1


def _engine(model: str, logs: Path, i: int, events: KvEvents) -> VllmServer:
    return VllmServer(
        VLLM_BIN, model, log_path=logs / f"vllm{i}.log", served_name="tiny", cpu_core=i,
        args=["--block-size", str(BLOCK), "--max-model-len", "2048", "--max-num-seqs", "1",
              "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0"],
        kv_events_config=events.engine_config(),
    )  # fmt: skip


@pytest.fixture(scope="module")
def stack(tiny_model: str, server_logs: Path) -> Iterator[dict[str, Any]]:
    """Engines w0 (core 0) and w1 (core 1), max one sequence each (a second request waits in
    the engine's queue), and the router as a subprocess; all stopped by PID."""
    engines, workers = [], []
    for i in range(2):
        events = KvEvents()
        engines.append(_engine(tiny_model, server_logs, i, events))
        workers.append(events.worker(f"w{i}", engines[-1].url))
    port = free_port()
    config = {
        "model": "tiny",
        "tokenizer": tiny_model,
        "port": port,
        "strategy": {"name": "prefix_affinity"},
        "health_interval_s": 0.5,
        "health_timeout_s": 1,
        "unhealthy_after": 1000,  # a hung engine is taken out by its breaker, not its probe
        "upstream_idle_timeout_s": IDLE_TIMEOUT_S,
        "breaker": {"failures": BREAKER_FAILURES, "open_s": 4},
        "index": {"degraded_s": 2},
        "drain_timeout_s": 1,
        "pools": [{"name": "cpu", "block_size": BLOCK, "workers": workers}],
    }
    router = RouterServer(config, server_logs, name="faults-router", env={"PYTHONPATH": str(ROOT)})
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_healthy(240)
        router.start()
        router.wait_healthy(60)
        yield {"router": router, "url": router.url, "engines": engines, "logs": server_logs,
               "held": {}, "config": config}  # fmt: skip
    finally:
        router.stop()
        for e in engines:
            e.stop()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read()) if "json" in r.headers.get("Content-Type", "") else r.read()


def _workers(url: str) -> dict[str, dict[str, Any]]:
    return {w["name"]: w for w in _get(url + "/warply/workers")["workers"]}


def _holders(url: str, prompt: str) -> dict[str, int]:
    """Per worker, the prompt's tokens the router's index has it hold."""
    where = _get(url + "/warply/where?" + urllib.parse.urlencode({"prompt": prompt}))
    return {w["name"]: w["cached_tokens"] for pool in where["pools"] for w in pool["workers"]}


def _held(url: str, prompt: str) -> int:
    """The most of `prompt`'s tokens any worker holds, as the router's index has it."""
    return max(_holders(url, prompt).values())


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _complete(url: str, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
    """One non-streamed completion; its outcome goes to the ledger."""
    sent_to = _ROUTER[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
            _record(sent_to, failed=False)
            details = out["usage"].get("prompt_tokens_details") or {}
            return {"status": r.status, "worker": r.headers["X-Warply-Worker"],
                    "predicted": int(r.headers["X-Warply-Predicted-Cached"]),
                    "cached": details.get("cached_tokens", 0),
                    "prompt_tokens": out["usage"]["prompt_tokens"]}  # fmt: skip
    except urllib.error.HTTPError as err:
        _record(sent_to, failed=True)
        return {"status": err.code, "error": json.loads(err.read())["error"]}


def _stream(
    url: str,
    prompt: str,
    max_tokens: int,
    out: dict[str, Any],
    on_first: Callable[[], None] | None = None,
) -> None:
    """A streamed completion (ignore_eos): `out` gets status, worker and the events as they
    come (`on_first` runs in this thread as the first one arrives); its outcome goes to the
    ledger."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    out["events"] = []
    sent_to = _ROUTER[0]
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out["status"], out["worker"] = r.status, r.headers["X-Warply-Worker"]
            for line in r:
                if line.startswith(b"data: "):
                    if on_first is not None and not out["events"]:
                        on_first()
                    out["events"].append(line[6:].strip().decode())
    except urllib.error.HTTPError as err:
        out["status"], out["error"] = err.code, json.loads(err.read())["error"]
    failed = out["status"] != 200 or any('"error"' in e for e in out["events"])
    _record(sent_to, failed)
    out["done"] = True


def _prompt(n: int) -> str:
    return f"Conversation {n}: the router keeps prefix blocks of cache {n * 7} warm. " * 12


def _hit_rate(results: list[dict[str, Any]]) -> float:
    ok = [r for r in results if r["status"] == 200]
    return float(sum(r["cached"] for r in ok) / max(1, sum(r["prompt_tokens"] for r in ok)))


def test_router_restart_rebuilds_the_index_from_replay(stack: dict[str, Any]) -> None:
    url, router = stack["url"], stack["router"]
    for n in range(6):  # warm: each prompt once, then again (a hit on its worker)
        prompt = _prompt(n)
        first = _complete(url, prompt)
        assert first["status"] == 200, first
        # the engine publishes the prompt's blocks after its step; the repeat waits for them
        _wait(lambda p=prompt: _held(url, p) > 0, 30, "the prompt's blocks in the index")
        out = _complete(url, prompt)
        assert out["status"] == 200, out
        stack["held"][n] = out["worker"]
        assert out["predicted"] == out["cached"] > 0, out
    assert set(stack["held"].values()) == {"w0", "w1"}, stack["held"]

    results: list[tuple[str, float, dict[str, Any]]] = []
    stop = threading.Event()
    phase = ["before"]

    def load() -> None:  # one client resending the warm prompts, through the restart
        n = 0
        while not stop.is_set():
            try:
                out = _complete(url, _prompt(n % 6))
            except OSError:  # the router is down: nothing reached it
                time.sleep(0.05)
                continue
            results.append((phase[0], time.monotonic(), out))
            n += 1

    client = threading.Thread(target=load)
    client.start()
    try:
        _wait(lambda: len(results) >= 6, 120, "requests before the restart")
        router.stop()
        _ROUTER[0] += 1  # the new process counts from zero; so does the ledger
        LEDGER.clear()
        phase[0] = "after"
        restarted = time.monotonic()
        router.start()
        router.wait_healthy(60)
        _wait(lambda: sum(p == "after" for p, _, _ in results) >= 12, 120, "requests after")
    finally:
        stop.set()
        client.join(150)
    before = [r for p, _, r in results if p == "before"]
    after = [(t, r) for p, t, r in results if p == "after"]
    first_hit = next((t - restarted for t, r in after if r["predicted"] > 0), None)
    print(
        f"\nrouter restart: engine hit rate {_hit_rate(before):.3f} over {len(before)} requests "
        f"before, {_hit_rate([r for _, r in after[:6]]):.3f} over the first 6 after and "
        f"{_hit_rate([r for _, r in after]):.3f} over {len(after)}; first predicted hit "
        f"{first_hit:.2f} s after the new process started (its start-up included)"
        if first_hit is not None else "\nrouter restart: no predicted hit after the restart"
    )
    assert first_hit is not None
    assert all(r["predicted"] == r["cached"] for _, r in after), after  # the index is exact
    # the stop lost nothing: the request in flight finished (the drain), later ones found the
    # port closed and were sent again to the new process
    assert all(r["status"] == 200 for _, _, r in results), results


def _enable(url: str, worker: str, on: bool) -> None:
    body = json.dumps({"enabled": on}).encode()
    req = urllib.request.Request(
        url + f"/warply/workers/{worker}", data=body, headers={"Content-Type": "application/json"}
    )
    urllib.request.urlopen(req, timeout=10).close()


def test_a_hung_engine_times_out_and_its_breaker_opens(stack: dict[str, Any]) -> None:
    url, engines = stack["url"], stack["engines"]
    hung, trial = _prompt(100), _prompt(101)
    _enable(url, "w0", False)  # both prompts cached on w1 alone
    try:
        for prompt in (hung, trial):
            assert _complete(url, prompt)["worker"] == "w1"
    finally:
        _enable(url, "w0", True)
    time.sleep(0.5)  # the engine's KV events reach the router
    os.killpg(engines[1].pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        timed_out = [_complete(url, hung) for _ in range(BREAKER_FAILURES)]
        assert [r["status"] for r in timed_out] == [504] * BREAKER_FAILURES, timed_out
        assert _workers(url)["w1"]["breaker"] == "open"
        out = _complete(url, hung)  # w1 holds its prefix, but is not chosen
        assert (out["status"], out["worker"]) == (200, "w0"), out
    finally:
        os.killpg(engines[1].pid, signal.SIGCONT)
    _wait(lambda: _workers(url)["w1"]["breaker"] == "half_open", 30, "the breaker half-open")
    out = _complete(url, trial)  # the one trial request: w1 answers again
    assert (out["status"], out["worker"]) == (200, "w1"), out
    view = _workers(url)["w1"]
    assert view["breaker"] == "closed" and view["breaker_trips"] >= 1, view
    metrics = _get(url + "/metrics").decode()
    assert 'warply_worker_breaker_state{state="closed",worker="w1"} 1.0' in metrics


def test_a_killed_engine_fails_started_streams_and_retries_queued_requests(
    stack: dict[str, Any],
) -> None:
    url, engines = stack["url"], stack["engines"]
    _enable(url, "w1", False)  # both requests go to w0
    started: dict[str, Any] = {}
    queued: dict[str, Any] = {}
    # The engine is frozen by the reader thread as the first event arrives, so the stream
    # cannot finish before the kill however fast the engine decodes or however late the test's
    # own thread runs on a busy machine (its kernel still accepts the second request's
    # connection).
    freeze = functools.partial(os.killpg, engines[0].pid, signal.SIGSTOP)
    threads = [
        threading.Thread(target=_stream, args=(url, "Long story: ", 1800, started, freeze)),
        threading.Thread(target=_stream, args=(url, "Queued behind it: ", 16, queued)),
    ]
    try:
        threads[0].start()
        _wait(lambda: bool(started.get("events")), 120, "the first stream's first event")
        threads[1].start()
        _wait(lambda: _workers(url)["w0"]["in_flight"] == 2, 30, "the second request on w0")
    finally:
        _enable(url, "w1", True)
    os.killpg(engines[0].pid, signal.SIGKILL)
    engines[0].proc.wait(30)
    for t in threads:
        t.join(120)
    assert started.get("done") and queued.get("done"), (started, queued)
    assert started["status"] == 200 and started["events"][-1] == "[DONE]", started
    error = json.loads(started["events"][-2])["error"]
    assert error["code"] == 502 and "w0" in error["message"], error
    assert (queued["status"], queued["worker"]) == (200, "w1"), queued
    assert not any('"error"' in e for e in queued["events"]), queued
    _wait(lambda: _workers(url)["w0"]["index"]["reason"] == "worker_down", 30, "w0 dropped")
    view = _workers(url)["w0"]
    assert not view["healthy"] and view["index"]["state"] == "fallback", view


def test_a_restarted_engine_rejoins_resynced(stack: dict[str, Any]) -> None:
    url, engines, held, logs = stack["url"], stack["engines"], stack["held"], stack["logs"]
    w0 = engines[0]
    w0.log_path = logs / "vllm0-restarted.log"
    w0.start()
    w0.wait_healthy(240)
    _wait(lambda: _workers(url)["w0"]["healthy"], 30, "w0 healthy in the router")
    _wait(lambda: _workers(url)["w0"]["index"]["parity"] == "ok", 30, "w0's parity check")
    assert _workers(url)["w0"]["index"]["state"] == "exact"
    on_w0 = [n for n, w in held.items() if w == "w0"]
    for n in on_w0:  # held by the killed process: never credited to the restarted one
        out = _complete(url, _prompt(n))
        assert out["status"] == 200 and out["predicted"] == out["cached"], (n, out)
        assert out["worker"] != "w0" or out["predicted"] == 0, (n, out)
    time.sleep(0.5)  # the engine's KV events reach the router
    again = _complete(url, _prompt(on_w0[0]))  # the restarted engine's stream feeds the index
    assert again["predicted"] == again["cached"] > 0, again


def test_no_request_is_lost(stack: dict[str, Any]) -> None:
    """Every request sent to this router process ended at the client as completed or failed
    with an error, and the router's own request counter says the same."""
    metrics = _get(stack["url"] + "/metrics").decode()
    router: Counter[str] = Counter()
    for line in metrics.splitlines():
        if line.startswith("warply_router_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            router["ok" if 'status="200"' in labels else "failed"] += int(float(value))
    print(f"\nclient ledger {dict(LEDGER)}, router counter {dict(router)}")
    assert LEDGER["failed"] >= BREAKER_FAILURES + 1  # the timeouts and the broken stream
    assert router == LEDGER


def test_a_router_over_a_shared_index_drops_what_a_restarted_engine_left(
    stack: dict[str, Any],
) -> None:
    """After the ledger's count (its requests go to another router): a router with its index
    on a redis-server learns one prompt on each engine; it is stopped, w1 restarted while no
    router of that index runs, and the router started again. It checks the last batch it
    applied per worker against each publisher's history: w0's prompt is still credited to w0
    (its first request hits there), w1's is credited to no worker (its old process's entries
    dropped, one resync), and a request for each is predicted exactly what its engine reports
    cached."""
    engines, logs = stack["engines"], stack["logs"]
    redis = RedisServer(log_path=logs / "faults-redis.log")
    index = {**stack["config"]["index"], "store": "redis", "url": redis.url}
    config = {**stack["config"], "port": free_port(), "index": index}
    router = RouterServer(config, logs, name="shared-router", env={"PYTHONPATH": str(ROOT)})
    prompts = {"w0": _prompt(300), "w1": _prompt(301)}
    try:
        redis.start()
        redis.wait_ready()
        router.start()
        router.wait_healthy(60)
        url = router.url
        for worker, prompt in prompts.items():
            other = "w1" if worker == "w0" else "w0"
            _enable(url, other, False)
            try:
                assert _complete(url, prompt)["worker"] == worker
            finally:
                _enable(url, other, True)
            _wait(lambda p=prompt, w=worker: _holders(url, p)[w] > 0, 30, f"{worker}'s blocks")
        router.stop()
        w1 = engines[1]
        w1.stop()
        w1.log_path = logs / "vllm1-restarted.log"
        w1.start()
        w1.wait_healthy(240)
        started = time.monotonic()
        router.start()
        router.wait_healthy(60)
        home = _complete(url, prompts["w0"])  # the first request of the new process
        first_hit = time.monotonic() - started
        w0_held, w1_held = _holders(url, prompts["w0"]), _holders(url, prompts["w1"])
        streams = {name: w["stream"] for name, w in _workers(url).items()}
        print(f"\nshared index after w1's restart: w0's prompt {w0_held}, w1's prompt {w1_held}, "
              f"resyncs {({n: s['resyncs'] for n, s in streams.items()})}; the new process's "
              f"first request, {first_hit:.2f} s after its start: {home}")  # fmt: skip
        assert (home["worker"], home["predicted"]) == ("w0", home["cached"]), home
        assert home["cached"] > 0, home
        assert w0_held["w0"] > 0 and w0_held["w1"] == 0, w0_held
        assert set(w1_held.values()) == {0}, w1_held
        assert (streams["w0"]["resyncs"], streams["w1"]["resyncs"]) == (0, 1), streams
        out = _complete(url, prompts["w1"])
        assert out["status"] == 200 and out["predicted"] == out["cached"], out
    finally:
        router.stop()
        redis.stop()


def test_a_stopped_router_ends_an_open_stream_and_the_engine_aborts_it(
    stack: dict[str, Any],
) -> None:
    """Last (it stops the module's router): SIGINT, as `warply down` sends it, while a stream is
    open on w0, frozen as its first event arrives. Once `drain_timeout_s` (1 s here) has passed,
    the client's stream ends with the 503 error event and `[DONE]`, the router exits 0, and w0,
    thawed, finds the request's connection closed and aborts it: nothing is left running."""
    url, router, w0 = stack["url"], stack["router"], stack["engines"][0]
    _enable(url, "w1", False)  # the stream goes to w0
    out: dict[str, Any] = {}
    freeze = functools.partial(os.killpg, w0.pid, signal.SIGSTOP)
    reader = threading.Thread(target=_stream, args=(url, "Long story: ", 1800, out, freeze))
    reader.start()
    try:
        _wait(lambda: bool(out.get("events")), 120, "the stream's first event")
        router.proc.send_signal(signal.SIGINT)
        assert router.proc.wait(30) == 0
    finally:
        os.killpg(w0.pid, signal.SIGCONT)
    reader.join(60)
    assert out.get("done") and out["events"][-1] == "[DONE]", out
    error = json.loads(out["events"][-2])["error"]
    assert (error["code"], error["message"]) == (503, "the router is shutting down"), error
    _wait(lambda: w0.metric("vllm:num_requests_running") == 0, 30, "w0 to abort the request")
    assert "1 of 1 requests still open after 1 s were ended with a 503" in router.log_tail(), (
        router.log_tail()
    )
