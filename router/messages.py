"""The Anthropic Messages API (`POST /v1/messages`) as the router reads it: the chat its body
renders to (placed by cached prefix like a chat), its usage, its SSE events and its error shape.

vLLM 0.32 serves the API by converting the body into a chat completion request
(`AnthropicServingMessages.to_chat_completion_request`) and rendering that chat as any other;
`chat_view` makes the same chat for the router's tokenizer: `system` (text blocks joined, Claude
Code's `x-anthropic-billing-header` blocks left out, as vLLM leaves them out to keep prefixes
cacheable) as the first system message; each message's text blocks as its content (one block: a
string), `thinking` blocks as its reasoning, `tool_use` blocks as tool calls, a user's
`tool_result` blocks as tool messages before it; tools as function tools (`tool_choice` "auto"
unless the client chose); `output_config.effort` as the reasoning effort, `thinking.type`
"disabled" as the effort vLLM probes for it (`disabled_effort`). Inline system messages (role
`system` inside `messages`) stay where they are, or join the first system message when the chat
template refuses a system message after the first (vLLM's probe, `merges_inline_system`).
Anything else (images, tool results that are not text, tool additions and removals) is placed
by load alone. SGLang 0.5 converts a body its own way (`router.messages_sglang`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jinja2
import msgspec

from router.anthropic_blocks import str_field, tool_call
from router.chat_shape import PromptError
from router.chat_template import bare_environment
from router.errors import ApiError
from router.messages_sglang import sglang_chat

PATH = "/v1/messages"
COUNT_TOKENS_PATH = PATH + "/count_tokens"
_BILLING = "x-anthropic-billing-header"
_TOOL_CHANGES = ("tool_addition", "tool_removal")
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
"""vLLM 0.32's `AnthropicEffort` values, in its order."""


def anthropic_shaped(path: str) -> bool:
    """Whether the router's own errors on `path` take Anthropic's shape: /v1/messages and the
    paths under it (`count_tokens`)."""
    return path.startswith(PATH)


def error_event(status: int, message: str) -> bytes:
    """The SSE event that ends a started Messages stream the upstream broke."""
    body = ApiError(status, message).anthropic_body()
    return b"event: error\ndata: " + msgspec.json.encode(body) + b"\n\n"


