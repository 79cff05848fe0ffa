"""The Anthropic Messages API through the router: the chat vLLM 0.32 converts a body to
(`router.messages.chat_view`, checked field by field against vLLM's conversion rules), and the
router's path against the in-process fake engines of test_router_api: keyed as that chat, sent
as it came, streams relayed with their usage and first event timed, errors in Anthropic's shape.
Real vLLM: tests/vllm/test_chat_parity.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.chat_shape import PromptError
from router.messages import (
    chat_view,
    disabled_effort,
    error_event,
    event_usage,
    merges_inline_system,
    openai_usage,
    rejects_inline_system,
)
from router.messages_sglang import renders_inline_system
from tests.test_router_api import (  # noqa: F401
    FakeEngine,
    _run,
    running,
    tokenizer_dir,
)
from warply.protocol.api import CacheStats

TOOLS = [{"name": "lookup", "description": "find a block",
          "input_schema": {"properties": {"block": {"type": "integer"}}}}]  # fmt: skip
AGENT: dict[str, Any] = {
    "model": "m",
    "max_tokens": 8,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=ab12"},
               {"type": "text", "text": "You route "}, {"type": "text", "text": "requests."}],
    "messages": [
        {"role": "user", "content": "Where is block 7?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look it up", "signature": "s"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"block": 7}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "text", "text": "cpu"}, {"type": "text", "text": "tier 2"}]},
            {"type": "text", "text": "And block 8?"}]},
    ],
    "tools": TOOLS,
}  # fmt: skip
AGENT_CHAT = [
    {"role": "system", "content": "You route requests."},
    {"role": "user", "content": "Where is block 7?"},
    {"role": "assistant", "reasoning": "look it up", "content": "Looking.", "tool_calls": [
        {"id": "t1", "type": "function",
         "function": {"name": "lookup", "arguments": '{"block": 7}'}}]},
    {"role": "tool", "tool_call_id": "t1", "content": "cpu\ntier 2"},
    {"role": "user", "content": "And block 8?"},
]  # fmt: skip


def _never() -> Any:
    raise AssertionError("not asked for a body that does not need it")


def _view(body: dict[str, Any], merge: bool = False, effort: str = "none") -> Any:
    return chat_view(body, None, lambda: merge, lambda: effort)


def test_an_agent_turn_converts_as_vllm_converts_it() -> None:
    """System blocks joined without Claude Code's billing header; thinking as the reasoning,
    text, tool use as a call with its input as JSON; a user's tool result as a tool message
    before its text; tools as function tools with `input_schema`'s default type, choice auto."""
    view = chat_view(AGENT, None, _never, _never)
    assert view == {
        "messages": AGENT_CHAT, "model": "m", "tool_choice": "auto",
        "tools": [{"type": "function", "function": {
            "name": "lookup", "description": "find a block",
            "parameters": {"properties": {"block": {"type": "integer"}}, "type": "object"},
            "strict": None, "defer_loading": None}}],
    }  # fmt: skip
    assert [list(m) for m in view["messages"]][2] == ["role", "reasoning", "tool_calls",
                                                      "content"]  # fmt: skip


@pytest.mark.parametrize(
    ("choice", "want"),
    [({"type": "any"}, "required"), ({"type": "none"}, "none"),
     ({"type": "tool", "name": "lookup"}, {"type": "function", "function": {"name": "lookup"}})],
)  # fmt: skip
def test_the_tool_choice_converts_as_vllm_converts_it(choice: Any, want: Any) -> None:
    assert _view({**AGENT, "tool_choice": choice})["tool_choice"] == want


def test_inline_system_messages_stay_or_join_the_first_as_the_template_needs() -> None:
    body = {"system": "Lead.", "messages": [
        {"role": "user", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
        {"role": "system", "content": "x-anthropic-billing-header: x"},
        {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
        {"role": "assistant", "content": []},
    ]}  # fmt: skip
    kept = [{"role": "system", "content": "Lead."}, {"role": "user", "content": "a"},
            {"role": "system", "content": "Reminder."},
            {"role": "user", "content": [{"type": "text", "text": "b"},
                                         {"type": "text", "text": "c"}]},
            {"role": "assistant"}]  # fmt: skip
    assert _view(body, merge=False)["messages"] == kept
    merged = [{"role": "system", "content": "Lead.Reminder."}] + kept[1:2] + kept[3:]
    assert _view(body, merge=True)["messages"] == merged
    # The probe runs only when there is an inline system message.
    assert chat_view({"messages": [{"role": "user", "content": "a"}]}, None, _never, _never)


def test_thinking_and_effort_set_the_reasoning_effort_as_vllm_sets_it() -> None:
    base = {"messages": [{"role": "user", "content": "a"}]}
    assert "reasoning_effort" not in _view({**base, "thinking": {"type": "enabled",
                                                                 "budget_tokens": 2048}})
    assert _view({**base, "output_config": {"effort": "high"}})["reasoning_effort"] == "high"
    assert _view({**base, "thinking": {"type": "disabled"}}, effort="low")["reasoning_effort"] \
        == "low"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}],
        [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                       "content": [{"type": "image", "source": {}}]}]}],
        [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}],
        [{"role": "assistant", "content": [{"type": "tool_result", "content": "x"}]}],
        [{"role": "system", "content": [{"type": "tool_addition", "tool": {}}]},
         {"role": "user", "content": "a"}],
        [{"role": "user", "content": [{"type": "text", "text": 7}]}],
        [{"role": "tool", "content": "a"}],
        "not a list",
        [],
    ],
)
def test_what_the_router_cannot_follow_is_placed_by_load(messages: Any) -> None:
    """Images, tool results that are not text, a call without an id (vLLM names it by the
    clock), an assistant's tool result, tool additions, wrong types: no view."""
    assert _view({"messages": messages}) is None


