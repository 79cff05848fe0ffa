"""The Responses API through the router, against the in-process fake engines of
test_router_api: placement by the chat a text input renders to, response ids that name their
worker (follow-ups, retrieval and cancel reach it), streams, usage. Real vLLM:
tests/vllm/test_router_integration.py and tests/vllm/test_chat_parity.py; SGLang's own
conversion: tests/sglang/test_chat_shape.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.responses import chat_view, event_usage, new_response_id, owner, worker_tag
from tests.test_router_api import (  # noqa: F401
    FakeEngine,
    _is_error,
    _run,
    running,
    tokenizer_dir,
)
from warply.protocol.api import CacheStats

TURNS = [
    {"role": "user", "content": "the cache holds"},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "a prefix"}]},
    {"role": "user", "content": [{"type": "input_text", "text": "of tokens"},
                                 {"type": "input_text", "text": "the prefix"}]},
]  # fmt: skip
CHAT = [
    {"role": "system", "content": "hold the cache"},
    {"role": "user", "content": "the cache holds"},
    {"role": "assistant", "content": [{"type": "text", "text": "a prefix"}]},
    {"role": "user", "content": [{"type": "text", "text": "of tokens"},
                                 {"type": "text", "text": "the prefix"}]},
]  # fmt: skip


def test_text_inputs_render_as_the_chat_both_engines_make_of_them() -> None:
    body = {"model": "m", "instructions": "hold the cache", "input": TURNS, "cache_salt": "k"}
    view = {"messages": CHAT, "model": "m", "cache_salt": "k", "add_special_tokens": False}
    assert chat_view(body, "sglang") == view
    said = {"role": "assistant", "content": "a prefix"}  # vLLM 0.32 keeps the text alone
    vllm = {**view, "messages": [*CHAT[:2], said, CHAT[3]], "add_special_tokens": True}
    assert chat_view(body) == vllm  # vLLM 0.32 adds special tokens; SGLang 0.5 does not
    hi = [{"role": "user", "content": "hi"}]
    assert chat_view({"input": "hi"}, "sglang") == {"messages": hi, "add_special_tokens": False}
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}
    unkeyed = [
        {"input": TURNS, "previous_response_id": "resp_x"},  # its history is the engine's
        {"input": TURNS[:2]},  # vLLM continues a final assistant message
        {"input": [*TURNS, call]},
        {"input": [image]},
        {"input": [{"role": "assistant", "content": []}, TURNS[0]]},
        {"input": [{"type": "function_call_output", "call_id": "c", "output": [image]}]},
        {"input": [{"type": "reasoning", "encrypted_content": "x"}, TURNS[0]]},
        {"input": [{**call, "namespace": 3}, TURNS[0]]},
        {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": 3},
                   TURNS[0]]},
        {"input": [{"type": "custom_tool_call_output", "call_id": "c", "output": [image]}]},
        {"input": TURNS, "tools": [{"type": "web_search"}]},  # built-in: not rendered
        {"input": TURNS, "tools": [{"type": "namespace", "name": "ns", "tools": ["x"]}]},
        {"input": TURNS, "tools": [{"type": "function", "name": "f"}, "x"]},
        {"input": []},
        {"input": 3},
        {"instructions": 3, "input": "hi"},
    ]
    assert [chat_view(b) for b in unkeyed] == [None] * len(unkeyed)
    # SGLang 0.5 converts its own way (tests/sglang/test_chat_shape.py checks it against its
    # code): developer messages labelled as system ones, consecutive assistant texts merged.
    dev = chat_view({"input": [{"role": "developer", "content": "x"}, *TURNS]}, "sglang")
    assert dev is not None and dev["messages"][0] == {
        "role": "system", "content": "Developer instructions:\nx"}  # fmt: skip
    twice = chat_view({"input": [TURNS[0], TURNS[1], TURNS[1], TURNS[2]]}, "sglang")
    assert twice is not None and twice["messages"][1] == {"role": "assistant", "content": [
        {"type": "text", "text": "a prefix"}, {"type": "text", "text": "a prefix"}]}  # fmt: skip
    tools = chat_view({"input": TURNS, "tools": [{"type": "function", "name": "f"}],
                       "reasoning": {}}, "sglang")  # fmt: skip
    assert tools is not None and tools["reasoning_effort"] == "medium"  # SGLang's default
    assert tools["tools"][0]["function"]["strict"] is False and tools["tool_choice"] == "auto"
    for body in ({"input": TURNS, "tools": [{"type": "web_search_preview"}]},
                 {"input": [image]}, {"input": TURNS, "reasoning": "low"}):  # fmt: skip
        assert chat_view(body, "sglang") is None


def test_an_agent_loop_renders_as_the_chat_vllm_makes_of_it() -> None:
    """vLLM 0.32 folds a turn's reasoning, text and function calls into one assistant message
    while each part is missing from it, and turns each call's output into a tool message."""
    said = {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "Looking."},
                        {"type": "output_text", "text": "ignored"}]}  # fmt: skip
    items = [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": "Where is block 7?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}]},
        said,
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"b": 7}'},
        {"type": "function_call", "call_id": "c2", "name": "tiers", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "cpu"},
        {"type": "function_call_output", "call_id": "c2", "output": "gpu, cpu"},
        {"type": "function_call", "call_id": "c3", "name": "lookup", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_2", "summary": [],
         "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "reasoning", "id": "rs_3", "summary": []},
        {"role": "assistant", "content": "Done."},
        {"role": "assistant", "content": "Again."},
        {"role": "user", "content": "And block 8?"},
    ]  # fmt: skip
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object"},
              "strict": True}]  # fmt: skip
    body = {"input": items, "tools": tools, "reasoning": {"effort": "low"}}
    calls = [{"id": c, "function": {"name": n, "arguments": a}, "type": "function"}
             for c, n, a in (("c1", "lookup", '{"b": 7}'), ("c2", "tiers", ""),
                             ("c3", "lookup", "{}"))]  # fmt: skip
    assert chat_view(body) == {
        "add_special_tokens": True,
        "messages": [
            {"role": "developer", "content": "Use the tools."},
            {"role": "user", "content": "Where is block 7?"},
            {"role": "assistant", "reasoning": "s", "content": "Looking.",
             "tool_calls": calls[:2]},
            {"role": "tool", "content": "cpu", "tool_call_id": "c1"},
            {"role": "tool", "content": "gpu, cpu", "tool_call_id": "c2"},
            {"role": "assistant", "tool_calls": calls[2:], "reasoning": "r"},
            {"role": "assistant", "reasoning": "", "content": "Done."},
            {"role": "assistant", "content": "Again."},
            {"role": "user", "content": "And block 8?"},
        ],
        "tools": [{"type": "function", "function": {
            "name": "lookup", "parameters": {"type": "object"}, "strict": True}}],
        "reasoning_effort": "low",
    }  # fmt: skip


