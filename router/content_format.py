"""Which shape of message content a chat template reads, as each engine decides it: "openai"
when the template loops over a message's content (as Llama 4's, Gemma 3's and vision models'
do), so the engine hands it content parts; else "string", every content as one text
(`router.chat_shape` shapes the messages either way).

vLLM 0.32 (`--chat-template-content-format auto`, `content_format`):

A template's Jinja syntax tree is searched for a `for` loop over `m.content` / `m['content']`
(under filters, tests and slices) where `m` is a loop variable over `messages` or over a
variable set from it, over a macro parameter that a call passes such a content, or, outside
macros, over a variable named `content`. A template that does not parse, or whose loops or
assignments bind several names at once where the search follows them, counts as "string", as
vLLM counts it.

SGLang 0.5 (`sglang_content_format`): "openai" when the template's text names an image, audio,
video or vision anywhere, or loops over the content of a variable named `message`, `msg` or
`m`.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Literal

import jinja2
from jinja2 import nodes

ContentFormat = Literal["string", "openai"]
ContentFormatOption = Literal["auto", "string", "openai"]
"""vLLM's `--chat-template-content-format`: a format, or "auto" to detect it."""


class _Unsure(Exception):
    """The search met a construct vLLM's does not follow (vLLM then answers "string")."""


def _read(node: nodes.Node) -> nodes.Node:
    """The expression a loop or an assignment reads, filters, tests and slices taken off."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _is_name(node: nodes.Node, names: set[str]) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _reads(node: nodes.Node, names: set[str]) -> bool:
    """Whether `node` reads one of `names` (under filters, tests and slices)."""
    return _is_name(_read(node), names)


def _reads_content(node: nodes.Node, names: set[str]) -> bool:
    """Whether `node` reads `name.content` or `name['content']` for one of `names`."""
    node = _read(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content" and _is_name(node.node, names)
    if isinstance(node, nodes.Getitem):
        key = node.arg
        named = isinstance(key, nodes.Const) and key.value == "content"
        return named and _is_name(node.node, names)
    return False


def _target(node: nodes.Node) -> str:
    if not isinstance(node, nodes.Name):
        raise _Unsure
    return node.name


def _message_names(tree: nodes.Template) -> set[str]:
    """The loop variables that hold a message: those of loops over `messages` or over a
    variable set (maybe through others) from it."""
    lists, grown = {"messages"}, True
    while grown:
        grown = False
        for assign in tree.find_all(nodes.Assign):
            if _reads(assign.node, lists):
                name = _target(assign.target)
                grown = grown or name not in lists
                lists.add(name)
    return {_target(loop.target) for loop in tree.find_all(nodes.For) if _reads(loop.iter, lists)}


def _content_loops(tree: nodes.Template, messages: set[str]) -> Iterator[nodes.For]:
    """The loops over a message's content."""
    in_macros: set[int] = set()
    params_of: dict[int, set[str]] = {}
    for macro in tree.find_all(nodes.Macro):
        names = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            bound |= {names[i] for i, arg in enumerate(call.args[: len(names)])
                      if _reads_content(arg, messages)}  # fmt: skip
            bound |= {kw.key for kw in call.kwargs
                      if kw.key in names and _reads_content(kw.value, messages)}  # fmt: skip
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if bound:
                params_of[id(loop)] = bound
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        if _reads_content(it, messages):
            yield loop
        elif isinstance(it, nodes.Name) and (
            it.name in params_of.get(id(loop), ())
            or id(loop) not in in_macros and it.name == "content"
        ):
            yield loop


@lru_cache(maxsize=32)
def content_format(source: str, environment: jinja2.Environment) -> ContentFormat:
    """The content format vLLM 0.32 detects for the chat template `source` (cached: a request
    may bring its own template)."""
    try:
        tree = environment.parse(source)
        for loop in _content_loops(tree, _message_names(tree)):
            _target(loop.target)
            return "openai"
    except (jinja2.TemplateError, _Unsure):
        return "string"
    return "string"


_MEDIA_WORDS = ("image", "audio", "video", "vision")


@lru_cache(maxsize=32)
def sglang_content_format(source: str, environment: jinja2.Environment) -> ContentFormat:
    """The content format SGLang 0.5 detects for the chat template `source`
    (`detect_jinja_template_content_format`)."""
    if any(word in source for word in _MEDIA_WORDS):
        return "openai"
    try:
        tree = environment.parse(source)
    except jinja2.TemplateError:
        return "string"
    names = {"message", "msg", "m"}
    loops = tree.find_all(nodes.For)
    return "openai" if any(_reads_content(loop.iter, names) for loop in loops) else "string"
