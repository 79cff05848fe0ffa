"""The OpenAI Responses API (`POST /v1/responses`) as the router reads it: the chat its input
renders to (placed by cached prefix like a chat), the id it gives a response (naming the worker
that answered, so that a follow-up's `previous_response_id`, `GET /v1/responses/{id}` and its
cancel reach the engine that stored the response) and its SSE events.

vLLM 0.32 and SGLang 0.5 render a Responses input through the chat template, each its own way.
The router keys (places by prefix) the chat the engine its workers' `/v1/models` cards name
makes of an input (`chat_view`): `instructions` as the first system message, then a string
input as one user message, or the input items. For vLLM: text messages of every role,
function and custom tool calls (namespaced ones too) and their outputs, reasoning items,
function, custom and namespace tools and a reasoning effort, as vLLM 0.32 merges and renders
them. For SGLang, as SGLang 0.5 converts them (`router.responses_sglang`): messages of every
role (developer ones labelled), function and custom tool calls and their outputs, reasoning
items, consecutive assistant messages merged, function and custom tools, a reasoning effort.
Anything else (images, built-in tools, a chain through `previous_response_id`, whose history
only the engine holds) is placed by load alone.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from router import custom_tools
from router.errors import ApiError
from router.responses_sglang import sglang_chat

PATH = "/v1/responses"
_PREFIX = "resp_"
_TAG_HEX = 8
_TEXT_PARTS = ("input_text", "output_text")
"""A tuple, not a set: a client's `type` may be any JSON value, a list among them (unhashable)."""


def worker_tag(worker: str) -> str:
    """The hex digits a response id carries for the worker that answered it: the same on every
    router replica and across restarts (a digest of the worker's configured name)."""
    return hashlib.blake2b(worker.encode(), digest_size=_TAG_HEX // 2).hexdigest()


def new_response_id(worker: str) -> str:
    """A fresh response id (the engine's `request_id`, which both engines answer as the
    response's `id`) that names `worker`."""
    return f"{_PREFIX}{worker_tag(worker)}{uuid.uuid4().hex}"


def owner(response_id: str, workers: Iterable[str]) -> str | None:
    """The worker whose tag `response_id` carries (None: an id the router did not make, or a
    tag that names no current worker or more than one)."""
    if not response_id.startswith(_PREFIX):
        return None
    tag = response_id[len(_PREFIX) : len(_PREFIX) + _TAG_HEX]
    named = [w for w in workers if worker_tag(w) == tag]
    return named[0] if len(named) == 1 else None


def holder_unavailable(worker: str, response_id: str, param: str | None = None) -> ApiError:
    """The 503 for a request that only `worker` can answer (it stored `response_id`) while it
    cannot (down, draining, or already tried)."""
    message = f"worker {worker}, which stored response {response_id!r}, is not available"
    return ApiError(503, message, "no_healthy_worker", param)


def _text(content: Any) -> Any:
    """A message item's content as chat content: a string as it is, `input_text` /
    `output_text` parts as text parts; None when it has anything else."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        return None
    parts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS:
            return None
        if not isinstance(text := part.get("text"), str):
            return None
        parts.append({"type": "text", "text": text})
    return parts


def _instructions(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """`instructions` as the first system message (none: no message); None when not text."""
    instructions = body.get("instructions")
    if not instructions:
        return []
    if not isinstance(instructions, str):
        return None
    return [{"role": "system", "content": instructions}]


def _tool_call(item: Mapping[str, Any]) -> dict[str, Any] | None:
    """A `function_call` item as vLLM 0.32 makes it an assistant's tool call (a namespaced
    one named `NAMESPACE__NAME`), or a `custom_tool_call` item as a call of its function shim
    (the input as `{"input": ...}`); None when a field is not text."""
    call_id, name = item.get("call_id"), item.get("name")
    if item.get("type") == "custom_tool_call":
        payload = item.get("input") or ""
        if not isinstance(payload, str):
            return None
        arguments: Any = custom_tools.arguments(payload)
    else:
        arguments, namespace = item.get("arguments"), item.get("namespace")
        if namespace is not None:
            name = f"{namespace}__{name}" if isinstance(namespace, str) else None
    if not all(isinstance(f, str) for f in (call_id, name, arguments)):
        return None
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning_text(item: Mapping[str, Any]) -> str | None:
    """A `reasoning` item's text as vLLM 0.32 reads it: its first content part's, else its
    first summary part's, else ""; None for encrypted reasoning (vLLM refuses it)."""
    if item.get("encrypted_content"):
        return None
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            first = parts[0]
            text = first.get("text") if isinstance(first, Mapping) else None
            return text if isinstance(text, str) else None
    return ""


def _vllm_messages(given: list[Any]) -> list[dict[str, Any]] | None:
    """The chat vLLM 0.32 makes of input items (`construct_chat_messages_with_tool_call`):
    user, system and developer messages as they are; a function call, a reasoning item and
    an assistant message's text each join the assistant message before them while it lacks
    that part (else each starts a new one), as does a custom tool call (`_tool_call`); a
    function or custom tool call's output as a tool message. None for anything else (outputs
    that are not text, images, encrypted reasoning)."""
    messages: list[dict[str, Any]] = []
    for item in given:
        if not isinstance(item, Mapping):
            return None
        kind = item.get("type", "message")
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind in ("function_call", "custom_tool_call"):
            if (call := _tool_call(item)) is None:
                return None
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(output, str) or not isinstance(call_id, str):
                return None
            messages.append({"role": "tool", "content": output, "tool_call_id": call_id})
        elif kind == "reasoning":
            if (text := _reasoning_text(item)) is None:
                return None
            if last is not None and last.get("reasoning") is None:
                last["reasoning"] = text
            else:
                messages.append({"role": "assistant", "reasoning": text})
        elif kind == "message" and item.get("role") == "assistant":
            content = _text(item.get("content"))
            if content is None:
                return None
            text = content if isinstance(content, str) else content[0]["text"]
            if last is not None and last.get("content") is None:
                last["content"] = text
            else:
                messages.append({"role": "assistant", "content": text})
        elif kind == "message" and item.get("role") in ("user", "system", "developer"):
            if (content := _text(item.get("content"))) is None:
                return None
            messages.append({"role": item["role"], "content": content})
        else:
            return None
    return messages