def test_custom_and_namespaced_tools_render_as_the_shims_vllm_shows() -> None:
    """vLLM 0.32 shows a custom tool as a function taking one string (`input`) and calls to it
    as that function's calls; a namespace's function tools as functions named
    `NAMESPACE__NAME` (its custom tools not at all), and namespaced calls by that name."""
    items = [
        {"role": "user", "content": "Patch it."},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** é"},
        {"type": "function_call", "call_id": "c2", "name": "find", "namespace": "crm",
         "arguments": "{}"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
        {"role": "user", "content": "Thanks."},
    ]  # fmt: skip
    tools = [
        {"type": "custom", "name": "apply_patch", "description": "Edit files.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
        {"type": "namespace", "name": "crm", "description": "The CRM.", "tools": [
            {"type": "function", "name": "find", "parameters": {"type": "object"},
             "defer_loading": True},
            {"type": "custom", "name": "note"}]},
    ]  # fmt: skip
    view = chat_view({"input": items, "tools": tools})
    assert view is not None
    assert view["messages"][1] == {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "apply_patch", "arguments": '{"input": "*** é"}'}},
        {"id": "c2", "type": "function", "function": {"name": "crm__find", "arguments": "{}"}},
    ]}  # fmt: skip
    assert view["messages"][2] == {"role": "tool", "content": "done", "tool_call_id": "c1"}
    shim = view["tools"][0]["function"]
    assert shim["name"] == "apply_patch" and shim["description"] == "Edit files."
    assert shim["parameters"]["required"] == ["input"] and "format" not in shim
    assert view["tools"][1:] == [{"type": "function", "function": {
        "name": "crm__find", "parameters": {"type": "object"}, "defer_loading": True}}]  # fmt: skip


