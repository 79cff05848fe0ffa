"""SGLang venv: the bodies the router sends both legs of an SGLang P/D hand-off
(`router.handoff.sglang.leg_body`, what `router.dispatch` sends) parsed by SGLang 0.5.23's own
request classes (OpenAI `CompletionRequest` / `ChatCompletionRequest`, and `GenerateReqInput`'s
spreading of the room over a batch's sequences), and compared with what SGLang's mini load
balancer sends (sglang-router 0.3.2, run in-process against fake servers on 127.0.0.1)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang_router import mini_lb, router_args

from router.config import WorkerConfig
from router.handoff.sglang import BOOTSTRAP_PORT, leg_body

PREFILL = WorkerConfig(name="p", url="http://127.0.0.1:30000", bootstrap_port=9001)
USAGE = {"stream_options": {"include_usage": True}}
"""What the proxy adds to a streamed request's body."""
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("completion", {"model": "m", "prompt": "Hello there", "max_tokens": 8, "temperature": 0}),
    ("completion", {"model": "m", "prompt": "Hi", "stream": True, **USAGE, "cache_salt": "t1"}),
    ("completion", {"model": "m", "prompt": ["one", "two"], "n": 2, "max_tokens": 4}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}),
    (
        "chat",
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True, **USAGE},
    ),
]
_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@pytest.mark.parametrize(("kind", "client"), BODIES)
def test_sglang_parses_the_legs_bodies(kind: str, client: dict[str, Any]) -> None:
    body = leg_body(client, PREFILL)
    cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
    parsed = cls.model_validate(dict(body))  # its "before" validators write into the dict
    assert (parsed.bootstrap_host, parsed.bootstrap_port) == ("127.0.0.1", 9001)
    assert parsed.bootstrap_room == body["bootstrap_room"]
    assert type(parsed.bootstrap_room) is int and 0 <= parsed.bootstrap_room < 2**63
    assert {k: v for k, v in body.items() if k not in _FIELDS} == client, "the rest unchanged"
    default = leg_body(client, WorkerConfig(name="q", url="http://[::1]:30000"))
    assert cls.model_validate(dict(default)).bootstrap_host == "::1"  # SGLang adds the brackets
    assert default["bootstrap_port"] == BOOTSTRAP_PORT


def test_sglang_spreads_the_room_over_a_batch() -> None:
    """Completions with two prompts and n=2 become four sequences; SGLang gives them rooms
    room + i, all still int64 (the router draws rooms below 2**63 - 2**20)."""
    body = leg_body({"prompt": ["one", "two"], "n": 2}, PREFILL)
    req = GenerateReqInput(
        text=body["prompt"],
        sampling_params={"n": body["n"], "max_new_tokens": 4},
        **{k: body[k] for k in _FIELDS},
    )
    req.normalize_batch_and_arguments()
    room = body["bootstrap_room"]
    assert req.bootstrap_room == [room, room + 1, room + 2, room + 3]
    assert req.bootstrap_host == ["127.0.0.1"] * 4 and req.bootstrap_port == [9001] * 4
    assert all(r < 2**63 for r in req.bootstrap_room)


async def _capture(bodies: list[dict[str, Any]]) -> tuple[web.AppRunner, str]:
    async def generate(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.json_response({"id": "x", "choices": [{"text": "t"}]})

    app = web.Application()
    app.add_routes(
        [web.post(path, generate) for path in ("/v1/completions", "/v1/chat/completions")]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.mark.parametrize(("kind", "client"), [b for b in BODIES if not b[1].get("stream")])
def test_the_router_sends_what_sglangs_mini_lb_sends(kind: str, client: dict[str, Any]) -> None:
    """SGLang's mini LB, given the client's body, sends prefill and decode the same body with
    scalar bootstrap fields; the router's legs have the same fields, types and rest."""

    async def scenario() -> None:
        prefill: list[dict[str, Any]] = []
        decode: list[dict[str, Any]] = []
        (p_runner, p_url), (d_runner, d_url) = await _capture(prefill), await _capture(decode)
        try:
            args = router_args.RouterArgs(
                mini_lb=True,
                pd_disaggregation=True,
                prefill_urls=[(p_url, 9001)],
                decode_urls=[d_url],
                policy="random",
            )
            mini_lb.lb = mini_lb.MiniLoadBalancer(args)
            handler = (
                mini_lb.handle_chat_completion_request
                if kind == "chat"
                else mini_lb.handle_completion_request
            )
            resp = await asyncio.wait_for(handler(dict(client)), 30)
            assert resp.status_code == 200
        finally:
            await p_runner.cleanup()
            await d_runner.cleanup()
        assert prefill == decode and len(decode) == 1
        theirs = decode[0]
        ours = leg_body(client, WorkerConfig(name="p", url=p_url, bootstrap_port=9001))
        assert set(ours) == set(theirs)
        for key in ours:
            if key != "bootstrap_room":
                assert ours[key] == theirs[key], key
        assert type(ours["bootstrap_room"]) is type(theirs["bootstrap_room"]) is int

    asyncio.run(scenario())
