"""`/warply/where` on the real router app with its real index, fed through the real state-stream
feed: holdings per worker and tier, the strategy's scores, the choice, and no side effects.
The engines are the small in-process simulators of tests/test_router_api.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_router_api import BS, FakeEngine, _is_error, _run, running, tokenizer_dir

from router.app import Router
from router.strategies import TierWeights
from router.tokenize import RouterTokenizer
from warply.protocol import BlockStored, DecodedBatch, Tier
from warply.protocol.api import Where

__all__ = ["tokenizer_dir"]  # the fixture, shared with tests/test_router_api.py

PROMPT = "the cache holds a prefix of tokens the cache holds a prefix"


async def feed(router: Router, worker: str, seq: int, event: BlockStored) -> None:
    """One batch into the router as its subscriber delivers it (decode → feed → index)."""
    await router.feed.on_batch(worker, DecodedBatch(seq, 0.0, [event], "warply"))


async def hold(router: Router, ids: list[int], a_blocks: int, b_blocks: int) -> None:
    """a holds `a_blocks` leading blocks on gpu, b `b_blocks` on cpu (engine hashes differ)."""
    await feed(router, "a", 1, BlockStored(list(range(1, a_blocks + 1)), None,
                                           ids[: a_blocks * BS], BS))  # fmt: skip
    await feed(router, "b", 1, BlockStored(list(range(50, 50 + b_blocks)), None,
                                           ids[: b_blocks * BS], BS, tier=Tier.CPU))  # fmt: skip


def test_where_shows_holdings_scores_and_the_choice(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a"), FakeEngine("b")]) as (
            router, call, session, base,
        ):  # fmt: skip
            ids = RouterTokenizer(tokenizer_dir).encode(PROMPT, True)
            full = len(ids) // BS
            await hold(router, ids, full, 2)
            async with session.get(base + "/warply/where", params={"prompt": PROMPT}) as r:
                assert r.status == 200
                where = msgspec.json.decode(await r.read(), type=Where)
            assert (where.model, where.strategy, where.prompt_tokens) == ("m", "adaptive", len(ids))
            assert where.choice is not None and where.unavailable == ""
            assert (where.choice.worker, where.choice.mode) == ("a", "aggregated")
            usable = (len(ids) - 1) // BS * BS
            assert where.choice.predicted_cached_tokens == min(full * BS, usable)
            (pool,) = where.pools
            assert (pool.name, pool.role, pool.block_size) == ("p", "both", BS)
            assert pool.strategy == "adaptive"
            assert pool.prompt_blocks == full and pool.pick == "a"
            a, b = pool.workers
            assert (a.name, a.blocks, a.blocks_by_tier, a.available) == (
                "a", full, {"gpu": full}, True
            )  # fmt: skip
            assert (b.name, b.blocks, b.blocks_by_tier, b.cached_tokens) == (
                "b", 2, {"cpu": 2}, 2 * BS
            )  # fmt: skip
            assert a.score is not None and b.score is not None
            assert a.score.key < b.score.key and a.score.rule == "lowest cost"
            assert a.score.terms["uncached_tokens"] < b.score.terms["uncached_tokens"]
            assert a.score.terms["cost"] == a.score.key[0]

            # No side effects: nothing booked or counted; asking again answers the same.
            again = await call("GET", f"/warply/where?prompt={PROMPT.replace(' ', '+')}")
            assert again == (200, msgspec.to_builtins(where))
            stats = await router.cache_stats()
            gauges = stats.strategy_state["p"].gauges
            assert stats.requests == 0 and gauges["placements"] == 0
            assert stats.strategy_state["p"].workers["routed_share"] == {}
            assert all(w.load.in_flight == 0 for w in router.workers.values())
            # ... and the request itself goes where /warply/where said.
            status, body = await call("POST", "/v1/completions", {"prompt": PROMPT})
            assert status == 200 and body["choices"][0]["text"] == "a"

    _run(scenario())


def test_where_takes_a_request_body_with_its_namespace(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        engines = [FakeEngine("a"), FakeEngine("b")]
        async with running(tokenizer_dir, engines, strategy={"name": "prefix_affinity"}) as (
            router, call, _s, _b,
        ):  # fmt: skip
            ids = RouterTokenizer(tokenizer_dir).encode(PROMPT, True)
            await hold(router, ids, 1, 2)
            status, body = await call("POST", "/warply/where", {"prompt": PROMPT})
            assert status == 200 and body["choice"]["worker"] == "b"
            scores = {w["name"]: w["score"] for w in body["pools"][0]["workers"]}
            assert scores["b"]["rule"] == "longest cached prefix"
            assert scores["b"]["terms"]["credit"] == pytest.approx(2 * TierWeights().cpu)
            # Another tenant's namespace: nothing held; the chat template's tokens are placed.
            chat = {"messages": [{"role": "user", "content": PROMPT}],
                    "warply": {"cache_key": "t1"}}  # fmt: skip
            status, body = await call("POST", "/warply/where", chat)
            assert status == 200 and body["namespace"] == "t1"
            assert body["prompt_tokens"] > len(ids)
            assert all(w["blocks"] == 0 for w in body["pools"][0]["workers"])
            rules = {w["score"]["rule"] for w in body["pools"][0]["workers"]}
            assert rules == {"new conversation: fewest started"}
            # An Anthropic Messages body (`?api=messages`): its system prompt is the chat's first
            # message, which the same body read as a chat completion would not have.
            message = {"system": "hold", "messages": [{"role": "user", "content": PROMPT}]}
            status, body = await call("POST", "/warply/where?api=messages", message)
            as_chat = {"messages": [{"role": "system", "content": "hold"}, *message["messages"]]}
            want, _, _ = await router.proxy.tokens(as_chat, "chat")
            assert status == 200 and body["prompt_tokens"] == len(want)
            status, body = await call("POST", "/warply/where?api=chat", message)
            assert status == 400 and _is_error(body, "invalid_value")
            # A misspelt parameter is refused, not ignored (the default namespace answered).
            status, body = await call("GET", "/warply/where?prompt=hi&cachekey=t1")
            assert status == 400 and _is_error(body, "invalid_value")
            error = body["error"]
            assert error["param"] == "cachekey" and "'cache_key'" in error["message"]
            status, body = await call("POST", "/warply/where?model=m", chat)
            assert status == 400 and _is_error(body, "invalid_value")

    _run(scenario())


def test_where_errors_auth_and_no_worker(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        engines = [FakeEngine("a"), FakeEngine("b")]
        async with running(tokenizer_dir, engines, auth_token="s3cret") as (router, call, _s, _b):
            good = {"Authorization": "Bearer s3cret"}
            status, body = await call("GET", "/warply/where?prompt=hi")
            assert status == 401 and _is_error(body, "invalid_api_key")
            status, body = await call("GET", "/warply/where", headers=good)
            assert status == 400 and _is_error(body, "invalid_prompt")
            status, body = await call("GET", "/warply/where?prompt=hi&model=x", headers=good)
            assert status == 404 and _is_error(body, "model_not_found")
            status, body = await call("POST", "/warply/where", {"messages": 3}, headers=good)
            assert status == 400 and _is_error(body, "invalid_prompt")
            for w in router.workers.values():
                w.enabled = False
            status, body = await call("GET", "/warply/where?prompt=hi", headers=good)
            assert status == 200 and body["choice"] is None
            assert body["unavailable"] == "no healthy worker is available"
            rows: list[dict[str, Any]] = body["pools"][0]["workers"]
            assert [(w["name"], w["available"], w["score"]) for w in rows] == [
                ("a", False, None), ("b", False, None),
            ]  # fmt: skip

    _run(scenario())
