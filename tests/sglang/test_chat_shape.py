"""An SGLang fleet's chats reach the router's template as SGLang 0.5 shapes them: SGLang's own
code (the request's pydantic messages dumped, `normalize_assistant_tool_call_arguments`,
`process_content_for_template_format` with the format `detect_jinja_template_content_format`
finds, `normalize_tool_content`, in the order its `_apply_jinja_template` runs them) against
`router.chat_shape.sglang_conversation`, field for field and in the same key order (a
template that prints a message whole prints that order). SGLang serving needs a GPU here, so
this is the part of its rendering that runs on this machine."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.srt.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from sglang.srt.entrypoints.anthropic.serving import AnthropicServing
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ResponsesRequest,
    ToolChoice,
)
from sglang.srt.entrypoints.openai.responses_adapters import encode_reasoning_state
from sglang.srt.entrypoints.openai.serving_chat import (
    normalize_assistant_tool_call_arguments,
    normalize_tool_content,
)
from sglang.srt.entrypoints.openai.serving_responses import OpenAIServingResponses
from sglang.srt.parser import template_manager
from sglang.srt.parser.jinja_template_utils import (
    detect_jinja_template_content_format,
    process_content_for_template_format,
)
from sglang.srt.parser.template_detection import detect_inline_system_support
from sglang.srt.parser.template_manager import TemplateManager

from router.chat_shape import PromptError, sglang_conversation, sglang_kwargs, sglang_tools
from router.chat_template import (
    ChatTemplates,
    TemplateLoadError,
    engine_template,
    sglang_template,
)
from router.content_format import sglang_content_format
from router.messages import chat_view as messages_view
from router.messages_sglang import renders_inline_system
from router.responses import chat_view as responses_view
from router.tokenize import _environment

STRING = "{% for m in messages %}{{ m | tojson }}{% endfor %}"
PARTS = (
    "{% for message in messages %}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{{ c['text'] }}"
    "{% endfor %}{% endif %}{% endfor %}"
)
TEMPLATES = {  # template: the format SGLang 0.5 detects
    STRING: "string",
    PARTS: "openai",
    "{# no vision here #}{{ messages }}": "openai",
    "{% for msg in messages %}{% for c in msg.content | reverse %}{% endfor %}{% endfor %}":
        "openai",
    "{% for turn in messages %}{% for c in turn.content %}{% endfor %}{% endfor %}": "string",
    "{% for m in messages %}{% for c in m['content'][1:] %}{% endfor %}{% endfor %}": "openai",
    "{% for m in messages %}{% for c in m.content %}": "string",  # does not parse
}  # fmt: skip
CALL = {"id": "c1", "type": "function", "extra": 1,
        "function": {"name": "lookup", "arguments": '{"block": 7}', "x": 2}}  # fmt: skip
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "cache": "x", "defer_loading": True,
     "function": {"parameters": {"type": "object"}, "name": "f", "colour": "red"}},
    {"type": "function", "function": {"name": "g", "description": "d", "strict": False}},
    {"function": {"name": "h", "defer_loading": None, "description": "x"}},
]  # fmt: skip
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "system", "content": "Route by prefix."},
     {"role": "user", "content": "Where is block 7?", "name": "ops", "id": 3},
     {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None},
     {"role": "tool", "tool_call_id": "c1",
      "content": [{"type": "text", "text": "cpu"}, {"type": "text", "text": "tier"}]},
     {"role": "assistant", "content": "On the cpu tier.", "reasoning_content": "looked",
      "annotations": []},
     {"role": "user", "content": [{"type": "text", "text": "one"},
                                  {"type": "text", "text": "two"}]}],
    [{"role": "developer", "content": "Be brief.", "name": "rules"},
     {"role": "user", "content": "Which tier?"},
     {"role": "assistant", "content": [{"type": "text", "text": "GPU"}], "tool_calls": None},
     {"role": "tool", "tool_call_id": "c9", "content": "done"}],
    [{"role": "system", "content": "Use the tools.", "tools": TOOLS},
     {"role": "user", "content": "Where is block 7?"}],
]  # fmt: skip


def _sglang(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """The messages SGLang 0.5 hands the template, by its own functions."""
    return _shaped(ChatCompletionRequest(model="m", messages=copy.deepcopy(messages)), template)


def _shaped(request: ChatCompletionRequest, template: str) -> list[dict[str, Any]]:
    """The messages SGLang 0.5 hands the template for `request`."""
    content_format = detect_jinja_template_content_format(template)
    dumped = [m.model_dump() for m in request.messages]
    for m in dumped:
        normalize_assistant_tool_call_arguments(m, strict=True)
    shaped = []
    for m in copy.deepcopy(dumped):
        if m.get("content") is None:
            m["content"] = ""
        out = process_content_for_template_format(m, content_format, [], [], [], [])
        out["content"] = normalize_tool_content(out["role"], out.get("content"))
        shaped.append(out)
    return shaped


def _template_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools SGLang 0.5 hands the template for `request` (`_process_messages`)."""
    if not request.tools or request.tool_choice == "none":
        return None
    if isinstance(request.tool_choice, ToolChoice):
        named = request.tool_choice.function.name
        return [t.model_dump() for t in request.tools if t.function.name == named] or None
    return [t.model_dump() for t in request.tools]


