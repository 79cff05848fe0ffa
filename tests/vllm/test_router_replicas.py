"""Active-active `warply-router` replicas sharing a real redis-server (index and bookings) in
front of two real vLLM CPU engines, behind a client that alternates between them.

The same workload (8 conversations x 3 turns, 4 at a time; each run under its own cache_salt, so
no run hits another's KV) runs first through one router (in-memory index), then through two
replicas, one of them killed (SIGKILL) half-way; then a third replica, started afterwards, takes
every conversation's next turn. Checks, on the engines' own numbers
(usage.prompt_tokens_details.cached_tokens): the replicas' hit rate is within 0.02 of the single
router's (over the turns that were not failed over: a request the killed replica had sent still
finished on its engine, so its retry is a hit there); no request is lost (the client retries on
the other replica when a connection fails before any byte of an answer came back: that failover
is the client's or the load balancer's job, not the router's); the third replica sends each
conversation to the engine holding it. Every process is started here and stopped by PID.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import VLLM_BIN

from warply.launch import HOST, EngineProcess, KvEvents, RedisServer, VllmServer, free_port

ROUTER_BIN = Path(__file__).resolve().parents[2] / ".venvs" / "core" / "bin" / "warply-router"
"""The router runs from the core venv (it has the Redis client; the vLLM venv need not)."""
BLOCK = 32
CONVERSATIONS, TURNS, AT_ONCE = 8, 3, 4
Turn = tuple[str, int, int, bool, int]
"""(worker, prompt tokens, cached tokens, failed over, cached tokens the router predicted) of
one answered turn."""


class FailoverClient:
    """Sends each request to the next router replica in turn; on a connection error before any
    byte of the answer (refused, or closed by a replica that died), the same request goes to
    the next replica. Past the first byte nothing is retried (the answer may be half-sent)."""

    def __init__(self, urls: list[str], salt: str) -> None:
        self.urls = urls
        self.salt = salt
        """The requests' cache_salt: a run's prompts never hit another run's KV."""
        self.failovers = 0
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def chat(self, messages: list[dict[str, str]]) -> tuple[dict[str, Any], Any, bool]:
        """The answer, its headers, and whether a replica failed first."""
        body = {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0,
                "cache_salt": self.salt}  # fmt: skip
        data = json.dumps(body).encode()
        with self._lock:
            first = next(self._turn)
        for k in range(len(self.urls)):
            url = self.urls[(first + k) % len(self.urls)]
            req = urllib.request.Request(
                url + "/v1/chat/completions", data=data,
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    return json.loads(resp.read()), resp.headers, k > 0
            except urllib.error.HTTPError:
                raise
            except (urllib.error.URLError, ConnectionError) as exc:
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                if not isinstance(reason, ConnectionError):
                    raise
                with self._lock:
                    self.failovers += 1
        raise ConnectionError(f"no router replica answered: {self.urls}")


@dataclass
class _Conversation:
    n: int
    messages: list[dict[str, str]]
    turns: list[Turn] = field(default_factory=list)

    @classmethod
    def new(cls, n: int) -> _Conversation:
        system = f"Conversation {n}: you answer questions about cache block {n * 7} in depth. "
        return cls(n, [{"role": "system", "content": system * 6}])

    def ask(self, client: FailoverClient) -> Turn:
        """The next turn, through `client`; the answer joins the history."""
        self.messages.append(
            {"role": "user", "content": f"Question {len(self.turns)} about {self.n}?"}
        )
        body, headers, failed_over = client.chat(self.messages)
        usage = body["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        predicted = int(headers["X-Warply-Predicted-Cached"])
        worker = headers["X-Warply-Worker"]
        self.turns.append((worker, usage["prompt_tokens"], cached, failed_over, predicted))
        self.messages.append(
            {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
        )
        time.sleep(0.5)  # the engine's KV events reach the routers
        return self.turns[-1]


def _workload(
    client: FailoverClient, done: threading.Semaphore | None = None
) -> list[_Conversation]:
    """CONVERSATIONS x TURNS, AT_ONCE conversations at a time (`done` released after each)."""
    convs = [_Conversation.new(n) for n in range(CONVERSATIONS)]
    errors: list[BaseException] = []

    def run(mine: list[_Conversation]) -> None:
        try:
            for conv in mine:
                for _ in range(TURNS):
                    conv.ask(client)
                if done is not None:
                    done.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(convs[i::AT_ONCE],)) for i in range(AT_ONCE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    return convs


def _hit_rate(convs: list[_Conversation], skip: set[tuple[int, int]]) -> float:
    """Cached / prompt tokens over every turn but the (conversation, turn) pairs in `skip`."""
    turns = [t for c in convs for i, t in enumerate(c.turns) if (c.n, i) not in skip]
    return sum(t[2] for t in turns) / sum(t[1] for t in turns)


def _failed_over(convs: list[_Conversation]) -> set[tuple[int, int]]:
    """Turns answered after a replica failed: a request the dead replica had already sent
    finished on its engine, and its retry hits that attempt's cache."""
    return {(c.n, i) for c in convs for i, t in enumerate(c.turns) if t[3]}


@pytest.fixture(scope="module")
def stack(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A redis-server and two engines (cores 0 and 1); routers are started by the test."""
    logs = tmp_path_factory.mktemp("replicas")
    engines: list[VllmServer] = []
    workers = []
    for i in range(2):
        events = KvEvents()
        engines.append(
            VllmServer(
                VLLM_BIN, tiny_model, log_path=logs / f"vllm{i}.log", cpu_core=i,
                args=["--block-size", str(BLOCK), "--max-model-len", "2048", "--max-num-seqs", "4",
                      "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0"],
                kv_events_config=events.engine_config(),
            )
        )  # fmt: skip
        workers.append(events.worker(f"w{i}", engines[-1].url))
    redis = RedisServer(log_path=logs / "redis.log")
    try:
        redis.start()
        for e in engines:
            e.start()
        redis.wait_ready()
        for e in engines:
            e.wait_healthy()
        yield {"engines": engines, "workers": workers, "redis": redis, "logs": logs,
               "model": tiny_model}  # fmt: skip
    finally:
        for e in engines:
            e.stop()
        redis.stop()


def _router(stack: dict[str, Any], name: str, index: dict[str, Any]) -> EngineProcess:
    """A `warply-router` process (started, healthy) over both engines with `index`."""
    port = free_port()
    config = {
        "model": "tiny", "tokenizer": stack["model"], "port": port,
        "strategy": {"name": "prefix_affinity"}, "index": index,
        "pools": [{"name": "cpu", "block_size": BLOCK, "workers": stack["workers"]}],
    }  # fmt: skip
    path: Path = stack["logs"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    router = EngineProcess(
        [str(ROUTER_BIN), "--config", str(path)],
        url=f"http://{HOST}:{port}",
        log_path=stack["logs"] / f"{name}.log",
    )
    router.start()
    router.wait_healthy(120)
    return router


def test_replicas_share_routing_survive_a_kill_and_warm_start_a_new_one(
    stack: dict[str, Any],
) -> None:
    single = _router(stack, "single", {"store": "memory"})
    try:
        alone = _workload(FailoverClient([single.url], "one"))
    finally:
        single.stop()

    shared = {"store": "redis", "url": stack["redis"].url, "prefix": "replicas"}
    routers = [_router(stack, f"replica{i}", shared) for i in range(2)]
    third: EngineProcess | None = None
    try:
        client = FailoverClient([r.url for r in routers], "two")
        done = threading.Semaphore(0)
        killer_done = threading.Event()

        def kill_half_way() -> None:
            for _ in range(CONVERSATIONS // 2):
                done.acquire()
            os.kill(routers[1].pid, signal.SIGKILL)  # no shutdown: its bookings just expire
            killer_done.set()

        killer = threading.Thread(target=kill_half_way)
        killer.start()
        together = _workload(client, done)
        killer.join(60)
        assert killer_done.is_set() and routers[1].proc is not None
        assert routers[1].proc.wait(10) == -signal.SIGKILL
        assert client.failovers >= 1, "requests after the kill went to the dead replica first"

        assert all(len(c.turns) == TURNS for c in together), "every request answered"
        skip = _failed_over(together)
        h1, h2 = _hit_rate(alone, skip), _hit_rate(together, skip)
        print(f"hit rate: one router {h1:.3f}, two replicas {h2:.3f} ({len(skip)} of "
              f"{CONVERSATIONS * TURNS} turns failed over, left out of both; "
              f"{client.failovers} failovers)")
        assert h1 > 0.3, [c.turns for c in alone]
        turns = json.dumps({"one": [c.turns for c in alone], "two": [c.turns for c in together]})
        assert abs(h2 - h1) <= 0.02, turns

        # A replica started now: its first requests are the conversations' next turns.
        third = _router(stack, "replica2", shared)
        late = FailoverClient([third.url], "two")
        for conv in together:
            holder, prompt, *_ = conv.turns[-1]
            worker, _, cached, *_ = conv.ask(late)
            assert worker == holder, conv.turns
            assert cached >= prompt // BLOCK * BLOCK - BLOCK, conv.turns
        assert late.failovers == 0
    finally:
        for r in (*routers, third):
            if r is not None:
                r.stop()
