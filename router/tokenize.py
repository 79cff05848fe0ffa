"""Request tokenization at the router, the way the engine does it (same files, same template).

Uses the `tokenizers` library on the model folder's `tokenizer.json` and renders the chat
template with a Jinja2 sandbox configured like `transformers.apply_chat_template`
(trim_blocks, lstrip_blocks, loopcontrols, `tojson`, `raise_exception`, `strftime_now`, the
special tokens as variables), after the chat's messages are shaped as the workers' engine
shapes them (`router.chat_shape`). `transformers` is not needed: it costs ~2.5 s to import
against ~0.15 s here, and parity with vLLM's own /tokenize is checked by
tests/vllm/test_router_integration.py and tests/vllm/test_chat_parity.py.

Defaults follow vLLM 0.32: chat requests are encoded without special tokens (the template adds
BOS), completion prompts with them (`add_special_tokens` in the request overrides either).
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, overload

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from router.chat_shape import (
    PromptError,
    sglang_conversation,
    sglang_kwargs,
    sglang_tools,
    vllm_conversation,
    vllm_kwargs,
    vllm_tools,
)
from router.chat_template import (
    ChatTemplates,
    Picked,
    TemplateLoadError,
    bare_environment,
    engine_template,
    folder_templates,
    sglang_template,
)
from router.content_format import ContentFormatOption, content_format, sglang_content_format
from router.messages import merges_inline_system
from router.messages_sglang import renders_inline_system
from router.token_cache import ChunkCache, Lineage, Partial

_log = logging.getLogger("warply.router")
_SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenizerError(ValueError):
    """The model folder's tokenizer files cannot be used; the message names the file."""


class Deferred(Exception):
    """Tokenizing would encode more text than the caller's budget: run it off the event loop."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt's token ids: all of them, or (while `complete` is false) a leading part, with
    the expected and the largest possible whole length. `RouterTokenizer.finish` completes it
    (a leading part from the chunk cache is the same array, grown to the whole)."""

    tokens: Sequence[int]
    """A list, or an `array("I")` from the chunk cache (no conversion on the request path)."""
    estimate: int
    """Whole-prompt tokens: exact when complete, else expected."""
    bound: int
    """Whole-prompt tokens at most."""
    lineage: Lineage | None = None
    """How its tokens relate to a prompt tokenized before (`router.token_cache`)."""
    _partial: Partial | None = None
    _tail: tuple[int, ...] = ()

    @property
    def complete(self) -> bool:
        return self._partial is None

    @property
    def pending(self) -> int:
        """Characters `RouterTokenizer.finish` has left to encode (0 when complete)."""
        return 0 if self._partial is None else self._partial.pending

    @classmethod
    def whole(cls, tokens: Sequence[int], lineage: Lineage | None = None) -> Prompt:
        return cls(tokens, len(tokens), len(tokens), lineage)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = bare_environment()
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of the model folder ({} when there is none)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise TokenizerError(f"{path} is not a readable JSON file: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} holds no JSON object")
    return data


def _model_vocab(folder: Path) -> int:
    """`vocab_size` of the model folder's config.json (0 when absent or unusable: the
    tokenizer's vocabulary then counts alone)."""
    try:
        size = _read_json(Path(folder) / "config.json").get("vocab_size")
    except TokenizerError:
        return 0
    return size if isinstance(size, int) else 0


def _source(pick: Callable[[], Picked]) -> str | None:
    """The text of the template `pick` chooses; None when there is none."""
    try:
        return pick().source
    except PromptError:
        return None