def _vllm_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses tools in the chat shape vLLM 0.32 renders them in (`construct_tool_dicts`,
    `get_function_tools`): function tools as they are, a custom tool as its single-string
    function shim, a namespace's function tools each named `NAMESPACE__NAME` (its custom ones
    are not shown). None when one is of another type (built-in tools, which vLLM does not
    render) or not an object."""
    if not isinstance(tools, list):
        return None
    functions: list[Mapping[str, Any]] = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind == "function":
            functions.append(tool)
        elif kind == "custom":
            functions.append({"name": tool.get("name"), "description": tool.get("description"),
                              "parameters": custom_tools.PARAMETERS})  # fmt: skip
        elif kind == "namespace" and isinstance(members := tool.get("tools"), list):
            if not isinstance(tool.get("name"), str) or not all(
                isinstance(m, Mapping) for m in members
            ):
                return None
            functions.extend({**m, "name": f"{tool['name']}__{m.get('name')}"}
                             for m in members if m.get("type") == "function")  # fmt: skip
        else:
            return None
    return [
        {"type": "function", "function": {k: v for k, v in f.items() if k != "type"}}
        for f in functions
    ]


def chat_view(
    body: Mapping[str, Any],
    engine: str | None = None,
    merge_inline_system: Callable[[], bool] = bool,
) -> dict[str, Any] | None:
    """The /v1/chat/completions body whose prompt `engine` ("sglang", else vLLM 0.32) makes of
    this Responses body (its model, cache salt and template arguments kept); None when the
    router cannot key it. vLLM 0.32 tokenizes a response's rendered chat with the tokenizer's
    special tokens added (`ResponsesRequest.build_tok_params` leaves `add_special_tokens` at
    its default, True; a chat completion's is False), so a tokenizer that adds a BOS puts a
    second one in front of the template's; SGLang 0.5 renders it as its chat (False), its own
    way (`router.responses_sglang`, which asks `merge_inline_system` whether the template
    drops system messages after the first)."""
    if body.get("previous_response_id") is not None:
        return None  # its history is the engine's
    messages = _instructions(body)
    given = body.get("input")
    if messages is None or not given or not isinstance(given, (str, list)):
        return None
    if engine == "sglang":
        items = [{"role": "user", "content": given}] if isinstance(given, str) else given
        return sglang_chat(body, items, merge_inline_system)
    view: dict[str, Any] = {"add_special_tokens": True}
    if isinstance(given, str):
        chat: list[dict[str, Any]] | None = [{"role": "user", "content": given}]
    else:
        chat = _vllm_messages(given)
    if chat is None or chat[-1]["role"] == "assistant":
        return None  # vLLM continues a final assistant message
    if body.get("tools"):
        if (tools := _vllm_tools(body["tools"])) is None:
            return None
        view["tools"] = tools
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, Mapping):
            return None
        view["reasoning_effort"] = reasoning.get("effort")
    view["messages"] = messages + chat
    for field in ("model", "cache_salt", "chat_template_kwargs", "tool_choice"):
        if field in body:
            view[field] = body[field]
    return view


class _Done(msgspec.Struct):
    """What the router reads of the last event of a Responses stream."""

    response: dict[str, Any] | None = None


_read_done = msgspec.json.Decoder(_Done)
_LAST_EVENTS = (b"event: response.completed", b"event: response.incomplete",
                b"event: response.failed")  # fmt: skip
_DELTA = b"event: response.output_text.delta"
_BEFORE_OUTPUT = (b"event: response.created", b"event: response.in_progress",
                  b"event: response.queued")  # fmt: skip


def event_usage(event: bytes) -> tuple[bool, dict[str, Any] | None]:
    """(whether `event` ends the stream, the usage it reports) for one SSE event of a
    Responses stream (`event: TYPE` then `data: JSON`)."""
    if not event.startswith(_LAST_EVENTS):
        return False, None
    _, _, data = event.partition(b"\ndata: ")
    try:
        response = _read_done.decode(data).response
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True, None
    usage = response.get("usage") if response is not None else None
    return True, usage if isinstance(usage, dict) else None


def is_output(event: bytes) -> bool:
    """Whether a Responses SSE event comes from the model's output: the engines send
    `response.created` and `response.in_progress` before prefilling the prompt, so the first
    output event is the one that times the first token."""
    return not event.startswith(_BEFORE_OUTPUT)


def is_delta(event: bytes) -> bool:
    """Whether a Responses SSE event carries generated text."""
    return event.startswith(_DELTA)


def error_event(status: int, message: str) -> bytes:
    """The SSE event that ends a started Responses stream the upstream broke (the Responses
    API's `error` event)."""
    body = {"type": "error", "code": str(status), "message": message, "param": None}
    return b"event: error\ndata: " + msgspec.json.encode(body) + b"\n\n"
