"""The chat SGLang 0.5 makes of a Responses body (`OpenAIServingResponses._make_request` on a
server without a harmony, Beam or Muse model), for the router to key it as the engine renders
it: the input items as chat messages, consecutive assistant messages merged, system messages
merged where the template drops inline ones, function and custom tools as function tools, the
tool choice and reasoning effort as the chat request it builds takes them. The chat then goes
through the router's SGLang chat shaping (`router.chat_shape`) as SGLang's own does.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from router import custom_tools

_DEVELOPER_LABEL = "Developer instructions:"
"""The line SGLang 0.5 puts before a developer message's text (`label_developer_content`)."""
_REASONING_STATE = "sglang-reasoning-v1."
"""The prefix of the reasoning blob SGLang 0.5 hands a store=false client (`encode_reasoning_state`:
the text zlib-compressed, URL-safe base64): no secret, so a replayed one can be read."""
_DROPPED = ("id", "status", "type")


class _Unkeyed(Exception):
    """The router cannot follow this input as SGLang converts it (or SGLang refuses it)."""


def _labelled(content: Any) -> Any:
    """A developer message's content with SGLang's label line before its first text."""
    if isinstance(content, str):
        return f"{_DEVELOPER_LABEL}\n{content}"
    if isinstance(content, list):
        for i, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                return [*content[:i], {**part, "text": f"{_DEVELOPER_LABEL}\n{part['text']}"},
                        *content[i + 1:]]  # fmt: skip
        return [{"type": "input_text", "text": _DEVELOPER_LABEL}, *content]
    return content


def _part(part: Any) -> Any:
    """A content part as SGLang 0.5 hands it to the chat (`input_text` / `output_text` as text);
    images and anything not an object are not followed."""
    if not isinstance(part, dict):
        raise _Unkeyed
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind != "text":
        raise _Unkeyed  # images (placed by load) and parts SGLang's chat model refuses
    return part


def _call(item: Mapping[str, Any]) -> dict[str, Any]:
    """A `function_call` (its arguments a JSON object's text, "{}" when they are not one) or
    `custom_tool_call` item (its input as `{"input": ...}`) as an assistant's tool call."""
    if item.get("type") == "custom_tool_call":
        arguments = custom_tools.arguments(item.get("input") or "")
    else:
        raw = item.get("arguments")
        if isinstance(raw, dict):
            arguments = json.dumps(raw)
        else:
            try:
                parsed = json.loads(raw) if isinstance(raw, str) and raw else None
            except ValueError:
                parsed = None
            arguments = raw if isinstance(parsed, dict) and isinstance(raw, str) else "{}"
    call = {"id": item.get("call_id") or item.get("id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": arguments}}  # fmt: skip
    return {"role": "assistant", "tool_calls": [call]}


def _texts(parts: Any) -> list[str]:
    """The non-empty texts of a reasoning item's summary or content parts."""
    if parts is not None and not isinstance(parts, list):
        raise _Unkeyed
    texts: list[str] = []
    for part in parts or []:
        if text := part.get("text") if isinstance(part, dict) else None:
            if not isinstance(text, str):
                raise _Unkeyed
            texts.append(text)
    return texts


def _reasoning(item: Mapping[str, Any]) -> str | None:
    """A reasoning item's text: its summary texts, else its content texts, else the text its
    SGLang blob holds (`encrypted_content`), joined by newlines; None when there is none."""
    texts = _texts(item.get("summary")) or _texts(item.get("content"))
    blob = item.get("encrypted_content")
    if not texts and isinstance(blob, str) and blob.startswith(_REASONING_STATE):
        try:
            texts = [zlib.decompress(base64.urlsafe_b64decode(blob[len(_REASONING_STATE):]))
                     .decode("utf-8")]  # fmt: skip
        except (ValueError, binascii.Error, zlib.error):
            texts = []
    return "\n".join(texts) or None


