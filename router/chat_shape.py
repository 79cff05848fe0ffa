"""How each engine reshapes a chat before its template renders it, so that the router renders
the prompt the engine will: vLLM 0.32 (`_parse_chat_message_content`, `build_chat_params`,
the developer-role conversion, its content formats) and SGLang 0.5 (`_apply_jinja_template`:
each message's pydantic dump, `process_content_for_template_format`,
`normalize_tool_content`). A request whose chat differs past what is reproduced here may be
predicted from another prompt than the engine's; the differences known are in docs/router.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class PromptError(ValueError):
    """The request's prompt or messages cannot be tokenized (the router answers 400)."""


def _texts(content: list[Any]) -> list[str]:
    """The texts of a content list's text parts. Other parts (images, audio, video) are left
    out: such a prompt is placed by load alone (`has_media`)."""
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or not isinstance(kind := part.get("type"), str):
            raise PromptError("each content part needs a string 'type'")
        if kind != "text":
            continue
        if not isinstance(text := part.get("text"), str):
            raise PromptError("a text content part needs a string 'text'")
        texts.append(text)
    return texts


def _message_content(content: Any) -> Any:
    """vLLM's "string" content format: text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_texts(content))
    raise PromptError("message content must be a string or a list of content parts")


def _text_parts(content: Any) -> list[dict[str, str]]:
    """vLLM's "openai" content format (`router.content_format`): a string as one text part,
    none as no part, a list's text parts as they are (without keys other than `type` and
    `text`)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [{"type": "text", "text": t} for t in _texts(content)]
    raise PromptError("message content must be a string or a list of content parts")


def _arguments(value: Any) -> Any:
    """A tool call's `arguments` as the template gets them: a JSON object string parsed to a
    dict, nothing (or "") as {}, anything else that is not an object as {}."""
    if not value:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


def _with_parsed_arguments(message: Mapping[str, Any]) -> dict[str, Any]:
    """An assistant message whose tool calls' `arguments` the template gets as dicts, as vLLM
    0.32 renders them (`_postprocess_messages`: Transformers' templates iterate them as
    mappings; a string that is not a JSON object as {}); an empty `tool_calls` list is
    dropped, as vLLM drops it. Without this, a tool conversation's prompt differed from the
    engine's from its first tool call on (SGLang's parsing: `_sglang_call`)."""
    calls = message["tool_calls"]
    out = dict(message)  # the keys in their order: the parsed calls take the list's place
    if not calls:
        del out["tool_calls"]
        return out
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or call.get("type", "function") != "function":
            raise PromptError("assistant tool_calls must be objects of type 'function'")
        parsed.append({**call, "function": {**function, "arguments": _arguments(
            function.get("arguments"))}})  # fmt: skip
    out["tool_calls"] = parsed
    return out


def vllm_tools(tools: Any) -> Any:
    """A chat request's `tools` as vLLM 0.32 hands them to the chat template: each one's
    pydantic dump (`ChatCompletionToolsParam`: `type`, `function`, `defer_loading` when set;
    `FunctionDefinition`: `name`, `description` and `parameters` (null when unset), `strict`
    and `defer_loading` when set; the client's other keys dropped). A template that prints the
    tools (`tools | tojson`, as tool-calling models' do) prints those nulls and that order, so
    the client's own dicts gave another prompt. Anything not a list of tool objects is left as
    it came (the engine refuses it)."""
    if not isinstance(tools, list) or not all(
        isinstance(t, Mapping) and isinstance(t.get("function"), Mapping) for t in tools
    ):
        return tools
    shaped = []
    for tool in tools:
        fn = tool["function"]
        defer = tool.get("defer_loading")
        function = {"name": fn.get("name"), "description": fn.get("description"),
                    "parameters": fn.get("parameters")}  # fmt: skip
        own = fn.get("defer_loading")
        for key, value in (("strict", fn.get("strict")),
                           ("defer_loading", defer if own is None else own)):  # fmt: skip
            if value is not None:
                function[key] = value
        outer = {"type": tool.get("type", "function"), "function": function}
        if defer is not None:
            outer["defer_loading"] = defer
        shaped.append(outer)
    return shaped


