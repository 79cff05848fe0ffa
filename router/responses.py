"""The OpenAI Responses API (`POST /v1/responses`) as the router reads it: the chat its input
renders to (placed by cached prefix like a chat), the id it gives a response (naming the worker
that answered, so that a follow-up's `previous_response_id`, `GET /v1/responses/{id}` and its
cancel reach the engine that stored the response) and its SSE events.

vLLM 0.32 and SGLang 0.5 render a Responses input through the chat template, each its own way.
The router keys (places by prefix) only the inputs both render alike (and tokenizes them as the
engine its workers' `/v1/models` cards name does: `chat_view`): `instructions` as the
first system message, then a string input as one user message, or message items of role user
or assistant whose content is a string or `input_text` / `output_text` parts, with no tools and
no reasoning options. Anything else (tool calls and outputs, system or developer items, a chain
through `previous_response_id`, whose history only the engine holds) is placed by load alone.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

PATH = "/v1/responses"
_PREFIX = "resp_"
_TAG_HEX = 8
_TEXT_PARTS = frozenset(("input_text", "output_text"))


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


def _text(content: Any, single: bool) -> Any:
    """A message item's content as chat content: a string as it is, `input_text` /
    `output_text` parts as text parts (`single`: only one part, as vLLM 0.32 keeps only an
    assistant item's first); None when it has anything else."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content or (single and len(content) > 1):
        return None
    parts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS:
            return None
        if not isinstance(text := part.get("text"), str):
            return None
        parts.append({"type": "text", "text": text})
    return parts


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages of a keyable input, or None."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            return None
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        return None
    for item in given:
        if not isinstance(item, Mapping) or item.get("type", "message") != "message":
            return None
        role = item.get("role")
        if role not in ("user", "assistant"):
            return None
        if role == "assistant" and messages and messages[-1]["role"] == "assistant":
            return None  # consecutive assistant turns: SGLang merges them, vLLM does not
        content = _text(item.get("content"), single=role == "assistant")
        if content is None:
            return None
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] == "assistant":
        return None  # vLLM continues a final assistant message
    return messages


def chat_view(body: Mapping[str, Any], special_tokens: bool = True) -> dict[str, Any] | None:
    """The /v1/chat/completions body whose prompt the engine makes of this Responses body (its
    model, cache salt and template arguments kept); None when the router cannot key it.
    `special_tokens`: vLLM 0.32 tokenizes a response's rendered chat with the tokenizer's
    special tokens added (`ResponsesRequest.build_tok_params` leaves `add_special_tokens` at
    its default, True; a chat completion's is False), so a tokenizer that adds a BOS puts a
    second one in front of the template's; SGLang 0.5 renders it as its chat (False)."""
    if body.get("tools") or body.get("reasoning") is not None:
        return None
    if body.get("previous_response_id") is not None:
        return None
    messages = _messages(body)
    if messages is None:
        return None
    view: dict[str, Any] = {"messages": messages, "add_special_tokens": special_tokens}
    for field in ("model", "cache_salt", "chat_template_kwargs"):
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
