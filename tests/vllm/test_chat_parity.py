"""Chats the router renders as vLLM 0.32 does where it reshapes them before the template: a
real `vllm serve` with a chat template that prints the tools and the tool calls and never
names the `developer` role (`--chat-template`; the tiny model's own template ignores tools),
its `/tokenize` against `RouterTokenizer.chat_tokens` with the same template.

vLLM hands the template its pydantic dump of the tools (nulls for unset fields), each
assistant tool call's `arguments` parsed into an object, and `developer` messages as `system`
ones merged into the first; the router rendered the client's dicts, the JSON string and the
`developer` role, so its prompt left the engine's at the tools block, at the first tool call
and at the first developer message.

A second `vllm serve`, started with `--chat-template`, `--chat-template-content-format`,
`--default-chat-template-kwargs` and `--exclude-tools-when-tool-choice-none`, checks the
router's settings of the same names: its
`/tokenize` and the router's parity probe against a router given them, and given none."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import complete, engine, start_all

from router.chat_template import ChatTemplates, folder_templates
from router.content_format import content_format
from router.messages import chat_view as messages_view
from router.messages import disabled_effort, openai_usage
from router.parity import Probes, check
from router.responses import chat_view
from router.tokenize import RouterTokenizer, _environment
from warply.launch import VllmServer, http_json

TEMPLATE = (
    "{{ bos_token }}{% if reasoning_effort is defined %}<effort>{{ reasoning_effort }}"
    "{{ enable_thinking }}</effort>{% endif %}{% if tools %}<tools>{{ tools | tojson }}</tools>"
    "{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "{% if m.name %}({{ m.name }}){% endif %}{% if m.reasoning_content %}<think>"
    "{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}"
    "<call>{{ c['function']['name'] }}({{ c['function']['arguments'] | tojson }})</call>"
    "{% endfor %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
)
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"block": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "list_tiers", "description": "the tiers",
                                      "strict": True}},
]  # fmt: skip
CALLS: list[dict[str, Any]] = [
    {"id": "c1", "type": "function",
     "function": {"name": "lookup", "arguments": '{"block": 7, "tier": "cpu"}'}},
    {"id": "c2", "type": "function", "function": {"name": "list_tiers", "arguments": ""}},
]  # fmt: skip
TOOL_CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": "Where is block 7?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c1", "content": "cpu"},
    {"role": "tool", "tool_call_id": "c2", "content": "gpu, cpu, disk"},
    {"role": "assistant", "content": "On the cpu tier.", "tool_calls": []},
    {"role": "user", "content": "And block 8?"},
]
OTHER_CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Plan it.", "name": "ops", "id": "m1"},
     {"role": "assistant", "content": "Done.", "reasoning": "short plan",
      "refusal": None, "annotations": []},
     {"role": "assistant", "content": "Again.", "reasoning_content": "not read by vLLM"},
     {"role": "user", "content": [{"type": "text", "text": "one"},
                                  {"type": "text", "text": "two"}]}],
]  # fmt: skip
DEVELOPER_CHATS: list[list[dict[str, Any]]] = [
    [{"role": "developer", "content": "Answer in one word."},
     {"role": "user", "content": "Which tier?"}],
    [{"role": "system", "content": "You route requests."},
     {"role": "user", "content": "Which tier?"},
     {"role": "developer", "content": [{"type": "text", "text": "Be brief."},
                                       {"type": "text", "text": "No lists."}]},
     {"role": "user", "content": "And now?"}],
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    logs = tmp_path_factory.mktemp("chat-parity")
    template = logs / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ["--chat-template", str(template), "--trust-request-chat-template"]
    vllm = engine(tiny_model, logs / "vllm.log", extra_args=args)
    start_all([vllm])
    yield vllm
    vllm.stop()


def _same_ids(
    server: VllmServer, model: str, body: dict[str, Any], template: str = TEMPLATE
) -> None:
    tok = RouterTokenizer(Path(model))
    for gen in (True, False):
        sent = {"model": "tiny", **body, "add_generation_prompt": gen}
        status, want = http_json("POST", server.url + "/tokenize", sent)
        assert status == 200, want
        mine = {**json.loads(json.dumps(sent)), "chat_template": template}
        assert tok.chat_tokens(mine) == want["tokens"], (gen, tok.render_chat(mine))


def test_tools_and_tool_calls_tokenize_as_vllm_renders_them(
    server: VllmServer, tiny_model: str
) -> None:
    _same_ids(server, tiny_model, {"messages": TOOL_CHAT, "tools": TOOLS})


def test_message_fields_tokenize_as_vllm_parses_them(server: VllmServer, tiny_model: str) -> None:
    """vLLM's parser keeps a message's role, text (None: ""), name, an assistant's tool calls
    and `reasoning` (also as `reasoning_content`) and drops the rest."""
    for messages in OTHER_CHATS:
        _same_ids(server, tiny_model, {"messages": messages})


def test_developer_messages_tokenize_as_vllm_renders_them(
    server: VllmServer, tiny_model: str
) -> None:
    for messages in DEVELOPER_CHATS:
        _same_ids(server, tiny_model, {"messages": messages})


def _engine_agrees(server: VllmServer, mine: list[int], path: str, body: dict[str, Any]) -> None:
    """The engine's prompt for `body` is the router's `mine` where no /tokenize can say so:
    after `mine` itself is prefilled, the request's prompt is as long and hits every block of
    it (all but its last token, as vLLM 0.32 recomputes that one)."""
    complete(server, mine, max_tokens=1)
    status, out = http_json("POST", server.url + path, {"model": "tiny", **body})
    assert status == 200, out
    usage = out["usage"]
    if "cache_read_input_tokens" in usage:  # the Messages API's: cached tokens apart
        usage = openai_usage(usage)
    total = usage.get("prompt_tokens", usage.get("input_tokens"))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    block = 32
    assert (total, details["cached_tokens"]) == (len(mine), (len(mine) - 1) // block * block)


def test_a_reasoning_effort_reaches_the_template_as_vllm_passes_it(
    server: VllmServer, tiny_model: str
) -> None:
    """vLLM passes `reasoning_effort` and `enable_thinking` (unless the client set it) to the
    template, which may print them at the head of the prompt."""
    tok = RouterTokenizer(Path(tiny_model))
    for effort, kwargs in (("low", {}), ("none", {}), ("high", {"enable_thinking": False})):
        body = {"messages": TOOL_CHAT[:1] * 9, "reasoning_effort": effort, "max_tokens": 1,
                "chat_template_kwargs": kwargs}  # fmt: skip
        mine = tok.chat_tokens({**body, "chat_template": TEMPLATE})
        _engine_agrees(server, mine, "/v1/chat/completions", body)


def test_an_agent_loop_through_the_responses_api_renders_as_vllm_renders_it(
    server: VllmServer, tiny_model: str
) -> None:
    """A Responses input with function, custom and namespace tools, reasoning, function,
    custom and namespaced calls and their outputs: vLLM folds each turn's parts into one
    assistant message and renders its chat (custom tools as single-string function shims,
    namespace functions as `NAMESPACE__NAME`); the router's `chat_view` of it tokenizes to the
    engine's prompt (the second BOS included)."""
    tools = [{"type": "function", "name": "lookup", "description": "find a block",
              "parameters": {"type": "object", "properties": {"block": {"type": "integer"}}}},
             {"type": "function", "name": "list_tiers", "parameters": None, "strict": False},
             {"type": "custom", "name": "apply_patch", "description": "Edit files.",
              "format": {"type": "text"}},  # vLLM 0.32 refuses grammar formats
             {"type": "namespace", "name": "crm", "description": "The CRM.", "tools": [
                 {"type": "function", "name": "find", "parameters": {"type": "object"},
                  "defer_loading": True, "strict": True},
                 {"type": "custom", "name": "note"}]}]
    items = [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Where is block 7?"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "look it up"}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup",
         "arguments": '{"block": 7}'},
        {"type": "function_call", "call_id": "c2", "name": "list_tiers", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "cpu"},
        {"type": "function_call_output", "call_id": "c2", "output": "gpu, cpu, disk"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "On the cpu tier."}]},
        {"role": "user", "content": "Move it."},
        {"type": "custom_tool_call", "call_id": "c3", "name": "apply_patch",
         "input": "*** Begin Patch\n+tier: gpu é\n*** End Patch"},
        {"type": "function_call", "call_id": "c4", "name": "find", "namespace": "crm",
         "arguments": '{"q": "block 7"}'},
        {"type": "custom_tool_call_output", "call_id": "c3", "output": "Done."},
        {"type": "function_call_output", "call_id": "c4", "output": "none"},
        {"role": "user", "content": "And block 8?"},
    ]  # fmt: skip
    tok = RouterTokenizer(Path(tiny_model))
    for extra in ({}, {"reasoning": {"effort": "medium"}}):
        body = {"input": items, "tools": tools, "max_output_tokens": 1, **extra}
        view = chat_view(body)
        assert view is not None
        mine = tok.chat_tokens({**view, "chat_template": TEMPLATE})
        _engine_agrees(server, mine, "/v1/responses", body)


