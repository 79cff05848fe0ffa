"""The request path of the OpenAI API (completions, chat completions, responses) and of
Anthropic's Messages API: parse → tokenize → place → dispatch (`router.dispatch`: direct, or
prefill → decode; JSON or SSE) → measure.

Every field of the client's body goes to the engine unchanged except the router's own `warply`
field (stripped; `cache_key` becomes the engine's `cache_salt`, so tenants never share KV inside
the engine). Chat and completion streams always ask the engine for a final usage chunk (to read
`cached_tokens`) and drop it again when the client did not ask for it (Responses and Messages
streams carry their usage anyway). A client that disconnects cancels the handler,
which closes the upstream connection, and the engine aborts the request.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import msgspec
from aiohttp import web

from router.accounting import RequestAccount
from router.chat_shape import PromptError, has_media
from router.config import LimitsConfig
from router.dispatch import Call, Dispatcher, Retry
from router.drain import SHUTTING_DOWN, Drain, withdraw_cancel
from router.errors import ApiError, check_model, read_body
from router.messages import anthropic_shaped, disabled_effort
from router.messages import chat_view as messages_view
from router.metrics import RouterMetrics
from router.placement import Decision, Placement
from router.responses import chat_view, holder_unavailable, owner
from router.strategies import NoCandidate
from router.tokenize import Prompt, RouterTokenizer, start_prompts
from router.upstream import Timeouts, Upstream
from warply.protocol import request_namespace
from warply.protocol.api import CacheKey, Overrides

_T = TypeVar("_T")
_FORWARD_HEADERS = ("Authorization", "X-Request-Id")
_INLINE_CHARS = 8192
"""A prompt is tokenized on the event loop (while the tokenizer thread is idle) when this much
new text at most must be encoded before the choice: ~0.4 ms in `tokenizers`, about what handing
the work to the thread and back costs. The rest of the work (rendering the chat template, finding
a remembered history, joining cached chunks) holds the GIL wherever it runs, so the thread spares
the loop nothing there: a 128k-token conversation's next turn saves both hops (~0.5 ms)."""
_INLINE_BODY_BYTES = 1 << 20
"""Larger bodies go to the thread whatever they hold: there the loop gets the GIL back every
switch interval (5 ms) during a long template render."""


@dataclass(slots=True)
class _Prepared:
    body: dict[str, Any]
    raw: bytes | None
    """The client's bytes, while the router left the body as it came (sent as they are)."""
    prompt: Prompt
    """The (first) prompt: whole, or its leading part while the router places it early."""
    namespace: str
    prefix_reuse: bool
    stream: bool
    client_wants_usage: bool
    keyed: bool = True
    """Its tokens are the engine's (a prompt with images is placed by its length alone)."""
    single: bool = True
    """One prompt and one choice (`n` 1): a request a P/D hand-off can carry."""
    follows: str | None = None
    """A response's `previous_response_id`: the engine that stored that response answers."""
    rest: asyncio.Future[Prompt] | None = None
    """The whole prompt, being tokenized after an early placement."""


def upstream_headers(request: web.Request) -> dict[str, str]:
    """The headers an engine gets with a client's request: the client's `Authorization` (an
    engine's `--api-key`) and `X-Request-Id`, and the JSON content type."""
    headers = {h: request.headers[h] for h in _FORWARD_HEADERS if h in request.headers}
    headers["Content-Type"] = "application/json"
    return headers


def _overrides(body: dict[str, Any]) -> Overrides:
    raw = body.pop("warply", None)
    if raw is None:
        return Overrides()
    try:
        return msgspec.convert(raw, Overrides)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid 'warply' options: {exc}", "invalid_value", "warply") from None


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "stream": (bool,),
    "stream_options": (dict,),
    "n": (int,),
    "max_tokens": (int,),
    "max_completion_tokens": (int,),
    "add_special_tokens": (bool,),
    "chat_template_kwargs": (dict,),
    "chat_template": (str,),
    "max_output_tokens": (int,),
    "instructions": (str,),
    "previous_response_id": (str,),
    "request_id": (str,),
}
"""Types of the fields the router itself reads (null allowed: the field's default); the rest
of the body is the engine's to check."""