def _message(item: Mapping[str, Any]) -> dict[str, Any] | None:
    """One input item as SGLang 0.5 makes it a chat message (`_normalize_response_message_for
    _chat`); None for a reasoning item without text, which it drops."""
    if item.get("role") == "developer":
        item = {**item, "role": "system", "content": _labelled(item.get("content"))}
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        return _call(item)
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output", "")
        if isinstance(output, list):
            texts = [p.get("text", "") for p in output if isinstance(p, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise _Unkeyed  # SGLang 0.5's own join of them fails
            output = "".join(texts)
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
    if kind == "reasoning":
        text = _reasoning(item)
        return None if text is None else {"role": "assistant", "reasoning_content": text}
    if kind not in (None, "message"):
        raise _Unkeyed  # SGLang refuses other item types
    message = {k: v for k, v in item.items() if v is not None and k not in _DROPPED}
    if isinstance(content := item.get("content"), list):
        message["content"] = [_part(p) for p in content]
    return message


def _parts(content: Any) -> list[Any]:
    if isinstance(content, list):
        return list(content)
    return [{"type": "text", "text": content}] if isinstance(content, str) and content else []


def _merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive assistant messages of one phase (or after one that holds only reasoning)
    as one, as SGLang 0.5 renders a turn (`_merge_consecutive_assistant_messages`): texts
    joined by a blank line (parts appended where either is a list), tool calls appended,
    reasoning joined by a newline."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        prev = out[-1] if out and out[-1].get("role") == "assistant" else None
        joins = prev is not None and (
            prev.get("phase") == msg.get("phase") or set(prev) == {"role", "reasoning_content"}
        )
        if msg.get("role") != "assistant" or prev is None or not joins:
            out.append(msg)
            continue
        prev = out[-1] = dict(prev)
        if msg.get("phase") is not None:
            prev["phase"] = msg["phase"]
        new, old = msg.get("content"), prev.get("content")
        if new is not None and new != "":
            if old is None or old == "":
                prev["content"] = new
            elif isinstance(old, str) and isinstance(new, str):
                prev["content"] = old + "\n\n" + new
            else:
                prev["content"] = _parts(old) + _parts(new)
        if calls := msg.get("tool_calls"):
            prev["tool_calls"] = (prev.get("tool_calls") or []) + list(calls)
        if thought := msg.get("reasoning_content"):
            before = prev.get("reasoning_content")
            prev["reasoning_content"] = f"{before}\n{thought}" if before else thought
    return out


def _system_merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every system message's text (a list's text parts) joined by blank lines into one first
    system message, as SGLang 0.5 does where the template does not render inline ones."""
    chunks: list[str] = []
    others = []
    for m in messages:
        if m.get("role") != "system":
            others.append(m)
        elif isinstance(content := m.get("content"), str):
            chunks.append(content)
        elif isinstance(content, list):
            chunks.extend(p["text"] for p in content if isinstance(p.get("text"), str))
    return [{"role": "system", "content": "\n\n".join(chunks)}, *others] if chunks else others


def _description(tool: Mapping[str, Any]) -> str | None:
    """A custom tool's description with its grammar described (`custom_tool_description`)."""
    described = tool.get("description")
    if described is not None and not isinstance(described, str):
        raise _Unkeyed  # SGLang's request model refuses it
    parts = [described] if described else []
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax") or "lark", fmt.get("definition") or ""
        parts.append(f"The payload must conform to this {syntax} grammar:\n{definition}")
    return "\n\n".join(parts) or None


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools as they are and named custom tools as their single-string function, as
    SGLang 0.5 hands them to a chat (`_response_tools_to_chat_tools`); other tool types
    (built-in ones take another path in SGLang; namespaces are shown only to Muse) are not
    followed."""
    if not isinstance(tools, list):
        raise _Unkeyed
    out = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            description, parameters = tool.get("description"), tool.get("parameters")
        elif kind == "custom" and tool.get("name"):
            description, parameters = _description(tool), custom_tools.PARAMETERS
        else:
            raise _Unkeyed
        out.append({"type": "function", "function": {
            "name": tool.get("name"), "description": description, "parameters": parameters,
            "strict": tool.get("strict", False)}})  # fmt: skip
    return out


def _tool_choice(choice: Any) -> Any:
    """The chat tool choice SGLang 0.5 makes of a Responses one (`effective_tool_choice`): a
    named function or custom tool as a named function, any other object as "auto"."""
    if not isinstance(choice, dict):
        return choice
    function = choice.get("function")
    if function is not None and not isinstance(function, dict):
        raise _Unkeyed  # SGLang's request model refuses it
    name = choice.get("name") or (function or {}).get("name")
    if choice.get("type") in ("function", "custom") and name:
        return {"type": "function", "function": {"name": name}}
    return "auto"


def sglang_chat(
    body: Mapping[str, Any], items: list[Any], merge_inline_system: Callable[[], bool]
) -> dict[str, Any] | None:
    """The chat completion body SGLang 0.5 builds from this Responses body whose input is
    `items` (instructions first), or None when the router cannot follow it.
    `merge_inline_system` says whether the template drops inline system messages: then SGLang
    joins every system message's text into one first message, even a lone one's parts."""
    try:
        messages = [{"role": "system", "content": body["instructions"]}] if body.get(
            "instructions") else []  # fmt: skip
        messages += [m for item in items if (m := _message(item)) is not None]
        messages = _merged(messages)
        if merge_inline_system():
            messages = _system_merged(messages)
        tools = _tools(body.get("tools") or [])
        choice = _tool_choice(body.get("tool_choice", "auto")) if tools else None
    except _Unkeyed:
        return None
    view: dict[str, Any] = {"messages": messages, "add_special_tokens": False}
    if tools:
        view["tools"] = tools
        view["tool_choice"] = choice
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort", "medium") is not None:
        view["reasoning_effort"] = reasoning.get("effort", "medium")
    elif reasoning is not None and not isinstance(reasoning, dict):
        return None
    for field in ("model", "cache_salt", "chat_template_kwargs"):
        if field in body:
            view[field] = body[field]
    return view
