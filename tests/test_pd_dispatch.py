"""P/D through the router against in-process fake engines on 127.0.0.1: the choice of the
prefill / decode pair, the kv_transfer_params round trip, conditional disaggregation, prefill
failures (local prefill on decode), decode failures (OpenAI-shaped errors, never a hang) and the
P/D metrics. Real engines: tests/vllm/test_pd_router.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from router.app import Router
from router.config import RouterConfig
from router.metrics import kv_transfer_stats
from router.responses import owner
from router.tokenize import RouterTokenizer
from tests.test_router_api import (  # noqa: F401
    BS,
    HOST,
    FakeEngine,
    _serve,
    cut_event,
    serve_engines,
    tokenizer_dir,
    usage_block,
)
from warply.protocol import BlockStored
from warply.protocol.api import CacheStats

PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2, 3],
    "remote_engine_id": "prefill-engine",
    "remote_request_id": "cmpl-1",
    "remote_host": HOST,
    "remote_port": 5600,
    "remote_prefill_cached_tokens": 8,
}
PROMPT = "the cache holds a prefix of tokens the cache holds a prefix of tokens"


@dataclass
class PdEngine(FakeEngine):
    """A fake vLLM engine with a KV connector: a prefill request (`do_remote_decode`) answers
    one token and `kv_transfer_params`; any other request is served (streamed if asked)."""

    behaviour: str = "ok"
    """ok | down (refuses connections) | status500 | hang | drop (closes the connection) |
    no_params (answers a prefill without kv_transfer_params) | die_midstream | hang_midstream |
    hang_on_pull (a decode engine whose KV never arrives: hangs on kv_transfer_params)"""
    params: dict[str, Any] = field(default_factory=lambda: dict(PARAMS))
    max_model_len: int = 4096
    worker: dict[str, Any] = field(default_factory=dict)
    """Extra fields of its worker in the router's config."""

    def __post_init__(self) -> None:
        self.down = self.behaviour == "down"

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        prefill = bool((body.get("kv_transfer_params") or {}).get("do_remote_decode"))
        if self.behaviour == "status500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        pulls = "kv_transfer_params" in body
        if self.behaviour == "hang" or (self.behaviour == "hang_on_pull" and pulls):
            await asyncio.sleep(3600)
        if self.behaviour == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(3600)
        remote = body.get("kv_transfer_params") or {}
        # vLLM: a decode after a hand-off reports the prefill engine's cache hit
        cached = self.cached_tokens if prefill else remote.get(
            "remote_prefill_cached_tokens", self.cached_tokens
        )
        usage = usage_block(17, 2, cached)
        out: dict[str, Any] = {"id": "x", "choices": [{"text": self.name}], "usage": usage}
        if prefill and self.behaviour != "no_params":
            out["kv_transfer_params"] = self.params
        return await self._reply(request, body, out)

    async def _reply(
        self, request: web.Request, body: dict[str, Any], out: dict[str, Any]
    ) -> web.StreamResponse:
        """`out` as JSON, or streamed ("a", "b", then usage if asked; `die_midstream` closes
        the connection after the first event, `hang_midstream` sends nothing more)."""
        if not body.get("stream"):
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in ("a", "b"):
            chunk = {"choices": [{"index": 0, "text": piece}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.behaviour == "die_midstream":
                assert request.transport is not None
                request.transport.close()
                await asyncio.sleep(3600)
            if self.behaviour == "hang_midstream":
                await asyncio.sleep(3600)
        if (body.get("stream_options") or {}).get("include_usage"):
            final = {"choices": [], "usage": out["usage"]}
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _pools(
    prefill: list[PdEngine], decode: list[PdEngine], both: list[PdEngine], kv_handoff: str
) -> list[dict[str, Any]]:
    pools: list[dict[str, Any]] = []
    for role, engines in (("prefill", prefill), ("decode", decode), ("both", both)):
        if engines:
            workers = [{"name": e.name, "url": e.url, **e.worker} for e in engines]
            pool = {"name": role, "role": role, "block_size": BS, "workers": workers}
            if role != "both":
                pool["kv_handoff"] = kv_handoff
            pools.append(pool)
    return pools


@asynccontextmanager
async def pd_router(
    tokenizer_dir: Path,  # noqa: F811
    prefill: list[PdEngine],
    decode: list[PdEngine],
    both: list[PdEngine] = (),  # type: ignore[assignment]
    kv_handoff: str = "vllm",
    **overrides: Any,
) -> AsyncIterator[tuple[Router, aiohttp.ClientSession, str]]:
    runners = await serve_engines([*prefill, *decode, *both])
    config = RouterConfig.model_validate(
        {
            "model": "m",
            "tokenizer": tokenizer_dir,
            "pools": _pools(prefill, decode, list(both), kv_handoff),
            "health_interval_s": 60,
            "pd": overrides.pop("pd", {"local_prefill_tokens": 0, "local_prefill_by": "threshold"}),
            **overrides,
        }
    )
    router = Router(config, RouterTokenizer(tokenizer_dir))
    router_runner, base = await _serve(router.app)
    for w in router.workers.values():
        w.set_health(True)  # as if their last probe passed (a "down" one fails on use)
    session = aiohttp.ClientSession()
    try:
        yield router, session, base
    finally:
        await session.close()
        await router_runner.cleanup()
        for runner in runners:
            await runner.cleanup()


async def _post(
    session: aiohttp.ClientSession, base: str, body: dict[str, Any]
) -> tuple[int, Any, Any]:
    async with session.post(base + "/v1/completions", json=body) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text), r.headers
        except ValueError:
            return r.status, text, r.headers


def _run(coro: Awaitable[None], timeout_s: float = 30) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))  # type: ignore[arg-type]