def test_an_agent_loop_through_the_messages_api_renders_as_vllm_renders_it(
    server: VllmServer, tiny_model: str
) -> None:
    """An Anthropic Messages body as Claude Code sends one (a billing header among the system
    blocks, an inline system reminder, thinking, tool use and results, tools), with thinking
    disabled or an effort set: vLLM converts it to a chat and renders that; the router's
    `chat_view` of it, rendered with the engine's --chat-template, tokenizes to the engine's
    prompt (its inline system message kept: this template renders one)."""
    tok = RouterTokenizer(Path(tiny_model), chat_template=TEMPLATE)
    tools = [{"name": "lookup", "description": "find a block",
              "input_schema": {"properties": {"block": {"type": "integer"}}}},
             {"name": "list_tiers", "input_schema": {"type": "object"}, "strict": True}]
    messages = [
        {"role": "user", "content": "Where is block 7?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look it up", "signature": "sig"},
            {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"block": 7}},
            {"type": "tool_use", "id": "t2", "name": "list_tiers", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "cpu"},
            {"type": "tool_result", "tool_use_id": "t2",
             "content": [{"type": "text", "text": "gpu"}, {"type": "text", "text": "disk"}]}]},
        {"role": "assistant", "content": [{"type": "text", "text": "On the cpu tier."}]},
        {"role": "system", "content": "Reminder: be brief."},
        {"role": "user", "content": [{"type": "text", "text": "And block 8?"},
                                     {"type": "text", "text": "Thanks."}]},
    ]  # fmt: skip
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=9f"},
              {"type": "text", "text": "You route requests."}]
    assert not tok.merges_inline_system()
    none = {"type": "none"}  # "auto", the default with tools, needs a tool parser on the engine
    for extra in ({"tool_choice": none}, {"tool_choice": none, "thinking": {"type": "disabled"}},
                  {"tool_choice": none, "output_config": {"effort": "high"}},
                  {"tools": None}):  # a named choice needs a tool parser too
        body = {"system": system, "messages": messages, "tools": tools, "max_tokens": 1, **extra}
        view = messages_view(body, None, tok.merges_inline_system,
                             lambda: disabled_effort(tok.render_chat))
        assert view is not None
        _engine_agrees(server, tok.chat_tokens(view), "/v1/messages", body)