def _count(value: Any) -> int | None:
    """`value` as a count: an int, or a float without a fraction (JSON Schema's integer, and
    what the engines' pydantic models accept); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _check_fields(body: dict[str, Any]) -> None:
    """400 `invalid_value` naming the first field the router reads that has the wrong type."""
    for name, types in _FIELD_TYPES.items():
        value = body.get(name)
        if value is None:
            continue
        if int in types:
            n = _count(value)
            if n is None or n < 0:
                raise ApiError(400, f"'{name}' must be an integer >= 0", "invalid_value", name)
        elif not isinstance(value, types):
            want = "an object" if types == (dict,) else types[0].__name__
            raise ApiError(400, f"'{name}' must be {want}", "invalid_value", name)


def _refuse_request_template(body: dict[str, Any]) -> None:
    """400 for a chat body that brings its own chat template: rendering one is running the
    client's code (a sandboxed Jinja loop can still take the router's CPU and memory), so the
    router, like vLLM 0.32 without `--trust-request-chat-template`, takes none unless told."""
    kwargs = body.get("chat_template_kwargs")
    given = isinstance(kwargs, dict) and kwargs.get("chat_template") is not None
    if body.get("chat_template") is not None or given:
        raise ApiError(
            400,
            "Chat template is passed with request, but trust_request_chat_template is not set "
            "in the router's config. Refused request with untrusted chat template.",
            "untrusted_chat_template",
            "chat_template",
        )


def _prompt_too_long(tokens: int, limit: int, param: str) -> ApiError:
    return ApiError(
        400,
        f"the prompt has {tokens} tokens; this router takes at most {limit} "
        "(limits.max_prompt_tokens)",
        "prompt_too_long",
        param,
    )


def _max_tokens(body: dict[str, Any]) -> int:
    """The output tokens a request asks for (0 when it sets no limit)."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        if name in body:
            return _count(body[name]) or 0
    return 0