def test_an_sglang_fleet_keys_messages_as_sglang_converts_them() -> None:
    """SGLang joins system texts by newlines, keeps empty texts, puts the text before a tool
    result in a user message of its own and leaves server tools out (tests/sglang/
    test_chat_shape.py checks this against its code); thinking history is not keyed."""
    body = {"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]},
                         {"role": "assistant", "content": []}]}  # fmt: skip
    assert chat_view(body, "sglang", _never, _never) == {"messages": [
        {"role": "system", "content": "a\nb"}, {"role": "user", "content": ""},
        {"role": "assistant", "content": ""}]}  # fmt: skip
    assert chat_view(AGENT, "sglang", _never, _never) is None  # thinking
    thoughtless = [{**m, "content": [b for b in m["content"] if b["type"] != "thinking"]}
                   if m["role"] == "assistant" else m for m in AGENT["messages"]]  # fmt: skip
    server = {"type": "bash_20250124", "name": "bash"}
    view = chat_view({**AGENT, "messages": thoughtless, "tools": [*TOOLS, server]}, "sglang",
                     _never, _never)  # fmt: skip
    assert view is not None and [t["function"]["name"] for t in view["tools"]] == ["lookup"]
    assert view["tool_choice"] == "auto" and [m["role"] for m in view["messages"]] == [
        "system", "user", "assistant", "tool", "user"]  # fmt: skip
    assert view["messages"][3]["content"] == [
        {"type": "text", "text": "cpu"}, {"type": "text", "text": "tier 2"}]  # fmt: skip


QWEN_LIKE = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "{{ m.content }}{% endfor %}"
)