PARTS_TEMPLATE = (  # Llama 4's way: a string content as it is, each text part trimmed
    "{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<|eot|>{% endfor %}{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>"
    "{% endif %}"
)
DETECTED = {  # template: the content format vLLM 0.32 detects
    TEMPLATE: "string",
    PARTS_TEMPLATE: "openai",
    "{% for m in messages[1:] | reverse %}{% for c in m.content | selectattr('text') %}"
    "{{ c.text }}{% endfor %}{% endfor %}": "openai",
    "{% set rest = messages[1:] %}{% set turns = rest %}{% for t in turns %}"
    "{% for c in t['content'] %}{{ c }}{% endfor %}{% endfor %}": "openai",
    "{% macro show(body) %}{% for c in body %}{{ c.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.content) }}{% endfor %}": "openai",
    "{% macro show(body, x) %}{% for c in x %}{{ c }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(body=m['content'], x=[]) }}{% endfor %}": "string",
    "{% macro show(body) %}{% for c in content %}{{ c }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}": "string",
    "{% for m in messages %}{% set content = m.content %}{% for c in content %}{{ c }}"
    "{% endfor %}{% endfor %}": "openai",
    "{% for m in other %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}": "string",
    "{% for i, m in messages %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}": "string",
    "{% for m in messages %}{% for k, v in m.content %}{{ v }}{% endfor %}{% endfor %}": "string",
    "{% for m in messages %}{{ m.content }}{% endfor %}": "string",
    "{% for m in messages %}{% for c in m.content %}": "string",  # does not parse
}