def _vllm_message(message: Mapping[str, Any], text: Any) -> dict[str, Any]:
    """The message as vLLM 0.32's chat parser hands it to the template
    (`_parse_chat_message_content`): its role and text (none: ""), an assistant's
    `tool_calls` and `reasoning` (also as `reasoning_content`), a tool result's
    `tool_call_id`, a string `name` and `task`, a developer message's `tools`; every other key
    dropped (a client's own `reasoning_content`, say)."""
    role = message["role"]
    out: dict[str, Any] = {"role": role, "content": "" if text is None else text}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            out["tool_calls"] = message["tool_calls"]
        if (reasoning := message.get("reasoning")) is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def vllm_kwargs(
    given: Mapping[str, Any], effort: Any, documents: Any, defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The template arguments vLLM 0.32 passes (`build_chat_params`, then `with_defaults`): the
    client's `chat_template_kwargs` under the request's `documents` and what it makes of the
    reasoning effort (`reasoning_effort`, and `enable_thinking`, false for "none", unless the
    client set it; a template that prints the effort at the head of the prompt, as reasoning
    models' do, otherwise gave the router another prompt); with the server's
    `--default-chat-template-kwargs`, those under every value the request set to other than
    None or "auto"."""
    extra: dict[str, Any] = {"documents": documents, "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in given:
        extra["enable_thinking"] = effort != "none"
    merged = {**given, **_set(extra)}
    return {**defaults, **_set(merged)} if defaults else merged


def _set(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`kwargs` without the values vLLM's `merge_kwargs` counts as unset (None, "auto")."""
    return {k: v for k, v in kwargs.items() if v is not None and v != "auto"}


def _unnamed_developer(conversation: list[Any], template: str) -> bool:
    """Whether vLLM 0.32 turns the conversation's `developer` messages into `system` ones: it
    holds one and the template never names the role (`_detect_developer_role_support`)."""
    named = '"developer"' in template or "'developer'" in template
    return not named and any(m.get("role") == "developer" for m in conversation)


def _developer_as_system(conversation: list[Any]) -> list[Any]:
    """vLLM 0.32's `_convert_developer_to_system` then `_consolidate_system_messages`: each
    `developer` message a `system` one (its `tools` dropped); when a system message is not the
    first or follows another, every one is merged into a single first system message (their
    non-empty texts joined by a blank line, a list's text parts by newlines)."""
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m.get("role") == "developer" else m
        for m in conversation
    ]  # fmt: skip
    texts: list[str] = []
    others, merge = [], False
    for i, m in enumerate(converted):
        if m.get("role") != "system":
            others.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        content = m["content"]
        if isinstance(content, list):  # the "openai" format's text parts (`_text_parts`)
            content = "\n".join(p["text"] for p in content)
        if content:
            texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


def has_media(body: Mapping[str, Any]) -> bool:
    """Whether a /v1/chat/completions body has content parts other than text. The engine puts
    their placeholder tokens in the prompt and their content hashes in its block hashes, which
    the router cannot reproduce: such a request is placed by load, not by cached prefix, and
    its body is sent on as it came. Only type "text" counts as text here: vLLM 0.32 also reads
    `input_text`, `output_text`, `refusal` and `thinking` parts as text, but how each engine
    renders those is not the router's to guess, so they are placed by load as well."""
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, Mapping)
        and isinstance(content := m.get("content"), list)
        and any(isinstance(p, Mapping) and p.get("type") != "text" for p in content)
        for m in messages
    )


def _checked(message: Any) -> Mapping[str, Any]:
    """A message that has a string role (else the request is refused)."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise PromptError("each message needs a string 'role'")
    return message


def vllm_conversation(messages: list[Any], template: str, parts: bool) -> list[Any]:
    """The messages vLLM 0.32 hands the template `template` (`parts`: its content format is
    "openai")."""
    conversation = []
    for m in map(_checked, messages):
        content = m.get("content")
        if parts and m["role"] != "tool":
            text: Any = _text_parts(content)
        else:  # vLLM 0.32 joins a tool result's text parts whatever the format
            text = _message_content(content)
        message = _vllm_message(m, text)
        if m["role"] == "assistant" and isinstance(message.get("tool_calls"), list):
            message = _with_parsed_arguments(message)
        conversation.append(message)
    if _unnamed_developer(conversation, template):
        conversation = _developer_as_system(conversation)
    return conversation


_SGLANG_FIELDS = ("content", "tool_call_id", "name", "phase", "reasoning_content", "tool_calls",
                  "tools", "prefix")  # fmt: skip
"""`ChatCompletionMessageGenericParam`'s fields after its role, in their order (SGLang 0.5);
a user message (`ChatCompletionMessageUserParam`) has its content alone."""


def _sglang_call(call: Any, parse: bool) -> dict[str, Any]:
    """A tool call as SGLang 0.5's `ToolCall` dumps it (an assistant's `arguments` string
    parsed to an object, as `normalize_assistant_tool_call_arguments` does, strictly)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise PromptError("each tool call needs a 'function' object")
    arguments = function.get("arguments")
    if parse and isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise PromptError("tool call function.arguments must be valid JSON") from None
        if not isinstance(arguments, dict):
            raise PromptError("tool call function.arguments must be a JSON object")
    return {"id": call.get("id"), "index": call.get("index"), "type": "function",
            "function": {"name": function.get("name"), "arguments": arguments}}  # fmt: skip