def test_the_content_format_is_detected_as_sglang_detects_it() -> None:
    for source, want in TEMPLATES.items():
        assert detect_jinja_template_content_format(source) == want, source
        assert sglang_content_format(source, _environment()) == want, source


@pytest.mark.parametrize("template", [STRING, PARTS])
def test_messages_are_shaped_as_sglang_shapes_them(template: str) -> None:
    openai = sglang_content_format(template, _environment()) == "openai"
    for messages in CHATS:
        want = _sglang(messages, template)
        got = sglang_conversation(messages, openai)
        assert [list(m.items()) for m in got] == [list(m.items()) for m in want]


def test_a_tool_call_whose_arguments_are_not_an_object_is_refused_as_sglang_refuses_it() -> None:
    for arguments in ("{not json", "[1]"):
        call = {**CALL, "function": {"name": "f", "arguments": arguments}}
        messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
        with pytest.raises(ValueError):
            _sglang(messages, STRING)
        with pytest.raises(PromptError):
            sglang_conversation(messages, False)


@pytest.mark.parametrize(
    "choice",
    [None, "auto", "required", "none", {"type": "function", "function": {"name": "g"}},
     {"type": "function", "function": {"name": "missing"}}],
)  # fmt: skip
def test_tools_reach_the_template_as_sglang_passes_them(choice: Any) -> None:
    """Each tool as SGLang's own `Tool` dumps it (its fields in the client's order, nulls for
    an unset description or parameters, the tool's `defer_loading` copied into the function,
    other keys dropped), chosen as `_process_messages` chooses them: none for
    `tool_choice` "none", the named tool's for a named choice (none when no tool has the name),
    else all."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "go"}], "tools": TOOLS}
    if choice is not None:
        body["tool_choice"] = choice
    request = ChatCompletionRequest(model="m", **copy.deepcopy(body))
    assert request.tools is not None
    want = _template_tools(request)
    got = sglang_tools(body)
    assert got == want
    if want is not None:
        assert [list(t["function"]) for t in got] == [list(t["function"]) for t in want]
    assert sglang_tools({"messages": body["messages"]}) is None


@pytest.mark.parametrize(
    ("effort", "given", "defaults"),
    [(None, {}, {}), ("high", {}, {"enable_thinking": False}), ("none", {}, {}),
     ("low", {"thinking": None}, {}), ("high", {"enable_thinking": False}, {"thinking": 0}),
     (None, {}, {"reasoning_effort": "low"}), ("high", {}, {"reasoning_effort": "low"})],
)  # fmt: skip
def test_template_arguments_are_passed_as_sglang_passes_them(
    effort: Any, given: dict[str, Any], defaults: dict[str, Any]
) -> None:
    """SGLang's request model, when built, sets `thinking` and `enable_thinking` from a
    `reasoning_effort` where the client's kwargs leave them out; its defaults then fill the
    rest (`_process_messages`) and the effort goes under them (`_apply_jinja_template`)."""
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "go"}],
                            "chat_template_kwargs": copy.deepcopy(given)}  # fmt: skip
    if effort is not None:
        body["reasoning_effort"] = effort
    request = ChatCompletionRequest(**body)
    kwargs = dict(request.chat_template_kwargs or {})
    for key, value in defaults.items():
        kwargs.setdefault(key, value)
    chosen = request.reasoning_effort
    if chosen is None:
        chosen = kwargs.get("reasoning_effort")
    want = {**({} if chosen is None else {"reasoning_effort": chosen}), **kwargs}
    assert sglang_kwargs(given, effort, defaults) == want


SCHEMA = {"properties": {"path": {"type": "string"}}, "required": ["path"]}
ANTHROPIC_TOOLS: list[dict[str, Any]] = [
    {"name": "read", "description": "Read a file.", "input_schema": SCHEMA},
    {"type": "custom", "name": "grep", "input_schema": {"type": "object"}, "strict": True,
     "defer_loading": True},
    {"type": "web_search_20250305", "name": "web_search"},
]  # fmt: skip
AGENT: list[dict[str, Any]] = [
    {"role": "user", "content": "Where is block 7?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": ""},
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a"}},
        {"type": "tool_use", "id": "toolu_2", "name": "grep", "input": {}}]},
    {"role": "user", "content": [
        {"type": "text", "text": "before"},
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "cpu"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": [
            {"type": "text", "text": "one"}, {"type": "text", "text": "two"},
            {"type": "text", "text": ""}]},
        {"type": "text", "text": "after"}]},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_3", "name": "read", "input": {"path": "b"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_3", "is_error": True},
        {"type": "tool_result", "id": "toolu_4", "content": []}]},
    {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_3", "content": [
            {"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]},
]  # fmt: skip
ANTHROPIC: list[dict[str, Any]] = [
    {"system": "Route by prefix.", "messages": [
        {"role": "user", "content": "Where is block 7?"},
        {"role": "assistant", "content": [{"type": "text", "text": "On the cpu tier."}]},
        {"role": "user", "content": [{"type": "text", "text": "one"},
                                     {"type": "text", "text": ""}]}]},
    {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1"},
                {"type": "text", "text": ""}, {"type": "text", "text": "Be brief."}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                  {"role": "assistant", "content": []},
                  {"role": "user", "content": []},
                  {"role": "user", "content": "again"}]},
    {"system": "   ", "messages": [{"role": "user", "content": "no system"}]},
    {"system": "Use the tools.", "tools": ANTHROPIC_TOOLS, "messages": AGENT},
    {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}, "messages": AGENT[:1]},
    {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "none"}, "messages": AGENT[:1]},
    {"tools": ANTHROPIC_TOOLS, "messages": AGENT[:1],
     "tool_choice": {"type": "tool", "name": "grep", "disable_parallel_tool_use": True}},
    {"tools": ANTHROPIC_TOOLS[2:], "tool_choice": {"type": "auto"}, "messages": AGENT[:1]},
    {"system": [{"type": "text", "text": "Rules."}], "messages": [
        {"role": "system", "content": [{"type": "text", "text": " reminder "},
                                       {"type": "text", "text": "  "}]},
        {"role": "user", "content": "go"},
        {"role": "system", "content": "late"},
        {"role": "system", "content": "   "},
        {"role": "assistant", "content": "ok"}]},
]  # fmt: skip
UNKEYED: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "a"}], "thinking": {"type": "disabled"}},
    {"messages": [{"role": "user", "content": "a"}], "output_config": {"effort": "high"}},
    {"messages": [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "s"}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
    {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/a.png"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
        "content": [{"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
        "content": [{"type": "tool_reference", "tool_name": "read"}]}]}]},
    {"messages": [{"role": "user", "content": "a"}], "tools": ANTHROPIC_TOOLS[2:],
     "tool_choice": {"type": "any"}},
    {"messages": [{"role": "user", "content": "a"}], "tools": ANTHROPIC_TOOLS,
     "tool_choice": {"type": "tool", "name": "web_search"}},
]  # fmt: skip


def _converted(body: dict[str, Any], inline: bool) -> ChatCompletionRequest:
    """SGLang 0.5's own conversion of a Messages body, on a server whose template renders
    inline system messages (`inline`) or not."""
    serving = AnthropicServing(SimpleNamespace(supports_inline_system=inline))  # type: ignore[arg-type]
    return serving._convert_to_chat_completion_request(
        AnthropicMessagesRequest.model_validate(copy.deepcopy(body))
    )


@pytest.mark.parametrize("template", [STRING, PARTS])
@pytest.mark.parametrize("inline", [True, False])
def test_a_messages_request_is_keyed_as_sglang_converts_it(template: str, inline: bool) -> None:
    """An Anthropic Messages body: SGLang's own conversion
    (`AnthropicServing._convert_to_chat_completion_request`) and then its chat shaping give the
    template the messages and tools the router's view gives it (through `sglang_conversation`
    and `sglang_tools`), with inline system messages in place or merged into the first; bodies
    whose conversion depends on the server (thinking, an effort, thinking history) or that hold
    images get no view, nor those SGLang refuses."""
    openai = sglang_content_format(template, _environment()) == "openai"
    for body in ANTHROPIC:
        full = {"model": "m", "max_tokens": 4, **body}
        request = _converted(full, inline)
        view = messages_view(full, "sglang", lambda: not inline, _never)
        assert view is not None and request.reasoning_effort is None
        got = sglang_conversation(view["messages"], openai)
        want = _shaped(request, template)
        assert [list(m.items()) for m in got] == [list(m.items()) for m in want]
        tools = sglang_tools(view)
        assert tools == _template_tools(request)
        if tools is not None:
            assert [list(t["function"]["parameters"]) for t in tools] == [
                list(t["function"]["parameters"]) for t in _template_tools(request) or []
            ]
    for body in UNKEYED:
        assert messages_view({"model": "m", "max_tokens": 4, **body}, "sglang",
                             lambda: not inline, _never) is None  # fmt: skip


def test_a_refused_tool_choice_is_refused_by_sglang_too() -> None:
    """The tool choices the view gives up on for SGLang are ones SGLang refuses (400)."""
    for body in UNKEYED[-2:]:
        with pytest.raises(ValueError):
            _converted({"model": "m", "max_tokens": 4, **body}, True)


INLINE_TEMPLATES = [
    STRING,
    PARTS,
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('system first') }}{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% if m.role != 'system' or loop.first %}{{ m.content }}"
    "{% endif %}{% endfor %}",
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }}"
    "{% endfor %}",
    "{{ messages[2].content | upper }}",
    "{{ undefined_function() }}",
    "",
]


def test_inline_system_support_is_probed_as_sglang_probes_it() -> None:
    for template in INLINE_TEMPLATES:
        assert renders_inline_system(template) == detect_inline_system_support(template), template


def _never() -> Any:
    raise AssertionError("SGLang's view asks for no vLLM probe")


RESPONSES_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "lookup", "description": "find a block",
     "parameters": {"properties": {"block": {"type": "integer"}}, "type": "object"}},
    {"type": "function", "name": "tiers", "strict": True},
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "custom", "name": "note"},
]  # fmt: skip
RESPONSES_AGENT: list[dict[str, Any]] = [
    {"role": "developer", "content": [{"type": "input_text", "text": "Use the tools."}]},
    {"role": "user", "content": [{"type": "input_text", "text": "Where is block 7?"},
                                 {"type": "input_text", "text": "Quickly."}]},
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look"},
                                                    {"type": "summary_text", "text": "it up"}]},
    {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
     "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
    {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"block": 7}'},
    {"type": "function_call", "call_id": "c2", "name": "tiers", "arguments": "not json"},
    {"type": "custom_tool_call", "call_id": "c3", "name": "apply_patch", "input": "+ gpu é"},
    {"type": "function_call_output", "call_id": "c1", "output": "cpu"},
    {"type": "function_call_output", "call_id": "c2",
     "output": [{"type": "input_text", "text": "gpu, "}, {"type": "input_text", "text": "cpu"}]},
    {"type": "custom_tool_call_output", "call_id": "c3", "output": "Done."},
    {"type": "reasoning", "id": "rs_2", "summary": [],
     "encrypted_content": encode_reasoning_state("stored thought")},
    {"type": "reasoning", "id": "rs_3", "summary": [], "content": []},
    {"role": "assistant", "content": "On the cpu tier.", "phase": "final_answer"},
    {"role": "assistant", "content": "Again.", "phase": "final_answer"},
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "And block 8?"},
]  # fmt: skip
RESPONSES: list[dict[str, Any]] = [
    {"instructions": "Route by prefix.", "input": "Where is block 7?"},
    {"instructions": "Route by prefix.", "input": RESPONSES_AGENT, "tools": RESPONSES_TOOLS},
    {"input": RESPONSES_AGENT, "tools": RESPONSES_TOOLS, "reasoning": {"summary": "auto"},
     "tool_choice": {"type": "custom", "name": "apply_patch"}},
    {"input": RESPONSES_AGENT[:2], "tools": RESPONSES_TOOLS, "reasoning": {"effort": "none"},
     "tool_choice": "required", "chat_template_kwargs": {"enable_thinking": True}},
    {"input": RESPONSES_AGENT[:2], "tools": RESPONSES_TOOLS[:1], "reasoning": {"effort": None},
     "tool_choice": {"type": "web_search_preview"}},
    {"input": RESPONSES_AGENT[:2], "tool_choice": "required"},
    {"input": [RESPONSES_AGENT[1], RESPONSES_AGENT[3], {"role": "assistant", "content": "More."},
               {"role": "assistant", "content": ""}, RESPONSES_AGENT[-1]]},
]  # fmt: skip
RESPONSES_UNKEYED: list[dict[str, Any]] = [
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
    {"input": RESPONSES_AGENT[:2], "tools": [{"type": "web_search_preview"}]},
    {"input": RESPONSES_AGENT[:2], "previous_response_id": "resp_1"},
]  # fmt: skip


class _Shaped(Exception):
    """Raised by the stand-in for `_process_messages` with the chat request SGLang built."""

    def __init__(self, request: ChatCompletionRequest) -> None:
        self.request = request


def _responses_chat(body: dict[str, Any], inline: bool) -> ChatCompletionRequest:
    """The chat request SGLang 0.5's own `_make_request` builds for a Responses body, on a
    server (no harmony, Beam or Muse model) whose template renders inline system messages
    (`inline`) or not: taken where it hands it to `_process_messages`."""
    serving = object.__new__(OpenAIServingResponses)
    serving.tool_call_parser = None
    serving.supports_inline_system = inline
    serving.msg_store = {}
    serving.tokenizer_manager = SimpleNamespace(model_config=SimpleNamespace(is_multimodal=False))

    def shaped(request: ChatCompletionRequest, *args: Any, **kwargs: Any) -> Any:
        raise _Shaped(request)

    serving._process_messages = shaped  # type: ignore[method-assign]
    request = ResponsesRequest.model_validate(copy.deepcopy(body))
    with pytest.raises(_Shaped) as caught:
        asyncio.run(serving._make_request(request, None, None))
    return caught.value.request


@pytest.mark.parametrize("template", [STRING, PARTS])
@pytest.mark.parametrize("inline", [True, False])
def test_a_responses_request_is_keyed_as_sglang_converts_it(template: str, inline: bool) -> None:
    """A Responses body: the chat request SGLang builds from it (`_make_request`: its input
    items converted, developer messages labelled, consecutive assistant messages merged,
    system messages merged where the template drops inline ones, function and custom tools,
    the tool choice and the reasoning effort) and then its chat shaping give the template the
    messages, tools and arguments the router's view gives it; images and built-in tools get
    no view."""
    openai = sglang_content_format(template, _environment()) == "openai"
    for body in RESPONSES:
        full = {"model": "m", **body}
        request = _responses_chat(full, inline)
        view = responses_view(full, "sglang", lambda: not inline)
        assert view is not None and view["add_special_tokens"] is False
        got = sglang_conversation(view["messages"], openai)
        want = _shaped(request, template)
        assert [list(m.items()) for m in got] == [list(m.items()) for m in want]
        tools = sglang_tools(view)
        assert tools == _template_tools(request)
        assert [list(t["function"]) for t in tools or []] == [
            list(t["function"]) for t in _template_tools(request) or []]  # fmt: skip
        kwargs = dict(request.chat_template_kwargs or {})
        effort = request.reasoning_effort
        assert sglang_kwargs(view.get("chat_template_kwargs") or {},
                             view.get("reasoning_effort"), {}) == {
            **({} if effort is None else {"reasoning_effort": effort}), **kwargs}  # fmt: skip
    for body in RESPONSES_UNKEYED:
        assert responses_view({"model": "m", **body}, "sglang", lambda: not inline) is None


@pytest.mark.parametrize("name", [None, "tool_use", "rag"])
def test_a_folders_named_templates_resolve_as_sglang_resolves_them(
    name: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang 0.5 keeps one of a folder's named templates (as transformers holds them: the
    default first, then the others) for every request: its `--hf-chat-template-name`'s, else
    the first (`TemplateManager._select_named_template`); the router's `ChatTemplates.only`."""
    named = {"default": "{{ 'd' }}", "tool_use": "{{ 't' }}", "rag": "{{ 'r' }}"}
    monkeypatch.setattr(template_manager, "get_serving",
                        lambda: SimpleNamespace(hf_chat_template_name=name))  # fmt: skip
    want = TemplateManager()._select_named_template(named, None)  # type: ignore[arg-type]
    templates = ChatTemplates(_environment(), named, True, "given")
    assert templates.only(name).source == want
    rest = {k: v for k, v in named.items() if k != "default"}  # no default: the first one
    if name in (None, *rest):
        monkeypatch.setattr(template_manager, "get_serving",
                            lambda: SimpleNamespace(hf_chat_template_name=name))  # fmt: skip
        want = TemplateManager()._select_named_template(rest, None)  # type: ignore[arg-type]
        assert ChatTemplates(_environment(), rest, True, "given").only(name).source == want