def test_the_content_format_is_detected_as_vllm_detects_it() -> None:
    """`router.content_format` against vLLM's own detector, on templates that take each rule
    (loops over a message's content through filters, slices, sets and macros; names bound
    several at once) and on the templates vLLM ships."""
    from vllm.renderers.hf import _detect_content_format

    shipped = resources.files("vllm.transformers_utils") / "chat_templates"
    templates = {**DETECTED, **{
        f.read_text(): _detect_content_format(f.read_text(), default="string")
        for f in shipped.iterdir() if f.name.endswith(".jinja")
    }}  # fmt: skip
    assert len(templates) > len(DETECTED) + 3
    for source, want in templates.items():
        assert _detect_content_format(source, default="string") == want, source
        assert content_format(source, _environment()) == want, source
    assert "openai" in templates.values()


def test_a_template_that_reads_content_parts_gets_them_as_vllm_passes_them(
    server: VllmServer, tiny_model: str
) -> None:
    """With a template that loops over a message's content, vLLM hands it every content as
    parts: a string as one text part (trimmed here, where a string would not be), none as no
    part, a list's text parts one by one (not joined by newlines)."""
    chats: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": "  Route by prefix.\n"},
         {"role": "user", "content": [{"type": "text", "text": " one "},
                                      {"type": "text", "text": "two\n"}]},
         {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
         {"role": "tool", "tool_call_id": "c1", "content": "cpu \n"},
         {"role": "user", "content": "And block 8?  "}],
        [{"role": "developer", "content": "Be brief. "},
         {"role": "user", "content": "Which tier?\n"}],
    ]  # fmt: skip
    for messages in chats:
        _same_ids(server, tiny_model, {"messages": messages, "chat_template": PARTS_TEMPLATE},
                  PARTS_TEMPLATE)  # fmt: skip
    final = {"role": "assistant", "content": [{"type": "text", "text": "It is on the"}]}
    body = {"messages": [chats[1][1], final], "chat_template": PARTS_TEMPLATE,
            "continue_final_message": True, "add_generation_prompt": False}  # fmt: skip
    status, want = http_json("POST", server.url + "/tokenize", {"model": "tiny", **body})
    assert status == 200, want
    assert RouterTokenizer(Path(tiny_model)).chat_tokens(body) == want["tokens"]


ENGINE_TEMPLATE = (
    "{% if house is defined %}<house>{{ house }}</house>{% endif %}"
    "{% if enable_thinking is defined %}<think>{{ enable_thinking }}</think>{% endif %}" + TEMPLATE
)
ENGINE_DEFAULTS: dict[str, Any] = {"house": "acme", "enable_thinking": False}


