"""A tool conversation tokenizes in the router as vLLM 0.32 renders it: a real `vllm serve`
with a chat template that prints the tools and the tool calls (`--chat-template`; the tiny
model's own template ignores them) and its `/tokenize` against `RouterTokenizer.chat_tokens`
with the same template. vLLM hands the template its pydantic dump of the tools (nulls for
unset fields) and each assistant tool call's `arguments` parsed into an object; the router
rendered the client's dicts and the JSON string, so its prompt left the engine's at the
tools block and again at the first tool call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import engine, start_all

from router.tokenize import RouterTokenizer, vllm_tools
from warply.launch import http_json

TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "{{ m['content'] or '' }}{% for c in m.get('tool_calls') or [] %}"
    "<call>{{ c['function']['name'] }}({{ c['function']['arguments'] | tojson }})</call>"
    "{% endfor %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
)
CALLS: list[dict[str, Any]] = [
    {"id": "c1", "type": "function",
     "function": {"name": "lookup", "arguments": '{"block": 7, "tier": "cpu"}'}},
    {"id": "c2", "type": "function", "function": {"name": "list_tiers", "arguments": ""}},
]  # fmt: skip
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"block": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "list_tiers", "description": "the tiers",
                                      "strict": True}},
]  # fmt: skip
MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "Where is block 7?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c1", "content": "cpu"},
    {"role": "tool", "tool_call_id": "c2", "content": "gpu, cpu, disk"},
    {"role": "assistant", "content": "On the cpu tier.", "tool_calls": []},
    {"role": "user", "content": "And block 8?"},
]


def test_tool_calls_tokenize_as_vllm_renders_them(tiny_model: str, tmp_path: Path) -> None:
    template = tmp_path / "tools.jinja"
    template.write_text(TEMPLATE)
    args = ["--chat-template", str(template)]
    server = engine(tiny_model, tmp_path / "vllm.log", extra_args=args)
    start_all([server])
    try:
        tok = RouterTokenizer(Path(tiny_model))
        for gen in (True, False):
            body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                    "add_generation_prompt": gen}  # fmt: skip
            status, want = http_json("POST", server.url + "/tokenize", body)
            assert status == 200, want
            mine = {**json.loads(json.dumps(body)), "chat_template": TEMPLATE,
                    "tools": vllm_tools(TOOLS)}  # fmt: skip
            assert tok.chat_tokens(mine) == want["tokens"], (gen, tok.render_chat(mine))
    finally:
        server.stop()