class RouterTokenizer:
    """The engine's tokenizer and chat template, loaded from a model folder."""

    def __init__(
        self,
        folder: Path,
        cache_bytes: int = 32 << 20,
        *,
        chat_template: str | None = None,
        content_format: ContentFormatOption = "auto",
        default_kwargs: Mapping[str, Any] | None = None,
        exclude_tools_when_none: bool = False,
        hf_template_name: str | None = None,
    ) -> None:
        """The keywords are the engines' `--chat-template`, `--chat-template-content-format`,
        `--default-chat-template-kwargs`, `--exclude-tools-when-tool-choice-none` and SGLang's
        `--hf-chat-template-name` (`RouterConfig`)."""
        self.folder = Path(folder)
        try:
            self._tok = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception for unreadable files
            raise TokenizerError(f"no usable tokenizer.json in {self.folder}: {exc}") from None
        config = _read_json(self.folder / "tokenizer_config.json")
        self._special = {
            name: text for name in _SPECIAL_NAMES if (text := _token_text(config.get(name)))
        }
        self._env = _environment()
        try:
            if chat_template is None:
                sources, by_name = folder_templates(self.folder, config)
                self._templates = ChatTemplates(self._env, sources, by_name, f"in {self.folder}")
                self._sglang_templates: ChatTemplates | TemplateLoadError = self._templates
            else:
                text = engine_template(chat_template)
                self._templates = self._given(text)
                self._sglang_templates = self._sglang_reading(chat_template, text)
            self._templates.check_name(hf_template_name)
        except TemplateLoadError as exc:
            raise TokenizerError(str(exc)) from None
        self._vllm_templates = self._templates
        self._format = content_format
        self._defaults = dict(default_kwargs or {})
        self._exclude_tools = exclude_tools_when_none
        self._hf_name = hf_template_name
        self._merges_inline: bool | None = None
        self._engine: str | None = None
        self.cache = ChunkCache(self._tok, cache_bytes)
        tokenizer_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.vocab_size = max(tokenizer_vocab, _model_vocab(self.folder))
        """Token ids a prompt may hold: 0 to vocab_size - 1 (the tokenizer's or the model's
        vocabulary, whichever is larger, as vLLM 0.32's `validate_token_ids` allows)."""
        self._wrap = self._special_wrap()

    @property
    def engine(self) -> str | None:
        """Whose chat rendering to follow where the engines differ: its workers' `/v1/models`
        `owned_by` ("vllm", "sglang"; None: vLLM 0.32's), set at start-up."""
        return self._engine

    @engine.setter
    def engine(self, engine: str | None) -> None:
        self._engine = engine
        sglang = self._sglang_templates
        self._templates = self._vllm_templates
        if engine != "sglang":
            return
        if isinstance(sglang, TemplateLoadError):
            _log.error(
                "chat_template: %s; this SGLang fleet's chats are keyed from the template as "
                "vLLM reads it (where its engines render another prompt, the parity probe "
                "routes their workers by load)", sglang
            )  # fmt: skip
        else:
            self._templates = sglang

    def _given(self, text: str) -> ChatTemplates:
        """The one template of a `chat_template` setting, compiled."""
        return ChatTemplates(self._env, {"default": text}, False, "given")

    def _sglang_reading(self, setting: str, text: str) -> ChatTemplates | TemplateLoadError:
        """The given template as an SGLang fleet renders it (`sglang_template` of `text`, the
        setting as vLLM reads it: the same templates where both texts are equal), or why the
        router cannot render that one."""
        try:
            sglang = sglang_template(setting, text)
            return self._templates if sglang == text else self._given(sglang)
        except TemplateLoadError as exc:
            return exc

    def _special_wrap(self) -> tuple[list[int], list[int]] | None:
        """The ids the post-processor puts before and after a single text (e.g. BOS), if it only
        wraps it; None when it does more (then such encodes skip the chunk cache)."""
        probe, other = "Warply probe text.\n", "x"
        bare = self._tok.encode(probe, add_special_tokens=False).ids
        full = self._tok.encode(probe, add_special_tokens=True).ids
        for h in range(len(full) - len(bare) + 1):
            if full[h : h + len(bare)] == bare:
                head, tail = full[:h], full[h + len(bare) :]
                check = self._tok.encode(other, add_special_tokens=False).ids
                if self._tok.encode(other, add_special_tokens=True).ids == head + check + tail:
                    return head, tail
        return None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text` (with the tokenizer's post-processor when add_special_tokens),
        reusing cached chunks of earlier prompts (`router.token_cache`)."""
        return list(self.finish(self.start(text, add_special_tokens)).tokens)

    def whole(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text` encoded in one piece, past the chunk cache (probes)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def start(self, text: str, add_special_tokens: bool, budget: int | None = None) -> Prompt:
        """Token ids of `text` up to its second never-seen chunk (`ChunkCache.begin`).
        `Deferred` when that would encode more than `budget` characters."""
        head: list[int] = []
        tail: list[int] = []
        if add_special_tokens:
            if self._wrap is None:
                if budget is not None and len(text) > budget:
                    raise Deferred
                return Prompt.whole(list(self._tok.encode(text, add_special_tokens=True).ids))
            head, tail = self._wrap
        part = self.cache.begin(text, budget)
        if part is None:
            raise Deferred
        lineage = part.lineage
        if lineage is not None:  # prompts with and without a head are told apart
            h = 1 if head else 0
            base = 2 * lineage.base + h if lineage.base else 0
            lineage = Lineage(2 * lineage.ident + h, base, len(head) + lineage.shared)
        tokens = array("I", head) + part.ids if head else part.ids
        if not part.rest:
            return Prompt.whole(tokens + array("I", tail) if tail else tokens, lineage)
        extra = len(tail) + len(tokens)
        return Prompt(
            tokens, extra + part.estimate, extra + part.bound, lineage, part, tuple(tail)
        )

    def finish(self, prompt: Prompt) -> Prompt:
        """The whole prompt of a `start` (itself when already complete)."""
        partial = prompt._partial
        if partial is None:
            return prompt
        head = len(prompt.tokens) - len(partial.ids)  # before `partial.ids` grows in place
        tokens = self.cache.finish(partial)
        if head:  # a long text's ids are not copied
            tokens = array("I", prompt.tokens[:head]) + tokens
        if prompt._tail:
            tokens = tokens + array("I", prompt._tail)
        return Prompt.whole(tokens, prompt.lineage)

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """The prompt text the chat template makes of a /v1/chat/completions body."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise PromptError("'chat_template_kwargs' must be an object")
        continue_final = bool(body.get("continue_final_message", False))
        effort = body.get("reasoning_effort")
        context: dict[str, Any] = {"documents": None, **self._special}
        if self.engine == "sglang":  # SGLang 0.5 has no `documents` field: its kwargs' only
            tools = sglang_tools(body)
            context.update(sglang_kwargs(kwargs, effort, self._defaults))
            picked = self._templates.only(self._hf_name, context.pop("chat_template", None))
            parts = sglang_content_format(picked.source, self._env) == "openai"
            conversation = sglang_conversation(messages, parts)
        else:
            excluded = self._exclude_tools and body.get("tool_choice") == "none"
            tools = None if excluded else vllm_tools(body.get("tools"))
            picked = self._templates.pick(body.get("chat_template"), tools is not None)
            source = picked.source
            fmt = content_format(source, self._env) if self._format == "auto" else self._format
            conversation = vllm_conversation(messages, source, fmt == "openai")
            context.update(vllm_kwargs(kwargs, effort, body.get("documents"), self._defaults))
        context["add_generation_prompt"] = bool(
            body.get("add_generation_prompt", not continue_final)
        )
        context["continue_final_message"] = continue_final
        try:
            rendered = picked.template.render(messages=conversation, tools=tools, **context)
        except Exception as exc:  # template code is the request's data: any error is a 400
            raise PromptError(f"chat template error: {type(exc).__name__}: {exc}") from None
        if continue_final:  # transformers strips the end-of-turn after the final message
            final = conversation[-1].get("content")
            if isinstance(final, list):  # its last text part, as transformers takes it
                final = next((p["text"] for p in reversed(final) if "text" in p), None)
            if isinstance(final, str) and final.strip() and final.strip() in rendered:
                rendered = rendered[: rendered.rindex(final.strip()) + len(final.strip())]
        return rendered

    def merges_inline_system(self) -> bool:
        """Whether the engine merges inline system messages into the leading one for this model,
        probed once: vLLM 0.32's /v1/messages when a template a chat without or with tools gets
        rejects them (`router.messages.merges_inline_system`); SGLang 0.5's /v1/messages and
        /v1/responses when its template does not render them
        (`router.messages_sglang.renders_inline_system`)."""
        if self._merges_inline is None:
            templates = self._templates
            if self.engine == "sglang":
                source = _source(lambda: templates.only(self._hf_name))
                self._merges_inline = not renders_inline_system(source)
            else:
                sources = [_source(lambda: templates.pick(None, False)),
                           _source(lambda: templates.pick(None, True))]  # fmt: skip
                self._merges_inline = merges_inline_system(sources)
        return self._merges_inline

    def chat_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """Prompt tokens of a /v1/chat/completions body."""
        return list(self.finish(self.start_chat(body)).tokens)

    def start_chat(self, body: Mapping[str, Any]) -> Prompt:
        """`start` on the prompt of a /v1/chat/completions body."""
        return self.start(self.render_chat(body), bool(body.get("add_special_tokens", False)))

    def completion_tokens(self, body: Mapping[str, Any]) -> list[list[int]]:
        """Prompt tokens of each prompt in a /v1/completions body (OpenAI allows a batch)."""
        prompt = body.get("prompt")
        special = bool(body.get("add_special_tokens", True))
        if isinstance(prompt, str):
            return [self.encode(prompt, special)]
        if isinstance(prompt, list) and prompt:
            if all(type(t) is int for t in prompt):
                return [self._token_ids(prompt)]
            out = []
            for p in prompt:
                if isinstance(p, str):
                    out.append(self.encode(p, special))
                elif isinstance(p, list) and p and all(type(t) is int for t in p):
                    out.append(self._token_ids(p))
                else:
                    raise PromptError(
                        "'prompt' items must be strings or non-empty lists of token ids"
                    )
            return out
        raise PromptError("'prompt' must be a string, a list of token ids, or a list of those")

    def _token_ids(self, ids: list[int]) -> list[int]:
        """`ids` when every one is in the vocabulary; else `PromptError` with vLLM 0.32's
        message (`Token id N is out of vocabulary`)."""
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise PromptError(
                f"Token id {bad} is out of vocabulary (ids are 0 to {self.vocab_size - 1})"
            )
        return ids


@overload
def start_prompts(tokenizer: RouterTokenizer, kind: str, body: Mapping[str, Any]) -> list[Prompt]:
    ...


@overload
def start_prompts(
    tokenizer: RouterTokenizer, kind: str, body: Mapping[str, Any], budget: int
) -> list[Prompt] | Callable[[], list[Prompt]]:
    ...


def start_prompts(
    tokenizer: RouterTokenizer, kind: str, body: Mapping[str, Any], budget: int | None = None
) -> list[Prompt] | Callable[[], list[Prompt]]:
    """Prompts of a request by endpoint kind ("chat" or "completion"); a single text prompt may
    be left incomplete (`RouterTokenizer.start`), a batch is encoded whole. With a `budget`:
    when that would encode more than `budget` characters, the call that does it instead (the
    chat template already rendered), for the tokenizer thread."""
    if kind == "chat":
        text = tokenizer.render_chat(body)
        chat_special = bool(body.get("add_special_tokens", False))
        return _started(lambda b: [tokenizer.start(text, chat_special, b)], budget)
    prompt = body.get("prompt")
    special = bool(body.get("add_special_tokens", True))
    if isinstance(prompt, str):
        return _started(lambda b: [tokenizer.start(prompt, special, b)], budget)

    def batch() -> list[Prompt]:
        return [Prompt.whole(p) for p in tokenizer.completion_tokens(body)]

    texts = sum(len(p) for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else 0
    return batch if budget is not None and texts > budget else batch()


def _started(
    start: Callable[[int | None], list[Prompt]], budget: int | None
) -> list[Prompt] | Callable[[], list[Prompt]]:
    try:
        return start(budget)
    except Deferred:
        return lambda: start(None)