def rejects_inline_system(template: str | None) -> bool:
    """vLLM 0.32's probe (`_detect_merge_inline_system`): whether `template` fails to render
    [system, user, system, user] in its bare sandbox (no globals: a template that calls
    `raise_exception` fails there); no template counts as failing."""
    if not template:
        return True
    env = bare_environment()
    turns = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        env.from_string(template).render(messages=turns, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def merges_inline_system(templates: Iterable[str | None]) -> bool:
    """Whether vLLM 0.32 merges inline system messages into the leading one: any of the
    templates a request without and with tools gets rejects them."""
    return any(rejects_inline_system(t) for t in templates)


def disabled_effort(render: Callable[[dict[str, Any]], str]) -> str:
    """The reasoning effort vLLM 0.32 sends the template for `thinking: {"type": "disabled"}`
    (`--anthropic-disabled-thinking-effort auto`): "low" when a one-line chat does not render
    with effort "none" or renders as with a thinking effort, else "none". `render` renders a
    chat completion body as the engine would."""

    def prompt(effort: str) -> str | None:
        try:
            return render({"messages": [{"role": "user", "content": "Hi"}],
                           "reasoning_effort": effort})  # fmt: skip
        except PromptError:
            return None

    none = prompt("none")
    if none is None or any(prompt(e) == none for e in _EFFORTS):
        return "low"
    return "none"


def _system_parts(system: Any) -> list[str]:
    """The top-level `system` as vLLM 0.32 collects it: a string whole, else its non-empty
    text blocks' texts but billing headers."""
    if isinstance(system, str):
        return [system] if system else []
    return [t for b in system if b.get("type") == "text" and (t := str_field(b, "text"))
            and not t.startswith(_BILLING)]  # fmt: skip


def _inline_text(content: Any) -> str | None:
    """An inline system message's text (vLLM's `_extract_system_text`: billing headers left
    out; None when nothing is left)."""
    if isinstance(content, str):
        return None if content.startswith(_BILLING) else content
    return "".join(parts) if (parts := _system_parts(content)) else None


def _tool_result(block: Mapping[str, Any]) -> dict[str, Any] | None:
    """A user's `tool_result` block as vLLM makes it a tool message (text only: None when it
    holds images or tool references, which vLLM turns into more messages)."""
    content = block.get("content")
    if isinstance(content, list):
        if not all(isinstance(i, dict) and i.get("type") in ("text", None) for i in content):
            return None
        texts = [i.get("text", "") for i in content if i.get("type") == "text"]
        if not all(isinstance(t, str) for t in texts):
            return None
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        return None
    call_id = block.get("tool_use_id")
    if not (call_id is None or isinstance(call_id, str)):
        return None
    return {"role": "tool", "tool_call_id": call_id or "", "content": content or ""}


def _message(msg: Mapping[str, Any], out: list[dict[str, Any]]) -> bool:
    """Append what vLLM 0.32 makes of one user or assistant message (a user's tool results
    first, as tool messages); False when the router cannot follow it."""
    role, content = msg["role"], msg["content"]
    shaped: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        shaped["content"] = content
        out.append(shaped)
        return True
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            if text := block.get("text"):
                if not isinstance(text, str):
                    return False
                parts.append({"type": "text", "text": text})
        elif kind == "thinking":
            if (thought := block.get("thinking")) is not None:
                if not isinstance(thought, str):
                    return False
                reasoning.append(thought)
        elif kind == "tool_use":
            if (call := tool_call(block)) is None:
                return False
            calls.append(call)
        elif kind == "tool_result" and role == "user":
            if (result := _tool_result(block)) is None:
                return False
            out.append(result)
        elif kind not in ("redacted_thinking", "tool_reference"):
            return False  # images; an assistant's tool results (vLLM prints Python reprs)
    if reasoning:
        shaped["reasoning"] = "".join(reasoning)
    if calls:
        shaped["tool_calls"] = calls
    if parts:
        shaped["content"] = parts[0]["text"] if len(parts) == 1 else parts
    if role == "assistant" or "content" in shaped:
        out.append(shaped)
    return True


def _valid(body: Mapping[str, Any]) -> bool:
    """The shapes `chat_view` reads (the engine's own model checks the rest and answers 400)."""
    messages, system = body.get("messages"), body.get("system")
    if not isinstance(messages, list) or not messages:
        return False
    if not (system is None or isinstance(system, str) or isinstance(system, list)
            and all(isinstance(b, dict) for b in system)):  # fmt: skip
        return False
    return all(
        isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
        and (isinstance(c := m.get("content"), str)
             or isinstance(c, list) and all(isinstance(b, dict) for b in c))
        for m in messages
    )  # fmt: skip


def _tools(body: Mapping[str, Any], view: dict[str, Any]) -> bool:
    """Tools and the tool choice as vLLM 0.32 converts them (`input_schema` gets its default
    `"type": "object"`); False when the router cannot follow them."""
    choice, tools = body.get("tool_choice"), body.get("tools")
    if isinstance(choice, dict):
        kind = choice.get("type")
        names = {"auto": "auto", "any": "required", "none": "none"}
        if kind == "tool":
            view["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif isinstance(kind, str) and kind in names:  # any JSON value: a list is unhashable
            view["tool_choice"] = names[kind]
        else:
            return False
    elif choice is not None:
        return False
    if tools is None:
        return True
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("input_schema"), dict) for t in tools
    ):
        return False
    view["tools"] = [
        {"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": {**t["input_schema"], "type": t["input_schema"].get("type", "object")},
            "strict": t.get("strict"), "defer_loading": t.get("defer_loading")}}
        for t in tools
    ]  # fmt: skip
    view.setdefault("tool_choice", "auto")
    return True