async def _stats(router: Router) -> CacheStats:
    return msgspec.json.decode(msgspec.json.encode(await router.cache_stats()), type=CacheStats)


def _is_error(body: Any) -> bool:
    return isinstance(body, dict) and set(body["error"]) == {"message", "type", "param", "code"}


# -- dispatch --------------------------------------------------------------------------------


def test_kv_transfer_params_round_trip(tokenizer_dir: Path) -> None:  # noqa: F811
    """Prefill gets do_remote_decode, one token, not streamed; decode gets what prefill
    returned; the client gets decode's answer (streamed too) with prefill's cache hit."""

    async def scenario() -> None:
        p, d = PdEngine("p", cached_tokens=8), PdEngine("d")
        async with pd_router(tokenizer_dir, [p], [d]) as (router, session, base):
            body = {"prompt": PROMPT, "max_tokens": 5, "min_tokens": 2, "temperature": 0}
            status, out, headers = await _post(session, base, body)
            assert status == 200 and out["choices"][0]["text"] == "d"
            assert headers["X-Warply-Mode"] == "remote"
            assert (headers["X-Warply-Worker"], headers["X-Warply-Prefill-Worker"]) == ("d", "p")
            sent = p.bodies[-1]
            assert sent["kv_transfer_params"] == {"do_remote_decode": True}
            assert (sent["max_tokens"], sent["stream"]) == (1, False)
            assert "min_tokens" not in sent and sent["prompt"] == PROMPT
            assert d.bodies[-1]["kv_transfer_params"] == PARAMS
            assert d.bodies[-1]["max_tokens"] == 5 and d.bodies[-1]["min_tokens"] == 2
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
            # an engine that leaves remote_prefill_cached_tokens out: the router adds it
            p.params = {k: v for k, v in PARAMS.items() if k != "remote_prefill_cached_tokens"}
            stream = {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}}
            async with session.post(base + "/v1/completions", json=stream) as r:
                assert r.status == 200 and r.headers["X-Warply-Mode"] == "remote"
                text = (await r.read()).decode()
            assert text.endswith("data: [DONE]\n\n") and '"cached_tokens": 8' in text
            assert "stream_options" not in p.bodies[-1] and p.bodies[-1]["stream"] is False
            assert d.bodies[-1]["kv_transfer_params"]["remote_prefill_cached_tokens"] == 8
            assert d.bodies[-1]["stream"] is True
            stats = await _stats(router)
            assert stats.pd is not None and stats.pd.decisions == {"remote": 2}
            assert stats.workers["p"].requests == 2
            assert stats.workers["p"].engine_cached_tokens == 16
            assert stats.workers["d"].requests == 0 and stats.workers["d"].handoffs == 2
            assert stats.roles["prefill"].engine_cached_tokens == 16
            assert stats.roles["decode"].handoffs == 2
            assert stats.engine_cached_tokens == 16, "what the client was told, twice"
            assert stats.pd.ttft.prefill_s.n == 2 and stats.pd.ttft.decode_first_token_s.n == 1
            for w in router.workers.values():
                assert (w.load.in_flight, w.load.in_flight_tokens) == (0, 0)
                assert w.load.pending_prefill_tokens == 0

    _run(scenario())