class Proxy:
    """Handles /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages."""

    def __init__(
        self,
        model: str,
        tokenizer: RouterTokenizer,
        placement: Placement,
        metrics: RouterMetrics,
        timeout_s: float,
        adapters: Collection[str] = (),
        prefill_timeout_s: float = 60.0,
        lost_after_s: float = 10.0,
        idle_timeout_s: float | None = None,
        limits: LimitsConfig | None = None,
        trust_request_chat_template: bool = False,
        disabled_thinking_effort: str = "auto",
    ) -> None:
        """`disabled_thinking_effort`: the engines' `--anthropic-disabled-thinking-effort`
        ("auto": probed as vLLM probes it, `router.messages.disabled_effort`)."""
        self.model = model
        self._trust_template = trust_request_chat_template
        auto = disabled_thinking_effort == "auto"
        self._effort_when_disabled: str | None = None if auto else disabled_thinking_effort
        self.served = frozenset((model, *adapters))
        """Names a request's `model` may take: the base model and its LoRA adapters."""
        self.max_model_len: int | None = None
        self._limits = limits or LimitsConfig()
        self._tokenizer = tokenizer
        self._placement = placement
        self._metrics = metrics
        self._timeout = aiohttp.ClientTimeout(
            total=timeout_s, sock_connect=5, sock_read=idle_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        self.upstream = Upstream()
        self.timeouts = Timeouts(timeout_s, 5, idle_timeout_s)
        """Of a request to an engine: the whole exchange, a new connection, the longest silence."""
        self.drain = Drain()
        self._dispatch = Dispatcher(self.upstream, self.timeouts, prefill_timeout_s, lost_after_s)
        # One thread: a cold 8k-token prompt (10-30 ms in `tokenizers`, which releases the GIL)
        # must not stall the event loop. The chunk cache is not thread-safe: the lock lets the
        # loop tokenize a prompt with little new text itself while the thread is idle.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="warply-tokenize")
        self._tokenize_lock = threading.Lock()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client of the router's other calls to the workers (health, /metrics, parity;
        created on first use, inside the event loop). Requests go through `router.upstream`."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # idle connections are dropped before the engines drop them (vLLM's uvicorn:
                # VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so few requests meet a closing one
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4),
                timeout=self._timeout,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.upstream.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        """One request of `kind` ("chat" | "completion" | "responses" | "messages")."""
        account = RequestAccount(self._metrics, time.perf_counter())
        status = 500
        flight = self.drain.enter()
        try:
            body, raw = await read_body(request)
            prep = await self.prepare(body, kind, raw)
            call = Call(request, kind, prep, account, upstream_headers(request), flight)
            tried: set[str] = set()
            while True:
                decision = await self.place(prep, tried)
                account.placed(decision, exact=prep.rest is None, keyed=prep.keyed)
                try:
                    answer = await self._dispatch.send(call, decision)
                except Retry as retry:
                    tried.add(retry.worker)
                    continue
                finally:
                    account.released()
                status = answer.status
                if over := account.overpredicted():
                    self._placement.index.overpredicted(*over)
                return answer.response
        except ApiError as err:
            status = err.status
            self._metrics.error(err.status, err.code)
            return err.response(anthropic_shaped(request.path))
        except asyncio.CancelledError:
            if not flight.cut:
                status = 499  # the client went away; leaving the upstream context closed it
                raise
            status = 503
            if flight.stream is not None:
                raise  # its stream started as it was cut: that stream's task ends it
            withdraw_cancel()
            cut = ApiError(status, SHUTTING_DOWN, "shutting_down")
            self._metrics.error(cut.status, cut.code)
            return cut.response(anthropic_shaped(request.path))
        finally:
            self.drain.leave(flight)
            account.closed(status)

    async def place(self, prep: _Prepared, tried: set[str]) -> Decision:
        """Choose the worker. An incomplete prompt is placed from its leading part when every
        worker's cached prefix ends inside it (its rest is then tokenized while the request is
        on its way); otherwise it is tokenized whole first."""
        if prep.follows is not None:
            tried = self._beside(prep.follows, tried)
        try:
            if prep.rest is not None:  # a retry after an early placement
                prep.prompt, prep.rest = await prep.rest, None
            prompt = prep.prompt
            if not prep.keyed:
                return await self._placement.choose(
                    (), prep.namespace, False, tried, None, prompt_tokens=prompt.estimate
                )
            if not prompt.complete:
                decision = await self._placement.choose_early(
                    prompt.tokens,
                    prompt.estimate,
                    prep.namespace,
                    prep.prefix_reuse,
                    tried,
                    prompt.lineage,
                )
                if decision is not None:
                    prep.rest = asyncio.ensure_future(self._whole(prompt, prep.namespace))
                    return decision
                prep.prompt = prompt = await self._finish(prompt)
            return await self._placement.choose(
                prompt.tokens, prep.namespace, prep.prefix_reuse, tried, prompt.lineage
            )
        except NoCandidate as exc:
            raise ApiError(503, str(exc), "no_healthy_worker") from None

    def _beside(self, response_id: str, tried: set[str]) -> set[str]:
        """`tried` and every worker but the one that stored `response_id` (a 503 naming it when
        it cannot answer); `tried` alone for an id the router did not make."""
        names = self._placement.workers
        stored = owner(response_id, names)
        if stored is None:
            return tried
        if stored in tried or not names[stored].available:
            raise holder_unavailable(stored, response_id, "previous_response_id")
        return tried | (set(names) - {stored})

    async def _whole(self, prompt: Prompt, namespace: str) -> Prompt:
        """The rest of an early-placed prompt, tokenized while the request is on its way; the
        placement's kept key chain is extended over it for the next turn."""
        whole = await self._finish(prompt)
        self._placement.whole(whole.tokens, namespace, whole.lineage)
        return whole

    async def _start(self, kind: str, body: dict[str, Any], inline: bool) -> list[Prompt]:
        """`start_prompts`: on the event loop when `inline` allows it, the thread is idle and it
        encodes at most `_INLINE_CHARS` characters; otherwise (or what is left of it) on the
        tokenizer thread."""
        started = None
        if inline:
            started = self._on_loop(start_prompts, self._tokenizer, kind, body, _INLINE_CHARS)
        if started is None:
            return await self._tokenize(start_prompts, self._tokenizer, kind, body)
        return started if isinstance(started, list) else await self._tokenize(started)

    async def _finish(self, prompt: Prompt) -> Prompt:
        """The whole prompt: on the event loop when little is left to encode and the thread
        is idle, else on the tokenizer thread."""
        whole = None
        if prompt.pending <= _INLINE_CHARS:
            whole = self._on_loop(self._tokenizer.finish, prompt)
        return whole if whole is not None else await self._tokenize(self._tokenizer.finish, prompt)

    def _on_loop(self, fn: Callable[..., _T], *args: Any) -> _T | None:
        """`fn(*args)` on the event loop, or None (nothing run) while the tokenizer thread is
        busy: short work then skips the two hops to the thread and back."""
        if not self._tokenize_lock.acquire(blocking=False):
            return None
        try:
            return fn(*args)
        finally:
            self._tokenize_lock.release()

    async def _tokenize(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the tokenizer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self._locked, fn, *args)

    def _locked(self, fn: Callable[..., _T], *args: Any) -> _T:
        with self._tokenize_lock:
            return fn(*args)

    async def prepare(
        self, body: dict[str, Any], kind: str, raw: bytes | None = None
    ) -> _Prepared:
        """Validate and rewrite the body (`raw`: the bytes it was parsed from, sent on as they
        are when nothing needs rewriting); tokenize its prompt the engine's way (a long single
        prompt only up to its second new chunk, unless its length must be checked)."""
        _check_fields(body)
        if kind != "completion" and not self._trust_template:
            _refuse_request_template(body)
        check_model(body.get("model"), self.served)
        self._check_counts(body)
        inline = raw is None or len(raw) <= _INLINE_BODY_BYTES
        untouched = "warply" not in body
        ov = _overrides(body)
        if ov.cache_key is not None:
            body["cache_salt"] = ov.cache_key
        elif body.get("cache_salt") is not None:  # the engine's field, sent as is: same rules
            try:
                msgspec.convert(body["cache_salt"], CacheKey)
            except msgspec.ValidationError as exc:
                msg = f"'cache_salt' must be a non-empty string without NUL: {exc}"
                raise ApiError(400, msg, "invalid_value", "cache_salt") from None
        namespace = request_namespace(body, self.model)
        if kind in ("responses", "messages"):
            given = raw if untouched else None
            follows = body.get("previous_response_id") if kind == "responses" else None
            if kind == "responses":
                view, given, length = self._response_view(body, given)
            else:
                view, length = self._message_view(body), "messages"
            return await self._viewed(
                body, view, namespace, ov.prefix_reuse, given, inline, length, follows
            )
        prompts, first = await self._prompts(kind, body, inline)
        longest = max(p.estimate for p in [first, *prompts[1:]])
        self._check_length(longest, body, "messages" if kind == "chat" else "prompt")
        n = body.get("n")
        single = len(prompts) == 1 and (n is None or _count(n) == 1)
        stream = bool(body.get("stream", False))
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        if stream and not wants_usage:
            base = options if isinstance(options, dict) else {}
            body["stream_options"] = {**base, "include_usage": True}
            untouched = False
        raw = raw if untouched else None
        keyed = not (kind == "chat" and has_media(body))
        return _Prepared(
            body, raw, first, namespace, ov.prefix_reuse and keyed, stream, wants_usage, keyed,
            single,
        )

    def _response_view(
        self, body: dict[str, Any], raw: bytes | None
    ) -> tuple[dict[str, Any] | None, bytes | None, str | None]:
        """A /v1/responses body's chat (`router.responses`), the bytes to send (none when the
        router names the response: `Dispatcher` sets `request_id` to name its worker unless
        the client chose one) and the field its length is checked as (none with `truncation`
        "auto": the engine cuts it)."""
        given = body.get("input")
        if not (isinstance(given, str) or isinstance(given, list) and all(
            isinstance(item, dict) for item in given
        )):
            msg = "'input' must be a string or a list of input items (objects)"
            raise ApiError(400, msg, "invalid_value", "input")
        raw = raw if "request_id" in body else None
        length = "input" if body.get("truncation") != "auto" else None
        tok = self._tokenizer
        return chat_view(body, tok.engine, tok.merges_inline_system), raw, length

    def _message_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """A /v1/messages body's chat (Anthropic's API; `router.messages`); the body is sent
        as it came (the engine always streams a Messages answer's usage)."""
        given, system = body.get("messages"), body.get("system")
        if not isinstance(given, list) or not given or not all(
            isinstance(m, dict) for m in given
        ):
            raise ApiError(400, "'messages' must be a non-empty list of messages (objects)",
                           "invalid_value", "messages")  # fmt: skip
        if not (system is None or isinstance(system, str) or isinstance(system, list) and all(
            isinstance(block, dict) for block in system
        )):
            msg = "'system' must be a string or a list of content blocks (objects)"
            raise ApiError(400, msg, "invalid_value", "system")
        tok = self._tokenizer
        if tok.engine == "sglang" and body.get("cache_salt") is not None:
            # SGLang 0.5's conversion (`AnthropicServing`) drops the field: tenants' requests
            # would share KV in the engine whatever their keys.
            raise ApiError(
                400,
                "this fleet's engines (SGLang) do not pass cache_salt on from /v1/messages, so a "
                "cache_key (or cache_salt) cannot keep this request's KV apart from other "
                "tenants': send it to /v1/chat/completions, or without one",
                "cache_key_unsupported",
                "cache_salt",
            )
        return messages_view(body, tok.engine, tok.merges_inline_system, self._disabled_effort)

    def _disabled_effort(self) -> str:
        """The effort a Messages request with thinking disabled renders with: the configured
        one, else `router.messages.disabled_effort` for this tokenizer, probed once."""
        if self._effort_when_disabled is None:
            self._effort_when_disabled = disabled_effort(self._tokenizer.render_chat)
        return self._effort_when_disabled

    async def _viewed(
        self,
        body: dict[str, Any],
        view: dict[str, Any] | None,
        namespace: str,
        reuse: bool,
        raw: bytes | None,
        inline: bool,
        length: str | None,
        follows: str | None,
    ) -> _Prepared:
        """A body of an API the engine renders through the chat template (Responses, Anthropic
        Messages): keyed by `view`, the chat it renders to (None: placed by load and its length
        in bytes / 4), its length checked as `length` names the prompt (None: not checked);
        not handed off to a vLLM prefill worker (its decode worker prefills it)."""
        stream = bool(body.get("stream", False))
        if view is None:
            size = len(raw) if raw is not None else len(msgspec.json.encode(body))
            prompt = Prompt((), size // 4, size // 4)
            return _Prepared(
                body, raw, prompt, namespace, prefix_reuse=False, stream=stream,
                client_wants_usage=True, keyed=False, single=False, follows=follows,
            )  # fmt: skip
        _, first = await self._prompts("chat", view, inline)
        if length is not None:
            self._check_length(first.estimate, body, length)
        return _Prepared(
            body, raw, first, namespace, prefix_reuse=reuse, stream=stream,
            client_wants_usage=True, single=False,
        )  # fmt: skip

    async def _prompts(
        self, kind: str, body: dict[str, Any], inline: bool
    ) -> tuple[list[Prompt], Prompt]:
        """The body's prompts, the first one completed when its length must be checked."""
        try:
            prompts = await self._start(kind, body, inline)
            first = prompts[0]
            limit = self._limits.max_prompt_tokens
            if not first.complete and (first.bound > limit or self._too_long(first.bound, body)):
                first = await self._finish(first)
        except PromptError as exc:
            raise ApiError(400, str(exc), "invalid_prompt") from None
        return prompts, first

    def _check_length(self, longest: int, body: dict[str, Any], param: str) -> None:
        """400 when the longest prompt passes `limits.max_prompt_tokens` or, with its output,
        the model's context."""
        if longest > self._limits.max_prompt_tokens:
            raise _prompt_too_long(longest, self._limits.max_prompt_tokens, param)
        if self._too_long(longest, body):
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {longest} input tokens and asks for {_max_tokens(body)} "
                "output tokens. Please reduce the length of the input.",
                "context_length_exceeded",
                param,
            )

    async def tokens(self, body: dict[str, Any], kind: str) -> tuple[list[int], str, bool]:
        """The request's (first) prompt, whole, as the engine tokenizes it, with its namespace
        and reuse switch: what placement sees of it (`/warply/where`)."""
        prep = await self.prepare(body, kind)
        prompt = prep.prompt
        if not prompt.complete:
            prompt = await self._finish(prompt)
        return list(prompt.tokens), prep.namespace, prep.prefix_reuse

    def _check_counts(self, body: dict[str, Any]) -> None:
        """400 before any tokenizing when the body holds more messages, prompts or token ids
        than `limits` allow."""
        limits = self._limits
        for param, noun in (("messages", "messages"), ("input", "input items")):
            items = body.get(param)  # a chat's messages, a response's input items
            if isinstance(items, list) and len(items) > limits.max_messages:
                raise ApiError(
                    400,
                    f"{len(items)} {noun}; this router takes at most {limits.max_messages} "
                    "(limits.max_messages)",
                    "too_many_messages",
                    param,
                )
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            return
        if isinstance(prompt[0], (str, list)) and len(prompt) > limits.max_prompts:
            raise ApiError(
                400,
                f"{len(prompt)} prompts in one request; this router takes at most "
                f"{limits.max_prompts} (limits.max_prompts)",
                "too_many_prompts",
                "prompt",
            )
        if isinstance(prompt[0], int):
            ids = len(prompt)
        else:
            ids = max(len(p) if isinstance(p, list) else 0 for p in prompt)
        if ids > limits.max_prompt_tokens:
            raise _prompt_too_long(ids, limits.max_prompt_tokens, "prompt")

    def _too_long(self, prompt_tokens: int, body: dict[str, Any]) -> bool:
        limit = self.max_model_len
        return limit is not None and (
            prompt_tokens >= limit or prompt_tokens + _max_tokens(body) > limit
        )