def chat_view(
    body: Mapping[str, Any],
    engine: str | None,
    merge_inline_system: Callable[[], bool],
    effort_when_disabled: Callable[[], str],
) -> dict[str, Any] | None:
    """The /v1/chat/completions body whose prompt `engine` ("sglang", else vLLM 0.32) makes of
    this Messages body (for vLLM its model, cache salt and template arguments kept; SGLang's
    conversion passes neither); None when the router cannot key it. `merge_inline_system` and
    `effort_when_disabled` are asked only when the body needs them (`merges_inline_system`,
    `disabled_effort`)."""
    if not _valid(body):
        return None
    if engine == "sglang":
        return sglang_chat(body, merge_inline_system)
    messages: list[dict[str, Any]] = body["messages"]
    if any(isinstance(m["content"], list) and any(b.get("type") in _TOOL_CHANGES
                                                  for b in m["content"]) for m in messages):
        return None  # tool additions and removals change the tools the template gets
    merge = any(m["role"] == "system" for m in messages) and merge_inline_system()
    system = _system_parts(body.get("system") or [])
    if merge:
        system += [t for m in messages if m["role"] == "system"
                   and (t := _inline_text(m["content"]))]  # fmt: skip
    chat: list[dict[str, Any]] = [{"role": "system", "content": "".join(system)}] if system else []
    for msg in messages:
        if msg["role"] == "system":
            if not merge and (text := _inline_text(msg["content"])):
                chat.append({"role": "system", "content": text})
        elif not _message(msg, chat):
            return None
    view: dict[str, Any] = {"messages": chat}
    if not _tools(body, view):
        return None
    thinking, config = body.get("thinking"), body.get("output_config")
    if isinstance(config, dict) and config.get("effort") is not None:
        view["reasoning_effort"] = config["effort"]
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        view["reasoning_effort"] = effort_when_disabled()
    for field in ("model", "cache_salt", "chat_template_kwargs"):
        if field in body:
            view[field] = body[field]
    return view


def openai_usage(usage: Any) -> dict[str, Any] | None:
    """A Messages usage block in the chat completion shape the router's accounting reads:
    vLLM's `input_tokens` leave out the cached ones (`cache_read_input_tokens`, present when
    the engine reports prompt token details) and those it cached anew."""
    if not isinstance(usage, Mapping):
        return None
    counts = [usage.get(k) for k in ("input_tokens", "cache_read_input_tokens",
                                     "cache_creation_input_tokens")]  # fmt: skip
    if not all(c is None or type(c) is int for c in counts) or counts[0] is None:
        return None
    shaped: dict[str, Any] = {"prompt_tokens": sum(c or 0 for c in counts)}
    if counts[1] is not None:
        shaped["prompt_tokens_details"] = {"cached_tokens": counts[1]}
    return shaped


class _Event(msgspec.Struct):
    """What the router reads of a Messages SSE event's data."""

    usage: dict[str, Any] | None = None


_read_event = msgspec.json.Decoder(_Event)
_FINAL = b"event: message_delta"
_LAST = (b"event: message_stop", b"event: error")
_DELTA = b"event: content_block_delta"


def event_usage(event: bytes) -> tuple[bool, dict[str, Any] | None]:
    """(whether `event` ends the stream, the usage it reports) for one SSE event of a
    Messages stream: `message_delta` carries the request's final usage, `message_stop` (or an
    `error` event) ends it."""
    if event.startswith(_LAST):
        return True, None
    if not event.startswith(_FINAL):
        return False, None
    _, _, data = event.partition(b"\ndata: ")
    try:
        usage = _read_event.decode(data).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False, None
    return False, openai_usage(usage)


def is_delta(event: bytes) -> bool:
    """Whether a Messages SSE event carries generated text or tool input."""
    return event.startswith(_DELTA)
