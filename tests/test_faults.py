"""Faults the router survives, against simulated engines (the labelled fakes of
tests/test_router_api.py) and the project's real state publisher over ZMQ: a worker that
accepts connections but never answers, a slow one, a lost stream batch, a restarted publisher
whose first batches were lost, a stream that goes silent while HTTP answers, tokenizer and
block-size mismatches, and the index health each shows. The same faults on real vLLM engines:
tests/vllm/test_faults.py."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import zmq
from aiohttp import web

from router.config import BreakerConfig, IndexConfig
from router.index import WorkerMatch
from router.index_health import IndexHealth
from router.metrics import RequestRecord, kv_transfer_stats
from router.metrics.registry import tenant_label
from router.tasks import cancel, periodic
from router.tokenize import RouterTokenizer
from router.workers import Breaker
from tests.test_router_api import (  # noqa: F401
    BS,
    HOST,
    Client,
    FakeEngine,
    _run,
    cut_event,
    running,
    serve_engines,
    tokenizer_dir,
)
from warply.launch import RedisServer, RouterServer, free_port
from warply.protocol import BlockStored, DecodedBatch, LoadSnapshot, Tier, prefix_keys
from warply.protocol.publisher import StatePublisher

PROMPT = "the cache holds a prefix of tokens the cache holds a prefix of tokens"


@dataclass
class FaultyEngine(FakeEngine):
    """A fake engine that can stall (accept, never answer), answer late, and tokenize."""

    stall: bool = False
    delay_s: float = 0.0
    tokens: Callable[[dict[str, Any]], Any] | None = None
    """What its /tokenize answers as `tokens` (None: no /tokenize, 404)."""

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/tokenize", self._tokenize)
        return app

    async def _tokenize(self, request: web.Request) -> web.Response:
        if self.tokens is None:
            raise web.HTTPNotFound()
        return web.json_response({"tokens": self.tokens(await request.json())})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        while self.stall:
            await asyncio.sleep(0.02)
        await asyncio.sleep(self.delay_s)
        return await super()._generate(request)


async def _until(cond: Callable[[], Any], what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _stored(folder: Path, prompt: str = PROMPT, first_hash: int = 1) -> BlockStored:
    """The full blocks of `prompt` as an engine reports storing them."""
    ids = RouterTokenizer(folder).encode(prompt, True)
    n = len(ids) // BS * BS
    return BlockStored(list(range(first_hash, first_hash + n // BS)), None, ids[:n], BS)


def _router_counts(text: str) -> Counter[str]:
    """`warply_router_requests_total` summed as completed (200) and failed (anything else)."""
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("warply_router_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out["ok" if 'status="200"' in labels else "failed"] += int(float(value))
    return out


async def _ledger(call: Client, prompts: list[dict[str, Any]], ledger: Counter[str]) -> list[Any]:
    """Send each body; count it at the client as completed (200) or failed with an error."""
    out = []
    for body in prompts:
        status, answer = await call("POST", "/v1/completions", body)
        failed = status != 200
        assert not failed or set(answer["error"]) == {"message", "type", "param", "code"}
        ledger["failed" if failed else "ok"] += 1
        out.append((status, answer))
    return out


def test_a_hung_worker_times_out_opens_its_breaker_and_is_no_longer_chosen(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    """"a" holds the prompt's prefix but accepts connections and never answers: two requests
    time out (504), its breaker opens and the slow but answering "b" takes the next ones; once
    open_s has passed, one trial request finds "a" answering again and closes the breaker.
    Every request is accounted for, at the client and in the router's counter."""

    async def scenario() -> None:
        a, b = FaultyEngine("a", stall=True), FaultyEngine("b", delay_s=0.05)
        # margins for a loaded machine: b's 0.05 s is far inside the idle timeout, and the
        # breaker stays open while b serves two requests
        cfg = {"upstream_idle_timeout_s": 1.0, "breaker": {"failures": 2, "open_s": 3.0},
               "health_interval_s": 60}  # fmt: skip
        async with running(tokenizer_dir, [a, b], **cfg) as (router, call, _s, _b):
            await router.index.apply("a", [_stored(tokenizer_dir)])
            ledger: Counter[str] = Counter()
            body = {"prompt": PROMPT, "max_tokens": 2}
            hung = await _ledger(call, [body, body], ledger)
            assert [status for status, _ in hung] == [504, 504], hung
            assert router.workers["a"].breaker.state == "open"
            served = await _ledger(call, [body, body], ledger)  # slow b answers in time
            assert [(s, r["choices"][0]["text"]) for s, r in served] == [(200, "b")] * 2
            a.stall = False
            await _until(lambda: router.workers["a"].breaker.state == "half_open", "half-open")
            trial = await _ledger(call, [body], ledger)
            assert trial[0][1]["choices"][0]["text"] == "a"
            _, workers = await call("GET", "/warply/workers")
            view = {w["name"]: w for w in workers["workers"]}["a"]
            assert (view["breaker"], view["breaker_trips"]) == ("closed", 1)
            _, text = await call("GET", "/metrics")
            assert 'warply_worker_breaker_trips{worker="a"} 1.0' in text
            assert _router_counts(text) == ledger == Counter(ok=3, failed=2)

    _run(scenario())