def test_a_template_file_is_read_as_sglang_reads_it(tmp_path: Path) -> None:
    """`--chat-template FILE`: SGLang 0.5's own `_load_explicit_chat_template` against the
    router's `sglang_template`. A `.jinja` file loses its outer newlines and has its written-out
    backslash-n read as newlines (vLLM reads it as it is); a `.json` file becomes a conversation
    template there, which the router refuses to render."""
    path = tmp_path / "chat.jinja"
    path.write_text("\n\n{% for m in messages %}{{ m['content'] }}\\n{% endfor %}\n\n")
    manager = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None))
    TemplateManager()._load_explicit_chat_template(manager, str(path))  # type: ignore[arg-type]
    vllm = engine_template(str(path))
    assert sglang_template(str(path), vllm) == manager.tokenizer.chat_template
    assert manager.tokenizer.chat_template != vllm
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps({
        "name": "warply-probe", "system": "S", "user": "U", "assistant": "A",
        "sep_style": "ADD_COLON_SINGLE", "stop_str": "</s>",
    }))  # fmt: skip
    manager = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None))
    sglang = TemplateManager()
    sglang._load_explicit_chat_template(manager, str(conversation))  # type: ignore[arg-type]
    assert sglang.chat_template_name == "warply-probe" and manager.tokenizer.chat_template is None
    with pytest.raises(TemplateLoadError, match="as a JSON conversation template"):
        sglang_template(str(conversation), engine_template(str(conversation)))