@pytest.fixture(scope="module")
def flagged(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A `vllm serve` started with the four flags that change how it renders a chat:
    `--chat-template`, `--chat-template-content-format openai` (the template prints
    `m['content']`, which `auto` reads as a string), `--default-chat-template-kwargs` and
    `--exclude-tools-when-tool-choice-none`."""
    logs = tmp_path_factory.mktemp("engine-template")
    template = logs / "engine.jinja"
    template.write_text(ENGINE_TEMPLATE)
    args = ["--chat-template", str(template), "--chat-template-content-format", "openai",
            "--default-chat-template-kwargs", json.dumps(ENGINE_DEFAULTS),
            "--exclude-tools-when-tool-choice-none"]  # fmt: skip
    vllm = engine(tiny_model, logs / "vllm.log", extra_args=args)
    start_all([vllm])
    settings = {"chat_template": str(template), "content_format": "openai",
                "default_kwargs": ENGINE_DEFAULTS, "exclude_tools_when_none": True}  # fmt: skip
    yield {"server": vllm, "settings": settings}
    vllm.stop()


def test_the_engines_template_flags_are_followed(
    flagged: dict[str, Any], tiny_model: str
) -> None:
    """The router given the engine's settings tokenizes its chats as the engine does
    (the request's own kwargs over the defaults; None counts as unset); without any one of
    them, it does not."""
    server, settings = flagged["server"], flagged["settings"]
    tok = RouterTokenizer(Path(tiny_model), **settings)
    partial = [RouterTokenizer(Path(tiny_model), **{**settings, drop: None})
               for drop in ("chat_template", "default_kwargs")]  # fmt: skip
    partial.append(RouterTokenizer(Path(tiny_model), **{**settings, "content_format": "auto"}))
    for kwargs in ({}, {"house": "beta"}, {"house": None}):
        body = {"model": "tiny", "messages": TOOL_CHAT, "tools": TOOLS,
                "chat_template_kwargs": kwargs}  # fmt: skip
        status, want = http_json("POST", server.url + "/tokenize", body)
        assert status == 200, want
        assert tok.chat_tokens(body) == want["tokens"], tok.render_chat(body)
        for other in partial:
            assert other.chat_tokens(body) != want["tokens"]
    # an effort turns thinking on over the default, as vLLM merges them
    body = {"messages": TOOL_CHAT[:1] * 9, "reasoning_effort": "high", "max_tokens": 1}
    _engine_agrees(server, tok.chat_tokens(body), "/v1/chat/completions", body)
    # tool_choice "none": the tools are left out (the router without the setting renders them)
    body = {"messages": TOOL_CHAT[:1] * 9, "tools": TOOLS, "tool_choice": "none",
            "max_tokens": 1}  # fmt: skip
    _engine_agrees(server, tok.chat_tokens(body), "/v1/chat/completions", body)
    keeps = RouterTokenizer(Path(tiny_model), **{**settings, "exclude_tools_when_none": False})
    assert keeps.chat_tokens(body) != tok.chat_tokens(body)


def test_the_parity_probe_passes_only_with_the_engines_settings(
    flagged: dict[str, Any], tiny_model: str
) -> None:
    """What a router would log at start-up: its chat probe matches the engine's with the
    settings given (`ok`), and is a `mismatch` (the workers put in fallback) without them."""
    server, settings = flagged["server"], flagged["settings"]

    async def probe(tok: RouterTokenizer) -> tuple[str, str]:
        async with aiohttp.ClientSession() as session:
            return await check(session, server.url, Probes.build(tok, "tiny"))

    assert asyncio.run(probe(RouterTokenizer(Path(tiny_model), **settings))) == ("ok", "")
    result, where = asyncio.run(probe(RouterTokenizer(Path(tiny_model))))
    assert result == "mismatch" and where.startswith("chat probe"), where


@pytest.fixture(scope="module")
def named(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The tiny model's folder with named templates, as transformers 5 saves them
    (chat_template.jinja, the "default", and additional_chat_templates/tool_use.jinja), and a
    `vllm serve` of it without `--chat-template`."""
    root = tmp_path_factory.mktemp("named-templates")
    folder = root / "model"
    folder.mkdir()
    for f in Path(tiny_model).iterdir():
        if f.suffix == ".safetensors":
            (folder / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("<tool_use>" + TEMPLATE)
    vllm = engine(str(folder), root / "vllm.log")
    start_all([vllm])
    yield {"server": vllm, "folder": folder}
    vllm.stop()


def test_named_templates_are_picked_as_transformers_and_vllm_pick_them(
    named: dict[str, Any],
) -> None:
    """transformers' own `get_chat_template` (which vLLM and SGLang call) and the router pick
    the same template for each request; vLLM's `/tokenize` of a tool chat (its "tool_use"
    template) and of a plain one equals the router's ids."""
    from transformers import AutoTokenizer

    folder = named["folder"]
    hf = AutoTokenizer.from_pretrained(str(folder))
    templates = ChatTemplates(_environment(), *folder_templates(folder, {}), "in the folder")
    for requested, tools in ((None, None), (None, TOOLS), ("tool_use", None), ("default", TOOLS),
                             ("{{ 'own' }}", TOOLS)):  # fmt: skip
        want = hf.get_chat_template(requested, tools=tools)
        assert templates.pick(requested, tools is not None).source == want, (requested, tools)
    tok = RouterTokenizer(folder)
    for body in ({"messages": TOOL_CHAT, "tools": TOOLS}, {"messages": TOOL_CHAT}):
        sent = {"model": "tiny", **body}
        status, want_ids = http_json("POST", named["server"].url + "/tokenize", sent)
        assert status == 200, want_ids
        assert tok.chat_tokens(sent) == want_ids["tokens"], tok.render_chat(sent)
    assert tok.render_chat({"messages": TOOL_CHAT, "tools": TOOLS}).startswith("<tool_use>")