def test_the_inline_system_probe_is_vllms() -> None:
    """A template that refuses a later system message (here through `raise_exception`, which
    vLLM's probe sandbox does not define), or none at all, merges; others keep them."""
    assert rejects_inline_system(QWEN_LIKE) and rejects_inline_system(None)
    assert not rejects_inline_system("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert merges_inline_system(["{{ messages }}", QWEN_LIKE])
    assert not merges_inline_system(["{{ messages }}", "{{ messages | length }}"])


def test_the_inline_system_probe_for_sglang_is_sglangs() -> None:
    """SGLang keeps a later system message in place only where the template prints it; one
    that refuses it, drops it or cannot render merges it."""
    assert renders_inline_system("{% for m in messages %}{{ m.content }}{% endfor %}")
    dropping = ("{% for m in messages %}{% if m.role != 'system' or loop.first %}{{ m.content }}"
                "{% endif %}{% endfor %}")  # fmt: skip
    for template in (QWEN_LIKE, dropping, "{{ nope() }}", None):
        assert not renders_inline_system(template)


def test_the_disabled_thinking_effort_is_probed_as_vllm_probes_it() -> None:
    def shows(body: dict[str, Any]) -> str:
        return f"<{body['reasoning_effort']}>"

    def ignores(body: dict[str, Any]) -> str:
        return "same"

    def refuses_none(body: dict[str, Any]) -> str:
        if body["reasoning_effort"] == "none":
            raise PromptError("no")
        return "x"

    assert disabled_effort(shows) == "none"
    assert disabled_effort(ignores) == "low" and disabled_effort(refuses_none) == "low"


def test_a_configured_disabled_thinking_effort_is_used_as_the_engine_uses_it(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    """A fleet started with `--anthropic-disabled-thinking-effort low`: the router renders
    thinking-disabled messages with effort "low", where its own probe would pick "none" for a
    template that prints the effort."""
    shows = "{% for m in messages %}{{ m.content }}{% endfor %}<{{ reasoning_effort }}>"

    async def scenario() -> None:
        body = {"max_tokens": 4, "thinking": {"type": "disabled"},
                "messages": [{"role": "user", "content": "the cache"}]}  # fmt: skip
        for setting, effort in (("auto", "none"), ("low", "low")):
            async with running(tokenizer_dir, [FakeEngine("a", max_model_len=4096)],
                               chat_template=shows,
                               anthropic_disabled_thinking_effort=setting) as (router, *_):
                tokens, _, _ = await router.proxy.tokens(dict(body), "messages")
                chat = {"messages": body["messages"], "reasoning_effort": effort}
                assert tokens == (await router.proxy.tokens(chat, "chat"))[0]

    _run(scenario())


def test_an_sglang_fleet_refuses_a_tenant_key_it_cannot_keep_apart(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    """SGLang 0.5's /v1/messages drops `cache_salt`: a request with a `cache_key` (or its own
    `cache_salt`) would share KV with every other tenant's in the engine, so it is refused;
    without one it is served and keyed."""

    async def scenario() -> None:
        card = b'{"data": [{"id": "m", "max_model_len": 4096, "owned_by": "sglang"}]}'
        engine = FakeEngine("a", models=card)
        async with running(tokenizer_dir, [engine]) as (_, call, _s, _b):
            body = {"max_tokens": 4, "messages": [{"role": "user", "content": "the cache"}]}
            for extra in ({"warply": {"cache_key": "t1"}}, {"cache_salt": "t1"}):
                status, got = await call("POST", "/v1/messages", {**body, **extra})
                assert status == 400 and got["error"]["type"] == "invalid_request_error"
                assert "cache_salt" in got["error"]["message"] and not engine.bodies
            assert (await call("POST", "/v1/messages", body))[0] == 200
            assert (await call("POST", "/v1/chat/completions", {**body, "cache_salt": "t1"}))[
                0] == 200  # fmt: skip

    _run(scenario())


def test_an_sglang_fleet_merges_inline_system_messages_where_its_template_drops_them(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    """On an SGLang fleet the router probes its template as SGLang does: a template that
    drops a later system message (vLLM's probe would keep it in place: it renders) gets it
    stripped and joined into the first by a newline, one that prints it keeps it in place."""
    plain = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    dropping = ("{% for m in messages %}{% if m.role != 'system' or loop.first %}[{{ m.role }}]"
                "{{ m.content }}{% endif %}{% endfor %}")  # fmt: skip
    card = b'{"data": [{"id": "m", "max_model_len": 4096, "owned_by": "sglang"}]}'
    body = {"max_tokens": 4, "system": "Rules.", "messages": [
        {"role": "user", "content": "go"}, {"role": "system", "content": " late "}]}  # fmt: skip
    merged = [{"role": "system", "content": "Rules.\nlate"}, {"role": "user", "content": "go"}]
    kept = [{"role": "system", "content": "Rules."}, {"role": "user", "content": "go"},
            {"role": "system", "content": " late "}]  # fmt: skip

    async def scenario() -> None:
        for template, chat in ((dropping, merged), (plain, kept)):
            async with running(tokenizer_dir, [FakeEngine("a", models=card)],
                               chat_template=template) as (router, *_):  # fmt: skip
                tokens, _, _ = await router.proxy.tokens(dict(body), "messages")
                want = (await router.proxy.tokens({"messages": chat}, "chat"))[0]
                assert tokens == want, template

    _run(scenario())


def test_usage_and_events_read_as_the_accounting_needs_them() -> None:
    assert openai_usage({"input_tokens": 3, "cache_read_input_tokens": 32, "output_tokens": 1}) \
        == {"prompt_tokens": 35, "prompt_tokens_details": {"cached_tokens": 32}}
    assert openai_usage({"input_tokens": 3, "output_tokens": 1}) == {"prompt_tokens": 3}
    assert openai_usage({"input_tokens": "3"}) is None and openai_usage(None) is None
    delta = b'event: message_delta\ndata: {"type":"message_delta","usage":{"input_tokens":1,' \
        b'"cache_read_input_tokens":16,"output_tokens":2}}'
    assert event_usage(delta) == (False, {"prompt_tokens": 17,
                                          "prompt_tokens_details": {"cached_tokens": 16}})
    assert event_usage(b'event: message_stop\ndata: {"type":"message_stop"}') == (True, None)
    assert event_usage(b"event: message_delta\ndata: {broken") == (False, None)
    event = error_event(502, "upstream a failed")
    assert event.startswith(b"event: error\ndata: ")
    assert json.loads(event.split(b"data: ", 1)[1]) == {
        "type": "error", "error": {"type": "api_error", "message": "upstream a failed"}}


def test_a_message_is_keyed_as_its_chat_and_sent_as_it_came(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    async def scenario() -> None:
        engines = [FakeEngine(name, cached_tokens=4, max_model_len=4096) for name in "ab"]
        async with running(tokenizer_dir, engines) as (router, call, session, base):
            body = {"model": "m", "max_tokens": 4, "system": "hold the cache",
                    "messages": [{"role": "user", "content": "the cache holds"},
                                 {"role": "assistant", "content": "a prefix"},
                                 {"role": "user", "content": "of tokens"}]}  # fmt: skip
            tokens, _, _ = await router.proxy.tokens(dict(body), "messages")
            chat = {"model": "m", "messages": [{"role": "system", "content": "hold the cache"},
                                               *body["messages"]]}  # fmt: skip
            assert tokens == (await router.proxy.tokens(chat, "chat"))[0] and len(tokens) > 8
            raw = json.dumps(body).encode()
            headers = {"Content-Type": "application/json"}
            async with session.post(base + "/v1/messages", data=raw, headers=headers) as r:
                answer, worker = await r.json(), r.headers["X-Warply-Worker"]
                assert r.status == 200 and answer["content"][0]["text"] == worker
            engine = next(e for e in engines if e.name == worker)
            assert engine.raw[-1] == raw  # untouched: no stream_options, no rewrite

            # A tenant's key becomes the engine's cache salt; the stream's usage is counted.
            tenant = {**body, "stream": True, "warply": {"cache_key": "tenant"}}
            async with session.post(base + "/v1/messages", json=tenant) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                text, worker = (await r.read()).decode(), r.headers["X-Warply-Worker"]
            kinds = [e.split("\n")[0].removeprefix("event: ") for e in text.strip().split("\n\n")]
            assert kinds == ["message_start", "content_block_start", "content_block_delta",
                             "content_block_delta", "content_block_stop", "message_delta",
                             "message_stop"]  # fmt: skip
            sent = next(e for e in engines if e.name == worker).bodies[-1]
            assert sent["cache_salt"] == "tenant" and "warply" not in sent
            status, got = await call("GET", "/warply/cache_stats")
            stats = msgspec.convert(got, CacheStats)
            assert stats.requests == 2 and stats.engine_cached_tokens == 2 * 4
            assert stats.ttft_s.n == 1 and stats.placed_unkeyed == 0

            # Count tokens goes to an engine as it came; an image is placed by load.
            status, got = await call("POST", "/v1/messages/count_tokens", body)
            assert status == 200 and got["input_tokens"] == 10
            image = {**body, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}
            assert (await call("POST", "/v1/messages", image))[0] == 200
            status, got = await call("GET", "/warply/cache_stats")
            assert msgspec.convert(got, CacheStats).placed_unkeyed == 1

    _run(scenario())


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"model": "other", "max_tokens": 1, "messages": [{"role": "user", "content": "a"}]},
         404, "not_found_error"),
        ({"max_tokens": 1, "messages": []}, 400, "invalid_request_error"),
        ({"max_tokens": 1, "messages": "hi"}, 400, "invalid_request_error"),
        ({"max_tokens": 5000, "messages": [{"role": "user", "content": "the cache"}]}, 400,
         "invalid_request_error"),
        (b"{not json", 400, "invalid_request_error"),
    ],
)  # fmt: skip
def test_bad_messages_get_anthropic_shaped_errors(
    tokenizer_dir: Path,  # noqa: F811
    body: Any,
    status: int,
    kind: str,
) -> None:
    async def scenario() -> None:
        engine = FakeEngine("a", max_model_len=4096)
        async with running(tokenizer_dir, [engine]) as (_, call, _s, _b):
            got_status, got = await call("POST", "/v1/messages", body)
            assert (got_status, set(got), got["type"], got["error"]["type"]) == (
                status, {"type", "error"}, "error", kind)  # fmt: skip
            assert isinstance(got["error"]["message"], str) and not engine.bodies

    _run(scenario())


def test_a_broken_stream_ends_with_an_anthropic_error_event(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    async def scenario() -> None:
        engine = FakeEngine("a", hang=True)
        async with running(tokenizer_dir, [engine], request_timeout_s=60,
                           upstream_idle_timeout_s=0.5) as (_, _c, session, base):  # fmt: skip
            body = {"max_tokens": 4, "stream": True, "messages": [{"role": "user",
                                                                   "content": "a"}]}
            async with session.post(base + "/v1/messages", json=body) as r:
                assert r.status == 200
                text = await asyncio.wait_for(r.read(), 10)
            last = text.strip().split(b"\n\n")[-1]
            assert last.startswith(b"event: error\ndata: ")
            error = json.loads(last.split(b"data: ", 1)[1])
            assert error["type"] == "error" and error["error"]["type"] == "api_error"

    _run(scenario())