def test_a_response_id_names_its_worker_on_every_replica() -> None:
    made = new_response_id("engine-1")
    assert made.startswith("resp_" + worker_tag("engine-1")) and len(made) == 5 + 8 + 32
    assert owner(made, ["engine-0", "engine-1"]) == "engine-1"
    assert owner(made, ["engine-0"]) is None  # its worker left
    assert owner("resp_" + "0" * 40, ["engine-0", "engine-1"]) is None
    assert owner("chatcmpl-1", ["engine-1"]) is None
    assert new_response_id("engine-1") != made


def test_the_last_event_of_a_stream_holds_its_usage() -> None:
    usage = {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}}
    done = {"type": "response.completed", "response": {"id": "r", "usage": usage}}
    event = b"event: response.completed\ndata: " + msgspec.json.encode(done)
    assert event_usage(event) == (True, usage)
    assert event_usage(b"event: response.failed\ndata: {not json") == (True, None)
    assert event_usage(b"event: response.output_text.delta\ndata: {}") == (False, None)


def _stats(body: Any) -> CacheStats:
    return msgspec.convert(body, CacheStats)


def test_a_response_is_keyed_as_its_chat_and_answered_by_the_worker_its_id_names(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    async def scenario() -> None:
        engines = [FakeEngine(name, cached_tokens=4, max_model_len=4096) for name in "ab"]
        async with running(tokenizer_dir, engines) as (router, call, session, base):
            body = {"model": "m", "instructions": "hold the cache", "input": TURNS}
            tokens, _, _ = await router.proxy.tokens(dict(body), "responses")
            chat = {"model": "m", "messages": CHAT, "add_special_tokens": True}
            assert tokens == (await router.proxy.tokens(chat, "chat"))[0]  # as vLLM 0.32 does
            assert len(tokens) > 8
            status, where = await call("POST", "/warply/where", body)
            assert status == 200 and where["prompt_tokens"] == len(tokens), where

            async with session.post(base + "/v1/responses", json=body) as r:
                first, worker = await r.json(), r.headers["X-Warply-Worker"]
                assert r.status == 200 and int(r.headers["X-Warply-Predicted-Cached"]) >= 0
            engine = next(e for e in engines if e.name == worker)
            sent = engine.bodies[-1]
            assert sent["request_id"] == first["id"] and owner(first["id"], "ab") == worker
            assert "stream_options" not in sent and "warply" not in sent

            # Follow-ups go to the worker that stored the response, however loaded it is.
            other = next(e for e in engines if e.name != worker)
            router.workers[worker].load.in_flight = 5  # load alone would choose the other
            for _ in range(4):
                follow = {"model": "m", "input": "more", "previous_response_id": first["id"]}
                async with session.post(base + "/v1/responses", json=follow) as r:
                    assert r.status == 200 and r.headers["X-Warply-Worker"] == worker
            assert not other.bodies
            router.workers[worker].load.in_flight = 0

            status, got = await call("GET", f"/v1/responses/{first['id']}")
            assert status == 200 and got["engine"] == worker and got["id"] == first["id"]
            status, got = await call("POST", f"/v1/responses/{first['id']}/cancel")
            assert status == 200 and got["engine"] == worker
            # The engine's path is built from the id and the route; the query goes as it came.
            engine.paths.clear()
            query = "?stream=false&note=%0D%0AX-Evil:%201"
            status, _ = await call("GET", f"/v1/responses/{first['id']}{query}")
            assert status == 200 and engine.paths == [f"/v1/responses/{first['id']}{query}"]
            status, _ = await call("GET", "/v1/responses/a%2F..%2F..%2Fhealth")
            assert status == 404 and engine.paths[-1] == "/v1/responses/a%2F..%2F..%2Fhealth"

            # An id the client chose: each worker is asked until one holds it.
            own = {**body, "request_id": "resp_mine"}
            async with session.post(base + "/v1/responses", json=own) as r:
                holder = r.headers["X-Warply-Worker"]
                assert r.status == 200 and (await r.json())["id"] == "resp_mine"
            status, got = await call("GET", "/v1/responses/resp_mine")
            assert status == 200 and got["engine"] == holder
            status, got = await call("GET", "/v1/responses/resp_nowhere")
            assert status == 404 and "error" in got  # every engine's own 404

            status, got = await call("GET", "/warply/cache_stats")
            stats = _stats(got)
            assert stats.requests == 6 and stats.engine_cached_tokens == 6 * 4
            assert stats.placed_unkeyed == 4  # the follow-ups: their history is the engine's
            _, text = await call("GET", "/metrics")
            assert 'endpoint="v1/responses/{response_id}"' in text
            assert first["id"] not in text and "resp_mine" not in text

            router.workers[worker].enabled = False
            follow = {"input": "more", "previous_response_id": first["id"]}
            status, got = await call("POST", "/v1/responses", follow)
            assert status == 503 and _is_error(got, "no_healthy_worker")
            assert got["error"]["param"] == "previous_response_id" and worker in str(got)
            status, got = await call("GET", f"/v1/responses/{first['id']}")
            assert status == 503 and _is_error(got, "no_healthy_worker")

    _run(scenario())


def test_a_stored_response_streams_through_as_its_engine_sends_it(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    """`GET /v1/responses/{id}?stream=true` (a background response's events) is relayed event
    by event from the worker that stored it, not once the engine's stream has ended."""

    async def scenario() -> None:
        engines = [FakeEngine(name) for name in "ab"]
        async with running(tokenizer_dir, engines) as (router, call, session, base):
            async with session.post(base + "/v1/responses", json={"input": "hi"}) as r:
                first, worker = await r.json(), r.headers["X-Warply-Worker"]
            engine = next(e for e in engines if e.name == worker)
            engine.hang = True  # its stream stops after its first event
            async with session.get(f"{base}/v1/responses/{first['id']}?stream=true") as r:
                assert r.status == 200 and r.headers["X-Warply-Worker"] == worker
                assert r.content_type == "text/event-stream"
                head = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
                assert head.startswith(b"event: response.created")
                engine.hang = False
                rest = await asyncio.wait_for(r.content.read(), 5)
            assert rest.startswith(b"event: response.completed") and first["id"].encode() in rest
            status, got = await call("GET", f"/v1/responses/{first['id']}")
            assert status == 200 and got["id"] == first["id"]  # without stream: JSON as before

    _run(scenario())


def test_a_streamed_response_is_relayed_with_its_usage_and_first_output_timed(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    async def scenario() -> None:
        engine = FakeEngine("a", cached_tokens=8)
        async with running(tokenizer_dir, [engine]) as (router, call, session, base):
            body = {"input": "the cache", "stream": True, "warply": {"cache_key": "tenant"}}
            async with session.post(base + "/v1/responses", json=body) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                text = (await r.read()).decode()
            events = text.strip().split("\n\n")
            kinds = [e.split("\n")[0].removeprefix("event: ") for e in events]
            assert kinds == ["response.created", "response.in_progress",
                             "response.output_text.delta", "response.output_text.delta",
                             "response.completed"]  # fmt: skip
            done = json.loads(events[-1].split("data: ", 1)[1])
            assert done["response"]["id"] == engine.bodies[-1]["request_id"]
            sent = engine.bodies[-1]
            assert sent["cache_salt"] == "tenant" and "stream_options" not in sent
            status, got = await call("GET", "/warply/cache_stats")
            stats = _stats(got)
            assert stats.requests == 1 and stats.engine_cached_tokens == 8
            assert stats.ttft_s.n == 1

    _run(scenario())


def test_a_response_to_sglang_is_tokenized_as_its_chat(tokenizer_dir: Path) -> None:  # noqa: F811
    """SGLang 0.5 (its cards' `owned_by`) renders a response as its chat: no special tokens
    added to the template's text."""

    async def scenario() -> None:
        card = b'{"data": [{"id": "m", "max_model_len": 64, "owned_by": "sglang"}]}'
        async with running(tokenizer_dir, [FakeEngine("a", models=card)]) as (router, *_):
            body = {"instructions": "hold the cache", "input": TURNS}
            tokens, _, _ = await router.proxy.tokens(body, "responses")
            assert tokens == (await router.proxy.tokens({"messages": CHAT}, "chat"))[0]
            assert router.tokenizer.engine == "sglang"

    _run(scenario())


def test_an_sglang_fleet_keys_a_tool_loop_as_sglang_converts_it(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    """On an SGLang fleet a Responses tool loop is keyed as SGLang builds its chat: the
    developer message labelled, a call and its output, and, with a template that drops system
    messages after the first, every system text joined into the first by a blank line."""
    dropping = ("{% for m in messages %}{% if m.role != 'system' or loop.first %}[{{ m.role }}]"
                "{{ m.content }}{% endif %}{% endfor %}")  # fmt: skip
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    body = {"input": [{"role": "developer", "content": "x"}, TURNS[0], call,
                      {"type": "function_call_output", "call_id": "c", "output": "ok"},
                      {"role": "system", "content": "late"}, TURNS[2]],
            "tools": [{"type": "function", "name": "f"}]}  # fmt: skip
    chat = [{"role": "system", "content": "Developer instructions:\nx\n\nlate"}, TURNS[0],
            {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}, CHAT[3]]  # fmt: skip

    async def scenario() -> None:
        card = b'{"data": [{"id": "m", "max_model_len": 4096, "owned_by": "sglang"}]}'
        async with running(tokenizer_dir, [FakeEngine("a", models=card)],
                           chat_template=dropping) as (router, *_):  # fmt: skip
            tokens, _, _ = await router.proxy.tokens(body, "responses")
            assert tokens == (await router.proxy.tokens({"messages": chat}, "chat"))[0]

    _run(scenario())


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"input": "hi", "model": "x"}, 404, "model_not_found", "model"),
        ({"input": "hi", "previous_response_id": 3}, 400, "invalid_value", "previous_response_id"),
        ({"input": "hi", "max_output_tokens": -1}, 400, "invalid_value", "max_output_tokens"),
        ({"input": "hi", "request_id": ["x"]}, 400, "invalid_value", "request_id"),
        ({"input": "hi", "instructions": 3}, 400, "invalid_value", "instructions"),
        ({"model": "m"}, 400, "invalid_value", "input"),
        ({"input": [3]}, 400, "invalid_value", "input"),
        ({"input": "the cache " * 40}, 400, "context_length_exceeded", "input"),
        ({"input": ["x"] * 300}, 400, "too_many_messages", "input"),
        ({"input": "hi", "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400,
         "untrusted_chat_template", "chat_template"),
    ],
)  # fmt: skip
def test_bad_responses_are_openai_shaped_400s(
    tokenizer_dir: Path,  # noqa: F811
    body: dict[str, Any],
    status: int,
    code: str,
    param: str,
) -> None:
    async def scenario() -> None:
        engine = FakeEngine("a")
        async with running(tokenizer_dir, [engine], limits={"max_messages": 256}) as (
            _,
            call,
            _s,
            _b,
        ):
            got_status, got = await call("POST", "/v1/responses", body)
            assert (got_status, got["error"]["code"], got["error"]["param"]) == (
                status,
                code,
                param,
            )
            assert not engine.bodies
            # The engine cuts an input too long for the context itself when truncation is on.
            long = {"input": "the cache " * 40, "truncation": "auto"}
            assert (await call("POST", "/v1/responses", long))[0] == 200

    _run(scenario())
