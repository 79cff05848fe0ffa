"""Workers joining and leaving a running router (POST /warply/pools/{pool}/workers, DELETE
/warply/workers/{name}) against in-process fake engines and a real state stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from router.app import Router
from tests.test_router_api import (  # noqa: F401
    BS,
    HOST,
    FakeEngine,
    _is_error,
    _run,
    running,
    serve_engines,
    tokenizer_dir,
)
from warply.launch import free_port
from warply.protocol import BlockStored, prefix_keys
from warply.protocol.publisher import StatePublisher

TOKENS = list(range(2 * BS))
"""A two-block prompt (token ids) a worker's stream reports cached."""


async def _until(check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        done = check()
        if not isinstance(done, bool):
            done = await done
        if done:
            return
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _held(router: Router, worker: str, tokens: list[int]) -> int:
    """Blocks of `tokens` the index says `worker` holds."""
    matches = await router.index.match(prefix_keys(tokens, BS, "m", ""), [worker])
    match = matches.get(worker)
    return 0 if match is None else match.blocks


def test_a_joining_worker_is_subscribed_replayed_and_placed(tokenizer_dir: Path) -> None:  # noqa: F811
    async def scenario() -> None:
        joiner = FakeEngine("b")
        runners = await serve_engines([joiner])
        port, rport = free_port(), free_port()
        publisher = StatePublisher(
            f"tcp://{HOST}:{port}", replay_endpoint=f"tcp://{HOST}:{rport}", worker="b", bind=True
        )
        publisher.publish([BlockStored([1, 2], None, TOKENS, BS)])  # before it joins: replayed
        later = [t + 100 for t in TOKENS]
        try:
            async with running(tokenizer_dir, [FakeEngine("a")]) as (router, call, _s, _b):
                entry = {
                    "name": "b",
                    "url": joiner.url,
                    "events": f"tcp://{HOST}:{port}",
                    "replay": f"tcp://{HOST}:{rport}",
                }
                status, body = await call("POST", "/warply/pools/p/workers", entry)
                assert status == 201
                assert (body["name"], body["pool"], body["role"]) == ("b", "p", "both")
                await _until(lambda: router.workers["b"].healthy)  # the health loop probed it
                await _until(lambda: _eq(_held(router, "b", TOKENS), 2))
                publisher.publish([BlockStored([3, 4], None, later, BS)])  # live, after joining
                await _until(lambda: _eq(_held(router, "b", later), 2))
                await call("POST", "/warply/workers/a", {"enabled": False})
                status, body = await call("POST", "/v1/completions", {"prompt": "the cache"})
                assert status == 200 and body["choices"][0]["text"] == "b"
                _, listed = await call("GET", "/warply/workers")
                joined = listed["workers"][1]
                assert joined["name"] == "b" and joined["stream"]["replayed"] == 1
                _, stats = await call("GET", "/warply/cache_stats")
                assert stats["workers"]["b"]["requests"] == 1
                _, text = await call("GET", "/metrics")
                assert 'warply_worker_healthy{worker="b"} 1.0' in text
        finally:
            publisher.close()
            for runner in runners:
                await runner.cleanup()

    _run(scenario())


async def _eq(value: Awaitable[int], want: int) -> bool:
    return await value == want


def test_a_leaving_worker_finishes_its_requests_then_is_gone(tokenizer_dir: Path) -> None:  # noqa: F811
    async def scenario() -> None:
        engines = [FakeEngine("a", hang=True), FakeEngine("b")]
        async with running(tokenizer_dir, engines) as (router, call, session, base):
            await router.index.apply("a", [BlockStored([1, 2], None, TOKENS, BS)])
            assert await _held(router, "a", TOKENS) == 2
            router.index.overpredicted("a", 1)
            await call("POST", "/warply/workers/b", {"enabled": False})
            req = {"prompt": "the cache", "stream": True}
            async with session.post(base + "/v1/completions", json=req) as r:
                await r.content.readuntil(b"\n\n")  # placed on a, which hangs mid-stream
                await call("POST", "/warply/workers/b", {"enabled": True})
                status, body = await call("DELETE", "/warply/workers/a")
                assert status == 202
                assert body == {"name": "a", "in_flight": 1, "removed": False}
                for _ in range(3):  # a takes nothing new while it drains
                    status, body = await call("POST", "/v1/completions", {"prompt": "the cache"})
                    assert status == 200 and body["choices"][0]["text"] == "b"
                status, body = await call("POST", "/warply/workers/a", {"enabled": True})
                assert status == 409 and _is_error(body, "worker_leaving")
                _, listed = await call("GET", "/warply/workers")
                assert [w["leaving"] for w in listed["workers"]] == [True, False]
                # the engine back under a new name while its old entry drains
                again = {"name": "a2", "url": engines[0].url}
                status, _ = await call("POST", "/warply/pools/p/workers", again)
                assert status == 201
                assert len(engines[0].bodies) == 1
                engines[0].hang = False
                rest = await r.read()
                assert r.status == 200 and rest.endswith(b"data: [DONE]\n\n")
            await _until(lambda: "a" not in router.workers)
            _, listed = await call("GET", "/warply/workers")
            assert [w["name"] for w in listed["workers"]] == ["b", "a2"]
            assert await _held(router, "a", TOKENS) == 0
            _, stats = await call("GET", "/warply/cache_stats")
            assert set(stats["workers"]) == {"b", "a2"}
            _, text = await call("GET", "/metrics")
            assert 'worker="a"' not in text and 'warply_worker_healthy{worker="b"}' in text
            assert "a" not in (await router.index.stats()).overpredicted
            status, body = await call("DELETE", "/warply/workers/a")
            assert status == 404 and _is_error(body, "worker_not_found")

    _run(scenario())


def test_join_and_leave_need_the_token_and_valid_entries(tokenizer_dir: Path) -> None:  # noqa: F811
    async def scenario() -> None:
        engines = [FakeEngine("a"), FakeEngine("b")]
        async with running(tokenizer_dir, engines, auth_token="s3cret") as (
            router,
            call,
            _s,
            _b,
        ):
            url = "http://127.0.0.1:1"  # no engine: each join below is refused before a probe
            status, body = await call("POST", "/warply/pools/p/workers", {"name": "c", "url": url})
            assert status == 401 and _is_error(body, "invalid_api_key")
            status, _ = await call("DELETE", "/warply/workers/a")
            assert status == 401 and "a" in router.workers
            auth = {"headers": {"Authorization": "Bearer s3cret"}}

            async def join(pool: str, entry: object) -> tuple[int, dict[str, dict[str, str]]]:
                return await call("POST", f"/warply/pools/{pool}/workers", entry, **auth)

            status, body = await join("nope", {"name": "c", "url": url})
            assert status == 404 and _is_error(body, "pool_not_found")
            status, body = await join("p", {"name": "a", "url": url})
            assert status == 409 and body["error"]["param"] == "name"
            status, body = await join("p", {"name": "c", "url": engines[1].url + "/"})
            assert status == 409 and body["error"]["param"] == "url"
            assert body["error"]["message"] == f"worker 'b' has the url {engines[1].url}"
            for entry, field in (
                ({"url": url}, "name"),
                ({"name": "c", "url": "ftp://x"}, "url"),
                ({"name": "c", "url": url, "events": "nowhere"}, "events"),
                ({"name": "c", "url": url, "bogus": 1}, "bogus"),
                ({"name": "c\nd", "url": url}, "name"),  # a header and path segment later
            ):
                status, body = await join("p", entry)
                assert status == 400 and body["error"]["param"] == field, (entry, body)
            taken = {"name": "c", "url": url, "events": "tcp://192.0.2.1:5557", "bind": True}
            status, body = await join("p", taken)  # an address of no interface here: no bind
            assert status == 400 and body["error"]["param"] == "events"
            assert "c" not in router.workers and "c" not in router.feed.subscribers
            status, body = await join("p", {"name": "c", "url": url, "bootstrap_port": 9})
            assert status == 400 and "bootstrap_port" in body["error"]["message"]
            status, body = await join("p", [1])
            assert status == 400 and _is_error(body, "invalid_json")
            assert list(router.workers) == ["a", "b"]
            status, body = await call("DELETE", "/warply/workers/nope", **auth)
            assert status == 404 and _is_error(body, "worker_not_found")
            status, body = await call("DELETE", "/warply/workers/b?wait=yes", **auth)
            assert status == 400 and body["error"]["param"] == "wait"  # refused before leaving
            assert not router.workers["b"].leaving
            typo = {"enabled": False, "x": 1}
            status, body = await call("POST", "/warply/workers/b", typo, **auth)
            assert status == 400 and body["error"]["param"] == "x" and router.workers["b"].enabled
            status, body = await call("DELETE", "/warply/workers/b?wait=true", **auth)
            assert status == 200 and body == {"name": "b", "in_flight": 0, "removed": True}
            assert list(router.workers) == ["a"]

    _run(scenario())


def _gone(router: Router, name: str) -> Callable[[], bool]:
    return lambda: name not in router.workers


def test_workers_that_left_leave_nothing_behind(tokenizer_dir: Path) -> None:  # noqa: F811
    """Workers joining and leaving under new names, some refusing connections when they go:
    the router's per-worker state holds only the workers it has."""

    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")]) as (router, call, _s, _b):
            for n in range(6):
                name = f"gone-{n}"  # nothing listens there: refused at the health check
                body = {"name": name, "url": f"http://{HOST}:{free_port()}"}
                assert (await call("POST", "/warply/pools/p/workers", body))[0] == 201
                await router.check_health()
                assert (await call("DELETE", f"/warply/workers/{name}"))[0] == 202
                await _until(_gone(router, name))
            await router.check_health()
            assert router._down == set() and set(router.workers) == {"a"}
            assert set(router.health._workers) == {"a"}

    _run(scenario())
