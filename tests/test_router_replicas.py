"""Two `Router` apps of one deployment (a shared index and bookings on a real redis-server on
127.0.0.1) over the same fake engines: a request in flight through one replica weighs on the
other's next choice; with `share_load: false` it does not."""

from __future__ import annotations

import itertools
from pathlib import Path

from test_router_api import FakeEngine, _run, _serve, running, tokenizer_dir

from router.app import Router
from router.tokenize import RouterTokenizer
from warply.launch import RedisServer

__all__ = ["tokenizer_dir"]  # the fixture, from the router API tests
_prefixes = itertools.count()


async def _second_choice(tokenizer_dir: Path, url: str, share: bool) -> tuple[str, str]:
    """Replica one streams a request that stays in flight (its engine hangs after the first
    chunk); replica two then places a new one. (worker of the first, worker of the second)."""
    engines = [FakeEngine("a", hang=True), FakeEngine("b", hang=True)]
    index = {"store": "redis", "url": url, "prefix": f"r{next(_prefixes)}", "share_load": share}
    strategy = {"name": "prefix_affinity"}
    async with running(tokenizer_dir, engines, index=index, strategy=strategy) as (
        one, _, session, base
    ):
        two = Router(one.config, RouterTokenizer(tokenizer_dir))
        runner, base_two = await _serve(two.app)
        try:
            body = {"model": "m", "prompt": "first conversation", "max_tokens": 2, "stream": True}
            async with session.post(base + "/v1/completions", json=body) as streaming:
                first = streaming.headers["X-Warply-Worker"]
                await streaming.content.readline()  # its first chunk: in flight, prefilled
                await one.ledger.flush()
                body = {"model": "m", "prompt": "second conversation", "max_tokens": 2}
                async with session.post(base_two + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    second = (await resp.json())["choices"][0]["text"]
                for e in engines:
                    e.hang = False
        finally:
            await runner.cleanup()
    return first, second


def test_a_replica_places_around_another_replicas_request_in_flight(
    tokenizer_dir: Path, redis_server: RedisServer
) -> None:
    async def run() -> None:
        first, second = await _second_choice(tokenizer_dir, redis_server.url, share=True)
        assert second != first, "the other replica's request counted on its worker"
        first, second = await _second_choice(tokenizer_dir, redis_server.url, share=False)
        assert second == first, "alone, each replica sees both workers idle (ties: in turn)"

    _run(run())