class _LossyLink:
    """Forwards a publisher's frames to the router, dropping the sequence numbers in `drop`:
    a network that loses messages (the replay socket is reached directly)."""

    def __init__(self, upstream: str) -> None:
        self.endpoint = f"tcp://{HOST}:{free_port()}"
        self.drop: set[int] = set()
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(20):
                frames = self._sub.recv_multipart()
                if int.from_bytes(frames[1], "big") not in self.drop:
                    self._pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close()
        self._pub.close()


def _publisher(events: str, replay: str) -> StatePublisher:
    """A publisher on these endpoints (the port of a closed one may take a moment to free)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return StatePublisher(events, replay_endpoint=replay, topic="kv", bind=True)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def link() -> Iterator[tuple[str, str, _LossyLink]]:
    events, replay = f"tcp://{HOST}:{free_port()}", f"tcp://{HOST}:{free_port()}"
    lossy = _LossyLink(events)
    yield events, replay, lossy
    lossy.close()


def test_a_lost_batch_is_replayed_and_a_restarted_publisher_resyncs(
    tokenizer_dir: Path,  # noqa: F811
    link: tuple[str, str, _LossyLink],
) -> None:
    """Batch 1 is lost on the way: batch 2 reveals the gap and 1 is replayed (the index stays
    `exact`). Then the publisher restarts and its batches 0 and 1 are lost: its batch 2, not
    newer in number than the last one applied but newer in time, is a restart: the worker's
    entries are dropped (`fallback`, resync), 0 and 1 are replayed from the new publisher, and
    the index holds what the new process stored, none of what the old one did."""
    events, replay, lossy = link
    prompts = [f"{word} {PROMPT}" for word in ("alpha", "beta", "gamma", "delta")]

    async def scenario() -> None:
        streams = {"a": {"events": lossy.endpoint, "replay": replay, "topic": "kv"}}
        async with running(
            tokenizer_dir, [FakeEngine("a")], streams, index={"degraded_s": 0.3}
        ) as (router, _call, _s, _b):
            sub = router.feed.subscribers["a"]
            tok = RouterTokenizer(tokenizer_dir)
            keys = [prefix_keys(tok.encode(p, True), BS, "m") for p in prompts]

            async def held(i: int) -> int:
                return (await router.index.match(keys[i], ["a"]))["a"].blocks

            pub = _publisher(events, replay)
            await asyncio.sleep(0.5)  # the link and the router's SUB connect
            lossy.drop = {1}
            pub.publish([_stored(tokenizer_dir, prompts[0], 100)])
            pub.publish([_stored(tokenizer_dir, prompts[1], 200)])
            pub.publish([LoadSnapshot(running=0, waiting=0, kv_usage=0.0)])
            await _until(lambda: sub.last_seq == 2, "the replayed gap")
            assert (sub.gaps, sub.replayed, sub.resyncs) == (1, 1, 0)
            assert await held(0) and await held(1)
            assert router.health.view("a").state == "exact"

            pub.close()
            pub = _publisher(events, replay)
            await asyncio.sleep(0.5)
            lossy.drop = {0, 1}
            pub.publish([_stored(tokenizer_dir, prompts[2], 300)])
            pub.publish([_stored(tokenizer_dir, prompts[3], 400)])
            pub.publish([LoadSnapshot(running=1, waiting=0, kv_usage=0.0)])
            await _until(lambda: sub.resyncs == 1 and sub.last_seq == 2, "the resync")
            assert router.health.view("a").state == "fallback"
            assert router.health.view("a").reason == "resync"
            assert [await held(i) for i in range(4)] == [0, 0, len(keys[2]), len(keys[3])]
            assert (sub.gaps, sub.replayed) == (2, 3)
            await _until(lambda: router.health.view("a").state == "exact", "exact again")
            pub.close()

    _run(scenario())


def test_a_router_restarted_over_a_shared_index_drops_what_a_restarted_engine_left(
    tokenizer_dir: Path,  # noqa: F811
    redis_server: RedisServer,
) -> None:
    """The index on a shared store outlives the router process. A router started later checks
    the last batch an earlier one applied against the publisher's history: the same publisher
    (it still holds that batch) keeps the entries, no resync; a publisher restarted while no
    router ran (its history ends before that batch) left them stale: they are dropped before
    its history is applied, so a prompt only the old engine process held is credited nowhere."""
    events, replay = f"tcp://{HOST}:{free_port()}", f"tcp://{HOST}:{free_port()}"
    prompts = [f"{word} {PROMPT}" for word in ("alpha", "beta", "gamma")]
    streams = {"a": {"events": events, "replay": replay, "topic": "kv"}}
    index = {"store": "redis", "url": redis_server.url, "prefix": f"restart{free_port()}"}

    async def scenario() -> None:
        tok = RouterTokenizer(tokenizer_dir)
        keys = [prefix_keys(tok.encode(p, True), BS, "m") for p in prompts]

        async def router_sees(n: int) -> tuple[list[int], int]:
            """A router process started now, once it took the history: (blocks of each prompt
            held by "a", its stream's resyncs)."""
            async with running(tokenizer_dir, [FakeEngine("a")], streams, index=index) as (
                router, _call, _s, _b
            ):
                sub = router.feed.subscribers["a"]
                await _until(lambda: sub.last_seq == n - 1, "the history")
                held = [(await router.index.match(k, ["a"]))["a"].blocks for k in keys]
                return held, sub.resyncs

        pub = _publisher(events, replay)
        pub.publish([_stored(tokenizer_dir, prompts[0], 100)])
        pub.publish([_stored(tokenizer_dir, prompts[1], 200)])
        full = [len(k) for k in keys]
        assert await router_sees(2) == ([full[0], full[1], 0], 0)
        assert await router_sees(2) == ([full[0], full[1], 0], 0)  # the same publisher
        pub.close()
        pub = _publisher(events, replay)  # the engine restarted while no router ran
        pub.publish([_stored(tokenizer_dir, prompts[2], 300)])
        assert await router_sees(1) == ([0, 0, full[2]], 1)
        pub.close()

    _run(scenario())


def test_a_silent_stream_ages_out_its_workers_entries(
    tokenizer_dir: Path,  # noqa: F811
    link: tuple[str, str, _LossyLink],
) -> None:
    """"a" answers a request that stored new blocks there, but its stream says nothing for
    `index.stale_after_s`: its entries are dropped, its index is `fallback` (stream_silent)
    and counted on /metrics, until a batch arrives."""
    events, replay, lossy = link

    async def scenario() -> None:
        streams = {"a": {"events": lossy.endpoint, "replay": replay, "topic": "kv"}}
        index = {"stale_after_s": 0.3}
        async with running(
            tokenizer_dir, [FakeEngine("a", cached_tokens=0)], streams, index=index
        ) as (router, call, _s, _b):
            pub = _publisher(events, replay)
            await asyncio.sleep(0.5)
            pub.publish([_stored(tokenizer_dir)])
            keys = prefix_keys(RouterTokenizer(tokenizer_dir).encode(PROMPT, True), BS, "m")
            await _until(lambda: router.feed.subscribers["a"].last_seq == 0, "the first batch")
            await asyncio.sleep(0.05)
            other = {"prompt": "a prefix of tokens the cache holds, and more of them"}
            status, _ = await call("POST", "/v1/completions", other)  # stores blocks on "a"
            assert status == 200
            await _until(lambda: router.health.view("a").reason == "stream_silent", "ageing")
            assert (await router.index.match(keys, ["a"]))["a"].blocks == 0
            _, text = await call("GET", "/metrics")
            assert 'warply_index_aged_out{worker="a"} 1.0' in text
            assert 'warply_index_state{state="fallback",worker="a"} 1.0' in text
            pub.publish([LoadSnapshot(running=0, waiting=0, kv_usage=0.0)])
            await _until(lambda: router.health.view("a").state == "exact", "the stream back")
            pub.close()

    _run(scenario())


def test_a_tokenizer_or_block_size_mismatch_falls_back_to_load_loudly(
    tokenizer_dir: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """"a" tokenizes the probes its own way, "b" as the router does, "c" has no /tokenize and
    stores blocks of twice the pool's size: "a" and "c" are `fallback` (an error logged, a
    metric set) and their matches count for nothing; "b" stays `exact`."""
    tok = RouterTokenizer(tokenizer_dir)

    def same(body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            return tok.whole(tok.render_chat(body), False)
        return tok.whole(body["prompt"], body.get("add_special_tokens", True))

    async def scenario() -> None:
        engines = [
            FaultyEngine("a", tokens=lambda body: same(body)[::-1]),
            FaultyEngine("b", tokens=same),
            FaultyEngine("c"),
        ]
        streams = {e.name: {"events": f"tcp://{HOST}:{free_port()}"} for e in engines}
        with caplog.at_level(logging.ERROR, logger="warply.router"):
            async with running(tokenizer_dir, engines, streams) as (router, call, _s, _b):
                stored = _stored(tokenizer_dir)
                for name in ("a", "b"):
                    await router.index.apply(name, [stored])
                wide = BlockStored([9], None, stored.token_ids[: 2 * BS], 2 * BS)
                await router.feed.on_batch("c", DecodedBatch(0, 1.0, [wide], "engine"))
                views = {n: router.health.view(n) for n in ("a", "b", "c")}
                assert [(v.state, v.reason, v.parity) for v in views.values()] == [
                    ("fallback", "parity_tokenizer", "mismatch"),
                    ("exact", "", "ok"),
                    ("fallback", "parity_block_size", "unchecked"),
                ]
                keys = prefix_keys(tok.encode(PROMPT, True), BS, "m")
                trimmed = router.health.trim(await router.index.match(keys, ["a", "b"]))
                assert trimmed["a"].blocks == 0 and trimmed["b"].blocks == len(keys)
                _, text = await call("GET", "/metrics")
                assert 'warply_index_parity_mismatch{kind="tokenizer",worker="a"} 1.0' in text
                assert 'warply_index_parity_mismatch{kind="block_size",worker="c"} 1.0' in text
                _, listed = await call("GET", "/warply/workers")
                assert {w["name"]: w["index"]["state"] for w in listed["workers"]} == {
                    "a": "fallback", "b": "exact", "c": "fallback"
                }  # fmt: skip
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert "worker a: the engine tokenizes probe prompts differently" in logged
        assert "worker c: engine blocks have 8 tokens" in logged

    _run(scenario())


def test_odd_engine_answers_leave_the_health_checks_running(
    tokenizer_dir: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A /tokenize that answers no token list leaves parity `unchecked` (a number there was a
    TypeError out of the start-up health check); NaN and infinite KV-transfer counters are
    skipped (int() of them raised in every health round). And a health round that fails for a
    reason not foreseen is logged, and the next one runs: the loop ended for good before."""

    async def scenario() -> None:
        engine = FaultyEngine("a", tokens=lambda body: 5)
        streams = {"a": {"events": f"tcp://{HOST}:{free_port()}"}}
        async with running(tokenizer_dir, [engine], streams) as (router, call, _s, _b):
            assert router.health.view("a").parity == "unchecked"
            assert (await call("POST", "/v1/completions", {"prompt": PROMPT}))[0] == 200
        rounds: list[float] = []

        async def round_() -> None:
            rounds.append(time.monotonic())
            if len(rounds) == 1:
                raise RuntimeError("an answer no one foresaw")

        task = periodic(round_, 0.01, "health")
        await _until(lambda: len(rounds) >= 3, "rounds after the failed one")
        await cancel([task])

    with caplog.at_level(logging.ERROR, logger="warply.router"):
        _run(scenario())
    failed = [r for r in caplog.records if r.getMessage().startswith("health round failed")]
    assert len(failed) == 1 and "an answer no one foresaw" in (failed[0].exc_text or "")
    clean = kv_transfer_stats("vllm:nixl_num_failed_transfers_total 1.0\n")
    odd = "vllm:nixl_bytes_transferred_sum NaN\nvllm:nixl_xfer_time_seconds_sum +Inf\n"
    assert kv_transfer_stats(odd + "vllm:nixl_num_failed_transfers_total 1.0\n") == clean


def test_a_joining_worker_is_checked_for_parity_once_healthy(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    """A worker joining at runtime whose engine tokenizes differently is `fallback` as soon as
    the health loop finds it healthy."""

    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")]) as (router, call, _s, _b):
            late = FaultyEngine("late", tokens=lambda body: [1, 2, 3])
            runners = await serve_engines([late])
            try:
                entry = {"name": "late", "url": late.url, "events": f"tcp://{HOST}:{free_port()}"}
                status, _ = await call("POST", "/warply/pools/p/workers", entry)
                assert status == 201
                await _until(lambda: router.health.view("late").parity == "mismatch", "parity")
                assert router.health.view("late").reason == "parity_tokenizer"
            finally:
                for runner in runners:
                    await runner.cleanup()

    _run(scenario())


def test_a_lagging_workers_match_keeps_the_share_its_predictions_found() -> None:
    """While its engine's shortfalls pass `lag_tolerance`, a worker is degraded and its match
    keeps the leading share of its blocks that its recent predictions found there (slowest
    tiers dropped first), for `degraded_s`; others are unchanged."""
    health = IndexHealth(IndexConfig(degraded_s=60))
    for name in ("a", "b"):
        health.joined(name, has_stream=True)
    health.observe(_ended("a", 64, 16))
    assert health.shortfall("a") == 0.75
    match = WorkerMatch(8, {Tier.GPU: 2, Tier.CPU: 6})
    trimmed = health.trim({"a": match, "b": match})
    assert trimmed["a"] == WorkerMatch(2, {Tier.GPU: 2}) and trimmed["b"] == match
    assert (health.view("a").state, health.view("a").reason) == ("degraded", "lagging_evictions")
    for _ in range(8):  # placement used the cut match; the engine held what the index said
        health.observe(_ended("a", 64, 64, trimmed=16))
    assert 0 < health.shortfall("a") < 0.25
    assert trimmed["a"].blocks < health.trim({"a": match})["a"].blocks < match.blocks


def _ended(worker: str, predicted: int, cached: int, trimmed: int | None = None) -> Any:
    """An ended request's record as `IndexHealth.observe` reads it: the index predicted
    `predicted` cached tokens, placement used `trimmed` (default: the same)."""
    pool = SimpleNamespace(block_size=BS)
    leg = SimpleNamespace(
        worker=SimpleNamespace(name=worker, pool=pool),
        predicted_cached=predicted if trimmed is None else trimmed,
        index_cached=predicted,
        prefill=None,
    )
    return RequestRecord(leg, status=200, latency_s=0.01, prompt_tokens=predicted, cached=cached)


def test_only_shortfalls_that_add_up_degrade_a_worker() -> None:
    """A full cache evicts all the time and its events come a step late: one prediction the
    engine fell short of, among many it met, leaves the worker `exact` (its shortfall is
    only counted); shortfalls past `lag_tolerance` of the recent predictions degrade
    it, as does one on a worker with no record yet."""
    health = IndexHealth(IndexConfig(degraded_s=60, lag_tolerance=0.1))
    for name in ("a", "b"):
        health.joined(name, has_stream=True)
    for _ in range(20):
        health.observe(_ended("a", 64, 64))
    health.observe(_ended("a", 64, 32))
    assert health.view("a").state == "exact"
    for _ in range(4):
        health.observe(_ended("a", 64, 0))
    assert (health.view("a").state, health.view("a").reason) == ("degraded", "lagging_evictions")
    health.observe(_ended("b", 64, 32))
    assert health.view("b").state == "degraded"


def test_predicted_and_engine_hit_rates_per_worker_and_tenant(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    async def scenario() -> None:
        engine = FakeEngine("a", cached_tokens=4)
        async with running(tokenizer_dir, [engine]) as (router, call, _s, _b):
            await router.index.apply("a", [_stored(tokenizer_dir)])
            for key in ("t1", "t1", "t2"):
                body = {"prompt": PROMPT, "warply": {"cache_key": key}}
                assert (await call("POST", "/v1/completions", body))[0] == 200
            stats = await router.cache_stats()
            t1, t2 = stats.tenants["t1"], stats.tenants["t2"]
            assert (t1.requests, t1.engine_cached_tokens, t2.requests) == (2, 8, 1)
            assert t1.engine_hit_rate == 8 / t1.engine_prompt_tokens
            assert t1.predicted_hit_rate == 0.0  # t1's keys differ from the unsalted blocks
            w = stats.workers["a"]
            assert w.engine_hit_rate == 12 / w.prompt_tokens and w.index_state == "fallback"
            _, text = await call("GET", "/metrics")
            t1_label = tenant_label("t1")
            assert f'tenant_tokens{{kind="engine_cached",tenant="{t1_label}"}} 8.0' in text
            assert 'warply_router_worker_tokens{kind="engine_cached",worker="a"} 12.0' in text

    _run(scenario())


def test_a_half_open_breaker_lets_one_trial_through_and_a_failed_trial_reopens_it() -> None:
    breaker = Breaker(BreakerConfig(failures=2, open_s=0.05))
    breaker.failed("a")
    assert (breaker.state, breaker.allows(0)) == ("closed", True)  # one failure: still placed
    breaker.failed("a")
    assert (breaker.state, breaker.allows(0), breaker.trips) == ("open", False, 1)
    time.sleep(0.06)
    assert breaker.state == "half_open" and breaker.allows(0) and not breaker.allows(1)
    breaker.failed("a")  # the trial failed: open again at once
    assert (breaker.state, breaker.trips) == ("open", 2)
    time.sleep(0.06)
    breaker.succeeded()
    assert (breaker.state, breaker.failures, breaker.allows(3)) == ("closed", 0, True)


async def _stream_text(session: aiohttp.ClientSession, url: str) -> str:
    """A streamed completion, as the client got it."""
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        return await r.text()


def test_a_stopping_router_lets_requests_finish_then_ends_the_rest_with_a_503(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    """Stopping (the drain aiohttp runs on SIGTERM once the listener is closed): a stream that
    ends within `drain_timeout_s` ends as usual; with a shorter drain, a started stream gets an
    error event (503) and `[DONE]`, a request with no answer yet a 503, and the engine sees both
    aborted. Every request is accounted for, at the client and in the router's counter."""

    async def scenario() -> None:
        a = FaultyEngine("a", hang=True)  # streams its first event, then waits
        async with running(tokenizer_dir, [a], drain_timeout_s=10) as (router, call, s, base):
            stream = asyncio.create_task(_stream_text(s, base))
            await _until(lambda: a.bodies, "the stream upstream")
            stopping = asyncio.create_task(router.app.shutdown())
            await asyncio.sleep(0.3)
            assert not stopping.done()  # waiting for the stream
            a.hang = False
            text = await stream
            await asyncio.wait_for(stopping, 5)
            assert text.endswith("data: [DONE]\n\n") and "error" not in text, text

        a = FaultyEngine("a", hang=True)
        async with running(tokenizer_dir, [a], drain_timeout_s=0.5) as (router, call, s, base):
            ledger: Counter[str] = Counter()
            stream = asyncio.create_task(_stream_text(s, base))
            await _until(lambda: a.bodies, "the stream upstream")
            a.stall = True  # the next request gets no answer at all
            pending = asyncio.create_task(_ledger(call, [{"prompt": PROMPT}], ledger))
            await _until(lambda: router.proxy.drain.in_flight == 2, "two requests in flight")
            started = time.monotonic()
            await router.app.shutdown()
            assert time.monotonic() - started < 5
            error = cut_event(await stream)
            assert (error["code"], error["message"]) == (503, "the router is shutting down")
            [(status, answer)] = await pending
            assert (status, answer["error"]["code"]) == (503, "shutting_down")
            await _until(a.cancelled.is_set, "the engine's stream aborted")
            _, text = await call("GET", "/metrics")
            counts = _router_counts(text)
            assert counts == Counter(failed=2) and ledger == Counter(failed=1), (counts, ledger)

    _run(scenario())


def test_sigterm_drains_the_router_process(tokenizer_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """`python -m router` on SIGTERM: no new connections, the open stream ends with the 503
    error event once `drain_timeout_s` has passed, the process exits 0 and says so in its log."""

    async def scenario() -> None:
        a = FaultyEngine("a", hang=True)
        runners = await serve_engines([a])
        config = {
            "model": "m",
            "tokenizer": str(tokenizer_dir),
            "port": free_port(),
            "drain_timeout_s": 0.5,
            "pools": [{"name": "p", "block_size": BS, "workers": [{"name": "a", "url": a.url}]}],
        }
        router = RouterServer(config, tmp_path).start()
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, router.wait_healthy, 60)
            async with aiohttp.ClientSession() as session:
                stream = asyncio.create_task(_stream_text(session, router.url))
                await _until(lambda: a.bodies, "the stream upstream")
                router.proc.send_signal(signal.SIGTERM)
                error = cut_event(await stream)
                assert error["code"] == 503
                with pytest.raises(aiohttp.ClientConnectionError):
                    await session.get(router.url + "/health")
            assert await loop.run_in_executor(None, router.proc.wait, 30) == 0
            log = router.log_path.read_text()
            assert "1 of 1 requests still open after 0.5 s were ended with a 503" in log, log
        finally:
            router.stop()
            for runner in runners:
                await runner.cleanup()

    _run(scenario())
