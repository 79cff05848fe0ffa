"""The chat SGLang 0.5 makes of an Anthropic Messages body
(`AnthropicServing._convert_to_chat_completion_request`), for the router to key it as the engine
renders it: texts, tool calls and results, tools, and inline system messages merged into the
first where its probe (`renders_inline_system`) says the template drops them; thinking and
efforts are placed by load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.anthropic_blocks import str_field, tool_call
from router.chat_template import bare_environment


def renders_inline_system(template: str | None) -> bool:
    """SGLang 0.5's probe (`detect_inline_system_support`): whether `template`, in a bare
    sandbox, renders a second system message's text where [system, user, system, user] has it;
    a template that raises or drops it does not (SGLang's /v1/messages then merges inline
    system messages into the leading one)."""
    if not template:
        return False
    env = bare_environment()
    mark = "__inline_system_probe__"
    turns = [{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
             {"role": "system", "content": mark}, {"role": "user", "content": "t"}]  # fmt: skip
    try:
        return mark in env.from_string(template).render(messages=turns, add_generation_prompt=False)
    except Exception:  # template code is data: SGLang counts any failure as "does not render"
        return False


def _system_text(content: Any) -> str | None:
    """An inline system message's text as SGLang 0.5 merges it (`_extract_system_text`): its
    text blocks stripped, the non-empty ones joined by newlines; None when nothing is left."""
    if isinstance(content, str):
        return content.strip() or None
    texts = [t.strip() for b in content if b.get("type") == "text" and (t := str_field(b, "text"))]
    return "\n".join(t for t in texts if t) or None


def _result(block: Mapping[str, Any]) -> tuple[list[Any], str] | None:
    """A `tool_result` block's content as SGLang 0.5 converts it (`_convert_tool_result_content`),
    text only: the tool message's contents (its non-empty texts as parts, a lone one as a
    string) and the text an assistant's result shows. None for images, search results and
    tool references (content parts a chat is placed by load for: `chat_shape.has_media`)."""
    content = block.get("content")
    if not isinstance(content, list):
        if not (content is None or isinstance(content, str)):
            return None
        return [content or ""], content or ""
    texts: list[str] = []
    for item in content:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            if not isinstance(text := item.get("text", ""), str):
                return None
            if text:
                texts.append(text)
        elif kind in ("image", "search_result", "tool_reference"):
            return None
    parts = [{"type": "text", "text": t} for t in texts]
    return [_content(parts)] if parts else [""], "\n".join(texts)


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's text parts as SGLang 0.5 gives its content: a lone part as its text."""
    return parts[0]["text"] if len(parts) == 1 else list(parts)


def _blocks(msg: Mapping[str, Any], out: list[dict[str, Any]]) -> bool:
    """Append what SGLang 0.5 makes of one message's blocks: text parts (one: a string),
    `tool_use` blocks as tool calls, a user's `tool_result` blocks as tool messages in their
    place among its texts, an assistant's as "Tool result: ..." text; an empty assistant
    message as "". False when the router cannot follow it (thinking that is not empty: its
    history depends on the server's reasoning parser; images, search results)."""
    role = msg["role"]
    pending: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    shaped: dict[str, Any] = {"role": role}

    def flush() -> None:
        if pending:
            out.append({"role": "user", "content": _content(pending)})
            pending.clear()

    for block in msg["content"]:
        kind = block.get("type")
        if kind in ("thinking", "redacted_thinking"):
            if role == "assistant" and (kind == "redacted_thinking" or block.get("thinking")):
                return False
        elif kind == "text":
            if not isinstance(text := block.get("text"), str):
                return False
            pending.append({"type": "text", "text": text})
        elif kind == "tool_use":
            if role != "assistant" or (call := tool_call(block)) is None:
                return False
            calls.append(call)
        elif kind == "tool_result":
            call_id = block.get("tool_use_id") or block.get("id") or ""
            if (result := _result(block)) is None or not isinstance(call_id, str):
                return False
            if role != "user":
                pending.append({"type": "text", "text": f"Tool result: {result[1]}"})
                continue
            flush()
            out.extend({"role": "tool", "tool_call_id": call_id, "content": c} for c in result[0])
        else:
            return False
    if calls:
        shaped["tool_calls"] = calls
    if pending:
        shaped["content"] = _content(pending)
    elif not calls:
        if role == "user":
            return True
        shaped["content"] = ""
    out.append(shaped)
    return True