def test_a_response_is_prefilled_by_its_decode_worker(tokenizer_dir: Path) -> None:  # noqa: F811
    """vLLM's Responses API is not handed off: its decode worker computes the prompt
    (`local:responses`), and the response's id names that worker."""

    async def scenario() -> None:
        p, d = PdEngine("p"), PdEngine("d")
        async with pd_router(tokenizer_dir, [p], [d]) as (router, session, base):
            body = {"input": PROMPT, "max_output_tokens": 5}
            async with session.post(base + "/v1/responses", json=body) as r:
                assert r.status == 200 and r.headers["X-Warply-Mode"] == "local:responses"
                assert r.headers["X-Warply-Worker"] == "d"
            assert not p.bodies and "kv_transfer_params" not in d.bodies[-1]
            assert owner(d.bodies[-1]["request_id"], router.workers) == "d"
            stats = await _stats(router)
            assert stats.pd is not None and stats.pd.decisions == {"local:responses": 1}

    _run(scenario())


@pytest.mark.parametrize("behaviour", ["down", "status500", "hang", "drop", "no_params"])
def test_prefill_failure_falls_back_to_local_prefill(tokenizer_dir: Path, behaviour: str) -> None:  # noqa: F811
    reasons = {"down": "connect", "status500": "status_500", "hang": "timeout",
               "drop": "error", "no_params": "no_kv_transfer_params"}  # fmt: skip

    async def scenario() -> None:
        p, d = PdEngine("p", behaviour=behaviour), PdEngine("d", cached_tokens=4)
        pd = {"local_prefill_tokens": 0, "local_prefill_by": "threshold", "prefill_timeout_s": 0.5}
        async with pd_router(tokenizer_dir, [p], [d], pd=pd) as (router, session, base):
            status, out, headers = await _post(session, base, {"prompt": PROMPT})
            assert status == 200 and out["choices"][0]["text"] == "d"
            assert headers["X-Warply-Mode"] == "local:prefill_failed"
            assert "kv_transfer_params" not in d.bodies[-1], "the client's body, unchanged"
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
            stats = await _stats(router)
            assert stats.pd is not None
            assert stats.pd.decisions == {"local:prefill_failed": 1}
            assert stats.pd.prefill_failures == {reasons[behaviour]: 1}
            assert stats.workers["d"].requests == 1 and stats.workers["d"].handoffs == 0
            assert router.workers["p"].healthy == (behaviour != "down")
            for w in router.workers.values():
                assert (w.load.in_flight, w.load.pending_prefill_tokens) == (0, 0)
            if behaviour == "down":  # the next request goes local at once (p is unhealthy)
                status, _, headers = await _post(session, base, {"prompt": PROMPT})
                assert status == 200
                assert headers["X-Warply-Mode"] == "local:no_prefill_worker"

    _run(scenario())