_SGLANG_FUNCTION = ("description", "name", "parameters", "strict", "defer_loading")
"""`Function`'s fields in their order (SGLang 0.5)."""


def _sglang_tool(tool: Any) -> Any:
    """A tool as SGLang 0.5's `Tool` dumps it: `type`, `function`, `defer_loading` (null when
    unset). Its function keeps the fields the client gave in the client's order, then the rest
    in field order (`description` and `parameters` null when unset; `strict` and
    `defer_loading` only when set, the tool's own `defer_loading` copied in when the function
    has none); other keys dropped. Anything else is left as it came (the engine refuses it)."""
    if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
        return tool
    fn, defer = tool["function"], tool.get("defer_loading")
    fields = {key: fn.get(key) for key in _SGLANG_FUNCTION}
    if fields["defer_loading"] is None:
        fields["defer_loading"] = defer
    for key in ("strict", "defer_loading"):
        if fields[key] is None:
            del fields[key]
    order = [k for k in fn if k in fields] + [k for k in fields if k not in fn]
    return {"type": tool.get("type", "function"), "function": {k: fields[k] for k in order},
            "defer_loading": defer}  # fmt: skip


def _function_name(item: Mapping[str, Any]) -> Any:
    function = item.get("function")
    return function.get("name") if isinstance(function, Mapping) else None


def sglang_tools(body: Mapping[str, Any]) -> Any:
    """The tools SGLang 0.5 hands a chat's template (`_process_messages`): none when
    `tool_choice` is "none" (its default without tools); for a named `tool_choice`, the tools
    of that name (none when no tool has it); else every tool; each as `Tool` dumps it."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not isinstance(tools, list) or not tools or choice == "none":
        return None
    if isinstance(choice, Mapping):
        name = _function_name(choice)
        tools = [t for t in tools if isinstance(t, Mapping) and _function_name(t) == name]
        if not tools:
            return None
    return [_sglang_tool(t) for t in tools]


def _sglang_message(m: Mapping[str, Any], parts: bool) -> dict[str, Any]:
    """One message as SGLang 0.5 hands it to the template: its pydantic dump (known fields
    only), no content as "", text parts joined by spaces (its "string" format) or kept as
    parts, moved last (its "openai" format; a tool result's joined by spaces again), and
    every field that is null left out."""
    role = m["role"]
    out: dict[str, Any] = {"role": role}
    for key in _SGLANG_FIELDS if role != "user" else ("content",):
        value = m.get(key)
        if key == "tool_calls" and isinstance(value, list):
            value = [_sglang_call(c, parse=role == "assistant") for c in value]
        elif key == "tools" and isinstance(value, list):
            value = [_sglang_tool(t) for t in value]
        out[key] = value
    content = out["content"]
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        texts = _texts(content)
        if parts:  # the parts go last; a tool result's are joined all the same
            del out["content"]
        out["content"] = (
            [{"type": "text", "text": t} for t in texts] if parts and role != "tool"
            else " ".join(texts)
        )  # fmt: skip
    elif not isinstance(content, str):
        raise PromptError("message content must be a string or a list of content parts")
    return {k: v for k, v in out.items() if v is not None}


def sglang_conversation(messages: list[Any], parts: bool) -> list[dict[str, Any]]:
    """The messages SGLang 0.5 hands the template (`parts`: its content format is "openai")."""
    return [_sglang_message(_checked(m), parts) for m in messages]


def sglang_kwargs(
    given: Mapping[str, Any], effort: Any, defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The template arguments SGLang 0.5 passes: the client's `chat_template_kwargs` (where a
    request's `reasoning_effort` sets `thinking` and `enable_thinking` unless they are given:
    on for any effort but "none", as its request model does when it is built), the server's
    `--default-chat-template-kwargs` filling the keys it left out, over `reasoning_effort`
    (the request's, else those arguments' own)."""
    if effort is not None:
        on = effort != "none"
        given = {**given, "thinking": given.get("thinking", on),
                 "enable_thinking": given.get("enable_thinking", on)}  # fmt: skip
    kwargs = {**defaults, **given}
    if effort is None:
        effort = kwargs.get("reasoning_effort")
    return {**({} if effort is None else {"reasoning_effort": effort}), **kwargs}