_SERVER_TOOLS = ("web_search_", "computer_", "bash_", "text_editor_")
"""Type prefixes of Anthropic's server tools, which SGLang 0.5 leaves out of the chat."""


def _tools(body: Mapping[str, Any], view: dict[str, Any]) -> bool:
    """Tools and the tool choice as SGLang 0.5 converts them: server tools left out, each
    custom tool a function tool (`description` "" when unset, `input_schema` with its default
    `"type": "object"` last, `strict` false by default); the choice mapped ("auto" when there
    are tools and no choice). False when the router cannot follow them or SGLang refuses."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        return False
    converted = []
    for tool in tools:
        kind = tool.get("type")
        if isinstance(kind, str) and kind.startswith(_SERVER_TOOLS):
            continue
        schema = tool.get("input_schema")
        if kind not in (None, "custom") or not isinstance(schema, dict):
            return False
        function = {"name": tool.get("name"), "description": tool.get("description") or "",
                    "parameters": {**schema, "type": schema.get("type", "object")},
                    "strict": tool.get("strict", False)}  # fmt: skip
        converted.append(
            {"type": "function", "defer_loading": tool.get("defer_loading"), "function": function}
        )
    if converted:
        view["tools"] = converted
    if choice is None:
        if converted:
            view["tool_choice"] = "auto"
        return True
    kind = choice.get("type") if isinstance(choice, dict) else None
    names = [t["function"]["name"] for t in converted]
    if kind == "none":
        view["tool_choice"] = "none"
    elif kind in ("auto", "any") and names:
        view["tool_choice"] = "auto" if kind == "auto" else "required"
    elif kind == "tool" and choice.get("name") in names:
        view["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind != "auto":
        return False
    return True


def sglang_chat(
    body: Mapping[str, Any], merge_inline: Callable[[], bool]
) -> dict[str, Any] | None:
    """The chat SGLang 0.5 converts a Messages body to
    (`AnthropicServing._convert_to_chat_completion_request`): `system` (a string that is not
    blank, else its non-empty text blocks) and, where the template does not render them in
    place (`merge_inline`: not `renders_inline_system`), the inline system messages' texts,
    joined by newlines as the first system message; each message as `_blocks` makes
    it; tools as `_tools`. None for a request with thinking or an effort: SGLang sets
    them on the request it has already built, so they come without the thinking switches a
    chat's effort brings (`router.chat_shape.sglang_kwargs`), which a chat view cannot
    express."""
    config = body.get("output_config")
    if body.get("thinking") is not None or (
        isinstance(config, dict) and config.get("effort") is not None
    ):
        return None
    messages: list[dict[str, Any]] = body["messages"]
    merge = any(m["role"] == "system" for m in messages) and merge_inline()
    system = body.get("system")
    if isinstance(system, str):
        parts = [system] if system.strip() else []
    else:
        parts = [t for b in system or [] if b.get("type") == "text" and (t := str_field(b, "text"))]
    if merge:
        parts += [t for m in messages if m["role"] == "system"
                  and (t := _system_text(m["content"]))]  # fmt: skip
    chat: list[dict[str, Any]] = [{"role": "system", "content": "\n".join(parts)}] if parts else []
    for msg in messages:
        if msg["role"] == "system" and merge:
            continue
        if isinstance(msg["content"], str):
            chat.append({"role": msg["role"], "content": msg["content"]})
        elif not _blocks(msg, chat):
            return None
    view: dict[str, Any] = {"messages": chat}
    if not _tools(body, view):
        return None
    if "model" in body:
        view["model"] = body["model"]
    return view