@pytest.mark.parametrize("behaviour", ["down", "status500", "drop", "die_midstream"])
def test_decode_failure_is_an_openai_error(tokenizer_dir: Path, behaviour: str) -> None:  # noqa: F811
    async def scenario() -> None:
        p, d = PdEngine("p"), PdEngine("d", behaviour=behaviour)
        async with pd_router(tokenizer_dir, [p], [d]) as (router, session, base):
            stream = behaviour == "die_midstream"
            body = {"prompt": PROMPT, "stream": stream}
            async with session.post(base + "/v1/completions", json=body) as r:
                status, text = r.status, (await r.read()).decode()
            if behaviour == "status500":  # the engine's own error, passed through
                assert status == 500 and json.loads(text)["error"]["message"] == "boom"
            elif behaviour == "die_midstream":  # the stream had started: it ends with an error
                assert status == 200
                error = cut_event(text)
                assert _is_error({"error": error}) and error["code"] == 502
            else:
                body = json.loads(text)
                assert _is_error(body)
                # refused, or dropped before answering: placed again without d, and no decode
                # worker is left
                want = (503, "no_healthy_worker")
                assert (status, body["error"]["code"]) == want
            assert len(p.bodies) == 1, "the prefill ran once"
            for w in router.workers.values():
                assert (w.load.in_flight, w.load.pending_prefill_tokens) == (0, 0)

    _run(scenario())


async def cut_by_the_drain(router: Router, session: aiohttp.ClientSession, base: str) -> None:
    """A hand-off's stream whose decode engine stalls after its first event, when the stopping
    router's drain runs out: the stream still ends with the 503 error event and `[DONE]` (its
    decode leg runs in a task of its own: that task writes them)."""
    body = {"prompt": PROMPT, "stream": True}
    async with session.post(base + "/v1/completions", json=body) as r:
        assert r.status == 200 and r.headers["X-Warply-Mode"] == "remote"
        first = await r.content.readuntil(b"\n\n")
        assert b'"text": "a"' in first
        await router.app.shutdown()  # drain_timeout_s: 0
        error = cut_event((await r.read()).decode())
    assert (error["code"], error["message"]) == (503, "the router is shutting down")


