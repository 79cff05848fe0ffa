"""SGLang P/D through the router against in-process fake engines on 127.0.0.1: one body with
bootstrap_host / bootstrap_port / bootstrap_room to the prefill and the decode worker at once,
decode's answer relayed (JSON and SSE), prefill failures (placed again without that prefill
worker; an OpenAI error when none is left: an SGLang decode server cannot prefill alone), decode
failures (OpenAI errors), never a hang. Against SGLang's own request classes:
tests/sglang/test_pd_bodies.py."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from router.handoff.sglang import BOOTSTRAP_PORT
from router.responses import owner
from tests.test_pd_dispatch import (
    PROMPT,
    PdEngine,
    _is_error,
    _post,
    _run,
    _stats,
    cut_by_the_drain,
    pd_router,
)
from tests.test_router_api import HOST, tokenizer_dir, usage_block  # noqa: F401

_ROOM_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass
class _Room:
    """One transfer as the fake engines see it: decode arrived (SGLang's prefill waits for the
    decode's handshake before it sends), then the KV was sent."""

    decode_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    kv_sent: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class SglangEngine(PdEngine):
    """A fake SGLang server in disaggregation mode (`mode` prefill or decode). Like SGLang
    0.5.23, a request without `bootstrap_room` is refused with 400; the prefill answers (one
    token) once the decode worker has joined the room and the KV is sent; the decode waits for
    the KV, then answers (streamed if asked). So a router that sends the legs one after the
    other never gets an answer.

    behaviour: ok | down | status500 | status400 | hang | drop | die_midstream |
    hang_midstream"""

    mode: str = "decode"
    """prefill | decode | both (aggregated: serves plain requests)"""
    rooms: dict[int, _Room] = field(default_factory=dict)
    """Shared by a deployment's engines (the fake transfer)."""

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.mode == "both":  # an aggregated server
            return await self._answer(request, body)
        if body.get("bootstrap_room") is None:  # srt/managers/scheduler.py, 0.5.23
            message = "Invalid request: Disaggregated request received without bootstrap room id."
            return web.json_response({"error": {"message": message}}, status=400)
        if self.behaviour in ("status500", "status400"):
            status = int(self.behaviour[-3:])
            return web.json_response({"error": {"message": "boom"}}, status=status)
        if self.behaviour == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(3600)
        room = self.rooms.setdefault(body["bootstrap_room"], _Room())
        try:
            if self.behaviour == "hang":
                await asyncio.sleep(3600)
            if self.mode == "prefill":
                await room.decode_arrived.wait()
                room.kv_sent.set()
            else:
                room.decode_arrived.set()
                await room.kv_sent.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return await self._answer(request, body)

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        usage = usage_block(17, 1 if self.mode == "prefill" else 2, self.cached_tokens)
        out = {"id": "x", "choices": [{"text": self.name}], "usage": usage}
        return await self._reply(request, body, out)


def _pair(
    prefill: list[tuple[str, str]], decode: str = "ok", **worker: Any
) -> tuple[list[SglangEngine], SglangEngine]:
    """Prefill engines [(name, behaviour)] and one decode engine "d", sharing their rooms."""
    rooms: dict[int, _Room] = {}
    ps = [
        SglangEngine(
            n, behaviour=b, mode="prefill", rooms=rooms, worker=dict(worker), cached_tokens=8
        )
        for n, b in prefill
    ]
    return ps, SglangEngine("d", behaviour=decode, mode="decode", rooms=rooms)


def _no_load(router: Any) -> None:
    for w in router.workers.values():
        assert (w.load.in_flight, w.load.in_flight_tokens, w.load.pending_prefill_tokens) == (
            0,
            0,
            0,
        )


def test_both_legs_get_one_bootstrap_room_at_once(tokenizer_dir: Path) -> None:  # noqa: F811
    """The same body with the prefill worker's bootstrap host / port and one new room goes to
    both workers; they must run at the same time (the fake prefill answers only after decode
    joined the room); the client gets decode's answer, JSON or streamed."""

    async def scenario() -> None:
        (p,), d = _pair([("p", "ok")], bootstrap_port=9001)
        pd = {"local_prefill_tokens": 10**6, "prefill_timeout_s": 5}  # SGLang never goes local
        async with pd_router(tokenizer_dir, [p], [d], kv_handoff="sglang", pd=pd) as (
            router,
            session,
            base,
        ):
            body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
            status, out, headers = await _post(session, base, body)
            assert status == 200 and out["choices"][0]["text"] == "d"
            assert headers["X-Warply-Mode"] == "remote"
            assert (headers["X-Warply-Worker"], headers["X-Warply-Prefill-Worker"]) == ("d", "p")
            sent_p, sent_d = p.bodies[-1], d.bodies[-1]
            assert sent_p == sent_d, "one body to both legs"
            assert (sent_d["bootstrap_host"], sent_d["bootstrap_port"]) == (HOST, 9001)
            assert (
                isinstance(sent_d["bootstrap_room"], int) and 0 <= sent_d["bootstrap_room"] < 2**63
            )
            assert {k: v for k, v in sent_d.items() if k not in _ROOM_FIELDS} == body
            stream = {"prompt": PROMPT, "stream": True}
            async with session.post(base + "/v1/completions", json=stream) as r:
                assert r.status == 200 and r.headers["X-Warply-Mode"] == "remote"
                text = (await r.read()).decode()
            assert text.endswith("data: [DONE]\n\n") and '"text": "a"' in text
            assert '"usage"' not in text, "the usage chunk the router asked for is hidden"
            assert p.bodies[-1] == d.bodies[-1] and d.bodies[-1]["stream"] is True
            assert d.bodies[-1]["bootstrap_room"] != sent_d["bootstrap_room"], "a room a request"
            # n > 1 rides one hand-off (SGLang gives each sequence room + i)
            status, _, headers = await _post(session, base, {"prompt": PROMPT, "n": 2})
            assert status == 200 and headers["X-Warply-Mode"] == "remote"
            stats = await _stats(router)
            assert stats.pd is not None and stats.pd.decisions == {"remote": 3}
            assert not stats.pd.prefill_failures
            assert stats.workers["p"].engine_cached_tokens == 24, "prefill's usage, JSON and SSE"
            assert stats.workers["d"].handoffs == 3 and stats.pd.ttft.prefill_s.n == 3
            _no_load(router)

    _run(scenario())


def test_a_response_goes_to_both_legs_named_for_its_decode_worker(tokenizer_dir: Path) -> None:  # noqa: F811
    """SGLang 0.5's Responses API takes the bootstrap fields: a response rides the hand-off as
    a completion does, one body to both legs, its id naming the decode worker that answers."""

    async def scenario() -> None:
        (p,), d = _pair([("p", "ok")])
        pd = {"local_prefill_tokens": 10**6, "prefill_timeout_s": 5}
        async with pd_router(tokenizer_dir, [p], [d], kv_handoff="sglang", pd=pd) as (
            router,
            session,
            base,
        ):
            async with session.post(base + "/v1/responses", json={"input": PROMPT}) as r:
                assert r.status == 200 and r.headers["X-Warply-Mode"] == "remote"
                answer = await r.json()
            assert p.bodies[-1] == d.bodies[-1] and d.bodies[-1]["bootstrap_room"] is not None
            assert p.bodies[-1]["request_id"] == answer["id"]
            assert owner(answer["id"], router.workers) == "d"

    _run(scenario())


def test_bootstrap_defaults_to_the_url_host_and_sglang_port(tokenizer_dir: Path) -> None:  # noqa: F811
    async def scenario() -> None:
        (p,), d = _pair([("p", "ok")])
        async with pd_router(tokenizer_dir, [p], [d], kv_handoff="sglang") as (_, session, base):
            assert (await _post(session, base, {"prompt": PROMPT}))[0] == 200
            sent = d.bodies[-1]
            assert (sent["bootstrap_host"], sent["bootstrap_port"]) == (HOST, BOOTSTRAP_PORT)
        (p,), d = _pair([("p", "ok")], bootstrap_host="10.0.0.7")
        async with pd_router(tokenizer_dir, [p], [d], kv_handoff="sglang") as (_, session, base):
            p.rooms.clear()
            assert (await _post(session, base, {"prompt": PROMPT}))[0] == 200
            assert d.bodies[-1]["bootstrap_host"] == "10.0.0.7"

    _run(scenario())


@pytest.mark.parametrize("behaviour", ["down", "status500", "hang", "drop"])
def test_a_failed_prefill_is_placed_again_on_another_prefill_worker(
    tokenizer_dir: Path,  # noqa: F811
    behaviour: str,
) -> None:
    """p0 fails its leg before decode answered: the decode leg is ended and the request goes
    to the pair (d, p1) with a new room; the failure is counted."""
    reasons = {"down": "connect", "status500": "status_500", "hang": "timeout", "drop": "error"}

    async def scenario() -> None:
        (p0, p1), d = _pair([("p0", behaviour), ("p1", "ok")])
        pd = {"local_prefill_tokens": 0, "prefill_timeout_s": 0.5}
        async with pd_router(
            tokenizer_dir,
            [p0, p1],
            [d],
            kv_handoff="sglang",
            pd=pd,
            strategy={"name": "round_robin"},
        ) as (router, session, base):
            status, out, headers = await _post(session, base, {"prompt": PROMPT})
            assert status == 200 and out["choices"][0]["text"] == "d"
            assert headers["X-Warply-Prefill-Worker"] == "p1"
            assert len(d.bodies) == 2 and d.cancelled.is_set(), "the first decode leg ended"
            assert d.bodies[-1] == p1.bodies[-1]
            assert d.bodies[0]["bootstrap_room"] != d.bodies[1]["bootstrap_room"]
            stats = await _stats(router)
            assert stats.pd is not None and stats.pd.decisions == {"remote": 1}
            assert stats.pd.prefill_failures == {reasons[behaviour]: 1}
            assert router.workers["p0"].healthy == (behaviour != "down")
            _no_load(router)

    _run(scenario())


def test_no_prefill_worker_left_is_an_openai_error(tokenizer_dir: Path) -> None:  # noqa: F811
    """The only prefill worker fails (or is lost): an SGLang decode server refuses a request
    without a bootstrap room, so the client gets a 503, quickly, and the decode leg ends."""

    async def scenario() -> None:
        (p,), d = _pair([("p", "hang")])
        pd = {"local_prefill_tokens": 0, "prefill_timeout_s": 300, "lost_after_s": 0.3}
        async with pd_router(tokenizer_dir, [p], [d], kv_handoff="sglang", pd=pd) as (
            router,
            session,
            base,
        ):

            async def down_soon() -> None:
                await asyncio.sleep(0.3)
                router.workers["p"].set_health(False)

            down = asyncio.ensure_future(down_soon())
            status, out, _ = await _post(session, base, {"prompt": PROMPT, "stream": True})
            await down
            assert status == 503 and _is_error(out)
            assert "decode workers cannot prefill alone" in out["error"]["message"]
            assert d.cancelled.is_set() and len(d.bodies) == 1
            assert all("bootstrap_room" in b for b in d.bodies), "never a plain request"
            stats = await _stats(router)
            assert stats.pd is not None and stats.pd.prefill_failures == {"worker_down": 1}
            _no_load(router)

    _run(scenario(), timeout_s=20)


def test_a_prefill_refusing_the_request_answers_the_client(tokenizer_dir: Path) -> None:  # noqa: F811
    async def scenario() -> None:
        (p,), d = _pair([("p", "status400")])
        async with pd_router(tokenizer_dir, [p], [d], kv_handoff="sglang") as (
            router,
            session,
            base,
        ):
            status, out, headers = await _post(session, base, {"prompt": PROMPT})
            assert status == 400 and out["error"]["message"] == "boom"
            assert headers["X-Warply-Prefill-Worker"] == "p"
            assert d.cancelled.is_set()
            stats = await _stats(router)
            assert stats.pd is not None and stats.pd.prefill_failures == {"status_400": 1}
            _no_load(router)

    _run(scenario())


@pytest.mark.parametrize("behaviour", ["down", "status500", "drop", "die_midstream"])
def test_decode_failure_is_an_openai_error(tokenizer_dir: Path, behaviour: str) -> None:  # noqa: F811
    async def scenario() -> None:
        (p,), d = _pair([("p", "ok")], decode=behaviour)
        pd = {"local_prefill_tokens": 0, "prefill_timeout_s": 2}
        async with pd_router(tokenizer_dir, [p], [d], kv_handoff="sglang", pd=pd) as (
            router,
            session,
            base,
        ):
            stream = behaviour == "die_midstream"
            async with session.post(
                base + "/v1/completions", json={"prompt": PROMPT, "stream": stream}
            ) as r:
                status, text = r.status, (await r.read()).decode()
            if behaviour == "status500":  # the engine's own error, passed through
                assert status == 500 and json.loads(text)["error"]["message"] == "boom"
            elif behaviour == "die_midstream":  # the stream had started: it ends with an error
                events = [e for e in text.split("\n\n") if e]
                assert status == 200 and events[-1] == "data: [DONE]"
                assert _is_error(json.loads(events[-2][6:]))
            else:
                body = json.loads(text)  # refused or dropped: placed again without d, none left
                want = (503, "no_healthy_worker")
                assert _is_error(body) and (status, body["error"]["code"]) == want
            # a refused decode connection can end the pair before its prefill leg was written
            sent = {0, 1} if behaviour == "down" else {1}
            assert len(p.bodies) in sent, "the prefill leg ran at most once"
            _no_load(router)

    _run(scenario())


def test_without_a_prefill_worker_an_aggregated_pool_answers(tokenizer_dir: Path) -> None:  # noqa: F811
    """An SGLang decode pool competes only while a prefill worker is available."""

    async def scenario() -> None:
        (p,), d = _pair([("p", "ok")])
        a = SglangEngine("a", mode="both")
        async with pd_router(tokenizer_dir, [p], [d], [a], kv_handoff="sglang") as (
            router,
            session,
            base,
        ):
            router.workers["p"].set_health(False)
            status, out, headers = await _post(session, base, {"prompt": PROMPT})
            assert status == 200 and out["choices"][0]["text"] == "a" and not d.bodies
            assert headers["X-Warply-Mode"] == "aggregated"
            assert "bootstrap_room" not in a.bodies[-1]

    _run(scenario())


def test_a_paired_stream_cut_by_the_drain_ends_with_an_error_event(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    async def scenario() -> None:
        (p,), d = _pair([("p", "ok")], decode="hang_midstream")
        pd = {"local_prefill_tokens": 10**6}
        async with pd_router(
            tokenizer_dir, [p], [d], kv_handoff="sglang", pd=pd, drain_timeout_s=0
        ) as (router, session, base):
            await cut_by_the_drain(router, session, base)

    _run(scenario())