def test_a_handed_off_stream_cut_by_the_drain_ends_with_an_error_event(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    async def scenario() -> None:
        p, d = PdEngine("p"), PdEngine("d", behaviour="hang_midstream")
        async with pd_router(tokenizer_dir, [p], [d], drain_timeout_s=0) as (router, s, base):
            await cut_by_the_drain(router, s, base)

    _run(scenario())


def test_a_prefill_worker_going_down_releases_its_legs(tokenizer_dir: Path) -> None:  # noqa: F811
    """A prefill worker unhealthy for `pd.lost_after_s` (its probe failed) while a prefill leg
    waits on it, or before the decode leg pulling its KV answers: each falls back to a local
    prefill on decode, long before any timeout."""

    async def scenario() -> None:
        p, d = PdEngine("p", behaviour="hang"), PdEngine("d", behaviour="hang_on_pull")
        pd = {"local_prefill_tokens": 0, "local_prefill_by": "threshold",
              "prefill_timeout_s": 300, "lost_after_s": 0.5}  # fmt: skip
        async with pd_router(tokenizer_dir, [p], [d], pd=pd) as (router, session, base):

            async def down_soon() -> None:
                await asyncio.sleep(0.3)
                router.workers["p"].set_health(False)

            for stream in (False, True):
                router.workers["p"].set_health(True)
                p.behaviour = "hang" if not stream else "ok"  # stream: the decode leg hangs
                body = {"prompt": PROMPT, "stream": stream}
                down = asyncio.ensure_future(down_soon())
                async with session.post(base + "/v1/completions", json=body) as r:
                    status, headers, text = r.status, r.headers, await r.text()
                await down
                assert status == 200 and headers["X-Warply-Mode"] == "local:prefill_failed"
                assert ("data: [DONE]" in text) == stream
                assert "kv_transfer_params" not in d.bodies[-1]
            assert "kv_transfer_params" in d.bodies[-2], "the abandoned decode leg"
            stats = await _stats(router)
            assert stats.pd is not None
            assert stats.pd.prefill_failures == {"worker_down": 1, "lost_before_decode": 1}
            for w in router.workers.values():
                assert (w.load.in_flight, w.load.pending_prefill_tokens) == (0, 0)

    _run(scenario(), timeout_s=20)


def test_a_refused_decode_is_retried_on_another_decode_worker(tokenizer_dir: Path) -> None:  # noqa: F811
    async def scenario() -> None:
        p, d0, d1 = PdEngine("p"), PdEngine("d0", behaviour="down"), PdEngine("d1")
        async with pd_router(tokenizer_dir, [p], [d0, d1]) as (router, session, base):
            results = [await _post(session, base, {"prompt": PROMPT}) for _ in range(2)]
            assert all(s == 200 and o["choices"][0]["text"] == "d1" for s, o, _ in results)
            assert not router.workers["d0"].healthy
            assert all(b["kv_transfer_params"] == PARAMS for b in d1.bodies)

    _run(scenario())


def test_conditional_disaggregation_threshold(tokenizer_dir: Path) -> None:  # noqa: F811
    """A prompt whose missing part on the decode worker is under the threshold is prefilled
    there; over it, it is handed off."""

    async def scenario() -> None:
        p, d = PdEngine("p"), PdEngine("d")
        tok = RouterTokenizer(tokenizer_dir)
        ids = tok.encode(PROMPT, True)
        n = len(ids) // BS * BS
        held = (len(ids) - 1) // BS * BS  # an engine always recomputes the last token
        pd = {"local_prefill_tokens": len(ids) - held + 1, "local_prefill_by": "threshold"}
        async with pd_router(tokenizer_dir, [p], [d], pd=pd) as (router, session, base):
            status, _, headers = await _post(session, base, {"prompt": PROMPT})
            assert status == 200 and headers["X-Warply-Mode"] == "remote"  # d holds nothing
            stored = BlockStored(list(range(1, n // BS + 1)), None, ids[:n], BS)
            await router.index.apply("d", [stored])  # d now holds every full block
            status, _, headers = await _post(session, base, {"prompt": PROMPT})
            assert status == 200 and headers["X-Warply-Mode"] == "local:below_threshold"
            assert len(p.bodies) == 1 and "kv_transfer_params" not in d.bodies[-1]
            # several choices cannot ride one hand-off: prefilled on decode
            await router.index.drop_worker("d")
            status, _, headers = await _post(session, base, {"prompt": PROMPT, "n": 2})
            assert status == 200 and headers["X-Warply-Mode"] == "local:batch"
            stats = await _stats(router)
            assert stats.pd is not None and stats.pd.local_prefill_tokens == pd[
                "local_prefill_tokens"
            ]
            assert stats.pd.decisions == {
                "remote": 1, "local:below_threshold": 1, "local:batch": 1
            }
            _, text = await _text(session, base + "/metrics")
            assert 'warply_router_pd_decisions_total{mode="remote",reason="remote"} 1.0' in text
            assert (
                'warply_router_pd_decisions_total{mode="local",reason="below_threshold"} 1.0'
                in text
            )

    _run(scenario())


def test_a_prefill_worker_answers_whole_when_the_strategy_picks_it(tokenizer_dir: Path) -> None:  # noqa: F811
    """`pd.prefill_answers`: a prefill worker holding the prompt is the strategy's pick among
    the decode and prefill workers; it gets the client's body unchanged (no
    kv_transfer_params; streamed if asked) and answers it; the mode is `on_prefill` in the
    header, cache_stats and /metrics. Buried in queued prefill, it loses to the decode worker,
    which takes the hand-off again."""

    async def scenario() -> None:
        p, d = PdEngine("p", cached_tokens=8), PdEngine("d")
        ids = RouterTokenizer(tokenizer_dir).encode(PROMPT, True)
        n = len(ids) // BS * BS
        pd = {"local_prefill_tokens": 0, "prefill_answers": True}
        async with pd_router(tokenizer_dir, [p], [d], pd=pd) as (router, session, base):
            await router.index.apply("p", [BlockStored(list(range(1, n // BS + 1)), None,
                                                       ids[:n], BS)])  # fmt: skip
            body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
            status, out, headers = await _post(session, base, body)
            assert status == 200 and out["choices"][0]["text"] == "p"
            assert (headers["X-Warply-Mode"], headers["X-Warply-Worker"]) == ("on_prefill", "p")
            assert "X-Warply-Prefill-Worker" not in headers
            assert p.bodies[-1] == body and d.bodies == []
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
            stream = {**body, "stream": True}
            async with session.post(base + "/v1/completions", json=stream) as r:
                assert r.status == 200 and r.headers["X-Warply-Mode"] == "on_prefill"
                assert (await r.read()).decode().endswith("data: [DONE]\n\n")
            sent = {k: v for k, v in p.bodies[-1].items() if k != "stream_options"}
            assert sent == stream and d.bodies == []  # the router asks any stream for usage
            stats = await _stats(router)
            assert stats.pd is not None and stats.pd.decisions == {"on_prefill": 2}
            assert stats.workers["p"].requests == 2 and stats.roles["prefill"].requests == 2
            _, text = await _text(session, base + "/metrics")
            assert 'warply_router_pd_decisions_total{mode="on_prefill",reason=""} 2.0' in text
            assert router.workers["p"].load.in_flight == 0  # its bookings given back
            router.workers["p"].load.pending_prefill_tokens = 100_000
            status, _, headers = await _post(session, base, body)
            assert status == 200 and headers["X-Warply-Mode"] == "remote"

    _run(scenario())


async def _text(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url) as r:
        return r.status, await r.text()


NIXL_METRICS = """# HELP vllm:nixl_bytes_transferred Histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="2048.0"} 0.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="tiny"} 3.3554432e+07
vllm:nixl_bytes_transferred_count{engine="0",model_name="tiny"} 2.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="tiny"} 0.25
vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 1.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="local"} 100.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="p2p"} 512.0
"""


def test_decode_engines_transfer_counters_reach_cache_stats_and_metrics(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    t = kv_transfer_stats(NIXL_METRICS)
    assert (t.transfers, t.bytes, t.seconds, t.failed, t.p2p_tokens) == (2, 33554432, 0.25, 1, 512)
    assert kv_transfer_stats("") == kv_transfer_stats("# nothing\nother 1\n")

    async def scenario() -> None:
        p, d = PdEngine("p"), PdEngine("d", metrics_text=NIXL_METRICS)
        async with pd_router(tokenizer_dir, [p], [d]) as (router, session, base):
            await router.check_health()
            stats = await _stats(router)
            assert stats.pd is not None and stats.pd.transfers["d"].bytes == 33554432
            assert "p" not in stats.pd.transfers, "only decode workers pull KV"
            _, text = await _text(session, base + "/metrics")
            assert 'warply_engine_kv_transfer_bytes{worker="d"} 3.3554432e+07' in text
            assert 'warply_engine_p2p_tokens{worker="d"} 512.0' in text

    _run(scenario())


def test_aggregated_only_deployments_have_no_pd_stats(tokenizer_dir: Path) -> None:  # noqa: F811
    async def scenario() -> None:
        a = PdEngine("a", cached_tokens=4)
        async with pd_router(tokenizer_dir, [], [], [a]) as (router, session, base):
            status, out, headers = await _post(session, base, {"prompt": PROMPT})
            assert status == 200 and headers["X-Warply-Mode"] == "aggregated"
            assert "kv_transfer_params" not in a.bodies[-1]
            stats = await _stats(router)
            assert stats.pd is None and stats.roles["both"].engine_cached_tokens == 4
            assert stats.pools["both"].hit_rate == 4 / stats.pools["both"].prompt_tokens

    _run(scenario())
