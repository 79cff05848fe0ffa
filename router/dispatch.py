"""Sending a placed request: straight to one worker, or handed off prefill → decode (vLLM's
two-step flow, or SGLang's bootstrap room sent to both at once; wire shapes in `router.handoff`).

Direct: the client's body goes to the chosen worker (aggregated, or a decode worker that
prefills locally); its answer (JSON or SSE) is relayed.

Hand-off (`Decision.prefill` set), vLLM's two-step flow over a KV connector such as
NixlConnector:

1. The prefill worker gets the body with `kv_transfer_params: {"do_remote_decode": true}`, one
   output token (`max_tokens` 1), not streamed. It computes the prompt (reusing its own cached
   prefix), keeps the KV for the decode worker and answers with the `kv_transfer_params` that
   locate it (engine id, block ids, host and side-channel port, and
   `remote_prefill_cached_tokens`: its own cache hit).
2. The decode worker gets the client's body with those `kv_transfer_params`: it pulls the blocks
   it does not hold itself (its cached prefix is not transferred), then decodes; its answer is
   relayed to the client, streamed if asked. Its `usage.prompt_tokens_details.cached_tokens` is
   the prefill worker's hit (`remote_prefill_cached_tokens`; set by the router when an engine
   leaves it out): the tokens no engine computed, which is what a client bills on.

Failures never leave a client waiting: a prefill leg that cannot connect, fails, times out
(`pd.prefill_timeout_s`), answers an error or no `kv_transfer_params`, or whose worker is lost
meanwhile (refusing connections, or failing its health probe for `pd.lost_after_s`), falls back
to a local prefill on the decode worker (the client's body unchanged). So does a decode leg
whose prefill worker is lost before the decode worker's first event (stream) or answer (JSON):
its KV may never arrive, and a decode engine pulling from a dead one can stall. A refused
connection (nothing was sent), or one that breaks before the client got a byte (the engine
died with the request queued), raises `Retry`: the proxy places the request again without that
worker. Every attempt's outcome feeds the worker's circuit breaker (`router.workers.Breaker`).
Any other upstream failure is an OpenAI-shaped error: 502 / 504, or, once a stream has
started, a final `data: {"error": ...}` event and `data: [DONE]`.

SGLang hand-off (a decode pool with `kv_handoff: sglang`): the same body with the prefill
worker's `bootstrap_host` / `bootstrap_port` and a new `bootstrap_room` goes to both workers at
once; decode's answer is relayed. An SGLang 0.5.23 server in disaggregation mode refuses a
request without `bootstrap_room` (400), so nothing falls back to a local prefill: a prefill leg
failing before decode's first event or answer ends the decode leg and raises `Retry` for the
prefill worker (placement then picks another one, or answers 503 when none is left); a
prefill's 4xx is the client's answer. Decode failures are handled as above.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import web

from router import messages, responses
from router.accounting import RequestAccount
from router.drain import SHUTTING_DOWN, InFlight, withdraw_cancel
from router.errors import ApiError
from router.handoff import sglang
from router.handoff.vllm import decode_params, prefill_body
from router.placement import Decision, LocalReason
from router.tokenize import Prompt
from router.upstream import (
    ConnectFailed,
    Disconnected,
    Response,
    Timeouts,
    Upstream,
    UpstreamError,
    upstream_failure,
)
from router.workers import Worker

_log = logging.getLogger("warply.router")
_T = TypeVar("_T")
WATCH_S = 0.25
"""How often a leg waiting on a prefill worker checks that worker's health."""
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions",
         "responses": responses.PATH, "messages": messages.PATH}  # fmt: skip
_UNSPLIT: dict[str, LocalReason] = {"responses": "responses", "messages": "messages"}
"""Kinds of request the router does not hand off to a vLLM prefill worker, with the reason."""
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class Prepared(Protocol):
    """What the dispatcher needs of a prepared request (`router.proxy`)."""

    body: dict[str, Any]
    raw: bytes | None
    prompt: Prompt
    rest: asyncio.Future[Prompt] | None
    stream: bool
    client_wants_usage: bool
    single: bool


@dataclass(slots=True)
class Call:
    """One client request being dispatched: what each of its attempts shares."""

    request: web.Request
    kind: str
    prep: Prepared
    account: RequestAccount
    headers: Mapping[str, str]
    flight: InFlight
    """Its place among the requests a stopping router drains."""


class Retry(Exception):
    """Place the request again without `worker`: it refused the connection before anything was
    sent, or (SGLang) it failed a prefill leg before the decode worker answered."""

    def __init__(self, worker: str) -> None:
        super().__init__(worker)
        self.worker = worker


@dataclass(slots=True)
class Answer:
    """The response to the client and the status the metrics record (a stream that failed after
    it started is sent as 200 but recorded as 502 / 504)."""

    response: web.StreamResponse
    status: int


def placed_headers(decision: Decision) -> dict[str, str]:
    """Response headers naming the chosen worker(s), the mode and the index's prediction."""
    mode = decision.mode
    headers = {
        "X-Warply-Worker": decision.worker.name,
        "X-Warply-Predicted-Cached": str(decision.reported_cached),
        "X-Warply-Mode": f"{mode}:{decision.local_reason}" if decision.local_reason else mode,
    }
    if decision.prefill is not None:
        headers["X-Warply-Prefill-Worker"] = decision.prefill.worker.name
    return headers


class _Answer(msgspec.Struct):
    """What the router reads of an engine's JSON answer (the rest is skipped, not decoded)."""

    usage: dict[str, Any] | None = None


class _Chunk(_Answer):
    """What the router reads of an SSE chunk: its usage, and whether it has choices."""

    choices: list[Any] | None = None


_read_answer = msgspec.json.Decoder(_Answer)
_read_chunk = msgspec.json.Decoder(_Chunk)


def _chunk(raw: bytes) -> _Chunk | None:
    """An SSE chunk's usage and choices; None when it is not such an object."""
    try:
        return _read_chunk.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _usage(raw: bytes, kind: str) -> dict[str, Any] | None:
    """A JSON answer's usage block, when it has one (a Messages answer's in the chat shape)."""
    try:
        usage = _read_answer.decode(raw).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return messages.openai_usage(usage) if kind == "messages" else usage


def _chat_event(event: bytes, account: RequestAccount, wants_usage: bool) -> tuple[bool, bool]:
    """(relay it, it is the last) for one SSE event of a completion or chat stream, its usage
    and generated tokens told to `account` (the stream's first event times its first token);
    the final usage chunk is hidden unless the client asked for it."""
    account.first_event()
    if b'"usage"' in event and event.startswith(b"data: {"):
        parsed = _chunk(event[6:])
        if parsed is not None and parsed.usage is not None:
            # Recorded now: a client that stops reading at `[DONE]` (the OpenAI SDK closes its
            # response there) cancels this handler before the engine's stream ends.
            account.usage(parsed.usage)
            return bool(parsed.choices) or wants_usage, False
    elif event.startswith(b"data: {"):
        account.generated(1)
    return True, event == b"data: [DONE]"


def _response_event(event: bytes, account: RequestAccount, _: bool) -> tuple[bool, bool]:
    """`_chat_event` for a Responses stream: every event is relayed; the last one
    (`response.completed`, `.incomplete` or `.failed`) holds the usage."""
    last, usage = responses.event_usage(event)
    if last:
        account.usage(usage)
    elif responses.is_output(event):
        account.first_event()
        if responses.is_delta(event):
            account.generated(1)
    return True, last


def _message_event(event: bytes, account: RequestAccount, _: bool) -> tuple[bool, bool]:
    """`_chat_event` for a Messages stream: every event is relayed; `message_delta` holds the
    usage, `message_stop` ends it."""
    account.first_event()
    last, usage = messages.event_usage(event)
    if usage is not None:
        account.usage(usage)
    elif messages.is_delta(event):
        account.generated(1)
    return True, last


_READERS = {"responses": _response_event, "messages": _message_event}


def _names_response(call: Call) -> bool:
    """A Responses request whose id the router chooses (the client set no `request_id`)."""
    return call.kind == "responses" and "request_id" not in call.prep.body


def _named(body: dict[str, Any], worker: Worker) -> dict[str, Any]:
    """`body` with a response id naming `worker` (`router.responses`)."""
    return {**body, "request_id": responses.new_response_id(worker.name)}


def _error_event(kind: str, status: int, message: str) -> bytes:
    """The event that ends a started stream with an error (`kind`'s shape)."""
    if kind == "responses":
        return responses.error_event(status, message)
    if kind == "messages":
        return messages.error_event(status, message)
    err = ApiError(status, message)
    body = {"error": {"message": message, "type": err.type, "param": None, "code": status}}
    return b"data: " + msgspec.json.encode(body) + b"\n\ndata: [DONE]\n\n"


class _PrefillLost(Exception):
    """The prefill worker went down before the leg it serves got its answer."""


async def _unless_lost(
    coro: Awaitable[_T], worker: Worker, grace_s: float, started: asyncio.Event | None
) -> _T:
    """Await `coro`; cancel it and raise `_PrefillLost` if `worker` is lost (`Worker.lost`:
    refusing connections, or unhealthy for `grace_s`) before `started` is set (None: before
    `coro` ends). The health probe and refused connections mark workers unhealthy."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_S)
            if done:
                return task.result()
            if worker.lost(grace_s) and (started is None or not started.is_set()):
                task.cancel()
                await asyncio.wait({task})
                if task.cancelled():
                    raise _PrefillLost
                return task.result()
    finally:
        if not task.done():  # the client went away: so does the upstream request
            task.cancel()


def _failure(exc: BaseException, worker: Worker) -> str:
    """Why a prefill leg failed, from what it raised: `connect` (refused: the worker is marked
    unhealthy, the health loop brings it back), `worker_down`, `timeout` or `error`; each
    counts against the worker's circuit breaker."""
    worker.answered(False)
    if isinstance(exc, ConnectFailed):
        worker.set_health(False, refused=True)
        return "connect"
    if isinstance(exc, _PrefillLost):
        return "worker_down"
    return "timeout" if isinstance(exc, TimeoutError) else "error"


def _prefill_outcome(
    leg: asyncio.Future[tuple[int, bytes, str]],
    worker: Worker,
    account: RequestAccount,
    sent_s: float,
) -> tuple[str, web.Response | None]:
    """An ended SGLang prefill leg: ("", None) when it answered (its usage recorded), else the
    failure's reason, with the engine's own answer when it refused the request (4xx)."""
    try:
        status, raw, content_type = leg.result()
    except (UpstreamError, _PrefillLost, TimeoutError) as exc:
        return _failure(exc, worker), None
    worker.answered(status < 500)
    if status == 200:
        account.prefill_answered(sglang.answer_usage(raw), sent_s)
        return "", None
    refusal = None
    if 400 <= status < 500:
        refusal = web.Response(body=raw, status=status, content_type=content_type)
    return f"status_{status}", refusal


class Dispatcher:
    """Sends placed requests upstream over one pool of keep-alive connections."""

    def __init__(
        self,
        upstream: Upstream,
        timeouts: Timeouts,
        prefill_timeout_s: float,
        lost_after_s: float,
    ) -> None:
        self._upstream = upstream
        self._timeouts = timeouts
        self._prefill_timeouts = Timeouts(prefill_timeout_s, timeouts.connect)
        self._lost_after_s = lost_after_s

    async def _post(
        self, url: str, body: dict[str, Any] | bytes, headers: Mapping[str, str], timeouts: Timeouts
    ) -> Response:
        """POST a JSON body (bytes are sent as they are): `Upstream.send`."""
        data = body if isinstance(body, bytes) else msgspec.json.encode(body)
        return await self._upstream.send(url, data, headers, timeouts)

    async def send(self, call: Call, decision: Decision) -> Answer:
        """Serve one placed request; raises `Retry` or `ApiError`."""
        params = None
        account = call.account
        if decision.prefill is not None and decision.worker.pool.kv_handoff == "vllm":
            if not call.prep.single:  # several prompts or choices: one hand-off cannot carry them
                account.relocate(_UNSPLIT.get(call.kind, "batch"))
            else:
                params = await self._prefill(call, decision)
        assert account.decision is not None
        return await self._answer(call, account.decision, params)

    @staticmethod
    async def _settle(call: Call) -> None:
        """Once the first request is on its way: the rest of an early-placed prompt."""
        prep = call.prep
        if prep.rest is not None:
            prep.prompt, prep.rest = await prep.rest, None
            call.account.measured(prep.prompt.estimate)

    async def _prefill(self, call: Call, decision: Decision) -> dict[str, Any] | None:
        """The prefill leg: the decode leg's `kv_transfer_params`, or None after a failure
        (the account then holds the decision with a local prefill)."""
        leg = decision.prefill
        assert leg is not None
        account = call.account
        started = account.elapsed()
        url = leg.worker.config.url + PATHS[call.kind]

        async def exchange() -> tuple[int, bytes]:
            body = prefill_body(call.prep.body)
            up = await self._post(url, body, call.headers, self._prefill_timeouts)
            try:
                await self._settle(call)
                return up.status, await up.read()
            finally:
                up.release()

        reason = ""
        try:
            status, raw = await _unless_lost(exchange(), leg.worker, self._lost_after_s, None)
            leg.worker.answered(status < 500)
            if status != 200:
                reason = f"status_{status}"
            else:
                parsed = msgspec.json.decode(raw)
                params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
                if isinstance(params, dict):
                    usage = parsed.get("usage")
                    account.prefill_answered(usage, started)
                    return decode_params(params, usage)
                reason = "no_kv_transfer_params"
        except (UpstreamError, _PrefillLost, TimeoutError, msgspec.DecodeError) as exc:
            reason = _failure(exc, leg.worker)
        await self._settle(call)
        _log.warning(
            "prefill on %s failed (%s); %s prefills locally",
            leg.worker.name, reason, decision.worker.name,
        )
        account.prefill_failed(reason)
        account.relocate("prefill_failed")
        return None

    async def _answer(
        self, call: Call, decision: Decision, params: dict[str, Any] | None
    ) -> Answer:
        """The request to the answering worker, relayed to the client. A vLLM hand-off's decode
        leg is abandoned if its prefill worker is lost before the first event (stream) or the
        answer (JSON): a decode engine pulling KV from a dead engine can stall (vLLM 0.32's
        NixlConnector on CPU waits as long as the request lives); it is then asked again, to
        prefill locally. An SGLang hand-off sends both legs at once (`_paired`). Each attempt's
        outcome feeds the worker's circuit breaker; an upstream that breaks before the client got
        anything (connection reset or closed, as when the engine is killed) raises `Retry`."""
        worker = decision.worker
        try:
            answer = await self._attempt(call, decision, params)
            worker.answered(answer.status < 500)
            return answer
        except ConnectFailed:
            worker.set_health(False, refused=True)  # the health loop brings it back
            worker.answered(False)
            raise Retry(worker.name) from None
        except Disconnected:
            # Broken before the client got a byte (after that, `_stream` ends the stream with an
            # error event): e.g. the engine died with the request queued. Another worker tries.
            _log.warning("upstream %s broke before answering; placing it again", worker.name)
            worker.answered(False)
            raise Retry(worker.name) from None
        except (TimeoutError, UpstreamError) as exc:
            worker.answered(False)
            raise ApiError(*upstream_failure(worker.name, exc)) from None

    async def _attempt(
        self, call: Call, decision: Decision, params: dict[str, Any] | None
    ) -> Answer:
        """`_answer`'s one try, raising what the upstream raised."""
        worker = decision.worker
        if decision.prefill is not None and worker.pool.kv_handoff == "sglang":
            return await self._paired(call, decision)
        prep = call.prep
        body: dict[str, Any] | bytes = prep.body if prep.raw is None else prep.raw
        if params is not None:
            body = {**prep.body, "kv_transfer_params": params}
        elif _names_response(call):
            body = _named(prep.body, worker)
        call.account.answer_sent()
        started = asyncio.Event()
        relay = self._relay(call, decision, body, started)
        if params is None or decision.prefill is None:
            return await relay
        prefill = decision.prefill.worker
        try:
            return await _unless_lost(relay, prefill, self._lost_after_s, started)
        except _PrefillLost:
            _log.warning(
                "prefill worker %s went down before %s answered; %s prefills locally",
                prefill.name, worker.name, worker.name,
            )
            call.account.prefill_failed("lost_before_decode")
            call.account.relocate("prefill_failed")
            assert call.account.decision is not None
            return await self._answer(call, call.account.decision, None)

    async def _paired(self, call: Call, decision: Decision) -> Answer:
        """SGLang's hand-off: the client's body with one bootstrap room to the prefill and the
        decode worker at once (`router.handoff.sglang`); decode's answer is relayed, prefill's
        read for its usage. A prefill leg that fails before decode's first event (stream) or
        answer (JSON) ends the decode leg, which waits for KV that will not come, and the
        request is placed again without that prefill worker (`Retry`): an SGLang decode server
        cannot prefill alone. A prefill's 4xx (the engine refused the request) is the answer."""
        leg = decision.prefill
        assert leg is not None
        prefill = leg.worker
        account = call.account
        given = call.prep.body
        body = sglang.leg_body(_named(given, decision.worker) if _names_response(call) else given,
                               prefill.config)  # fmt: skip
        sent_s = account.elapsed()

        async def exchange() -> tuple[int, bytes, str]:
            up = await self._post(
                prefill.config.url + PATHS[call.kind], body, call.headers, self._prefill_timeouts
            )
            try:
                return up.status, await up.read(), up.content_type
            finally:
                up.release()

        started = asyncio.Event()
        prefill_leg = asyncio.ensure_future(
            _unless_lost(exchange(), prefill, self._lost_after_s, started)
        )
        account.answer_sent()
        decode_leg = asyncio.ensure_future(self._relay(call, decision, body, started))
        try:
            pending: set[asyncio.Future[Any]] = {prefill_leg, decode_leg}
            while decode_leg in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if prefill_leg not in done:
                    continue
                reason, refusal = _prefill_outcome(prefill_leg, prefill, account, sent_s)
                if not reason or started.is_set():
                    continue  # decode has its KV (SGLang's own balancer ignores prefill)
                _log.warning(
                    "prefill on %s failed (%s) before %s answered",
                    prefill.name, reason, decision.worker.name,
                )
                account.prefill_failed(reason)
                if refusal is None:
                    raise Retry(prefill.name)
                refusal.headers.update(placed_headers(decision))
                return Answer(refusal, refusal.status)
            return decode_leg.result()
        finally:
            legs = [leg for leg in (prefill_leg, decode_leg) if not leg.done()]
            for unfinished in legs:  # closing its connection makes SGLang abort the request
                unfinished.cancel()
            if legs:
                await asyncio.wait(legs)

    async def _relay(
        self,
        call: Call,
        decision: Decision,
        body: dict[str, Any] | bytes,
        started: asyncio.Event,
    ) -> Answer:
        url = decision.worker.config.url + PATHS[call.kind]
        up = await self._post(url, body, call.headers, self._timeouts)
        try:
            await self._settle(call)
            if call.prep.stream and up.status == 200:
                return await self._stream(call, up, decision, started)
            resp, usage = await self._whole(up, call.kind)
        finally:
            up.release()
        started.set()
        resp.headers.update(placed_headers(decision))
        call.account.usage(usage)
        return Answer(resp, resp.status)

    @staticmethod
    async def _whole(up: Response, kind: str) -> tuple[web.Response, dict[str, Any] | None]:
        raw = await up.read()
        resp = web.Response(
            body=raw, status=up.status, content_type=up.content_type or "application/json"
        )
        return resp, _usage(raw, kind) if up.status == 200 else None

    @staticmethod
    async def _stream(
        call: Call, up: Response, decision: Decision, started: asyncio.Event
    ) -> Answer:
        """Relay SSE events (those of one upstream read in one write); read (and maybe hide)
        the final usage chunk; time the first one.
        The client's response starts with the first event (until then a failure is still an
        HTTP error, or a hand-off can still be retried locally); an upstream failure after
        that, or the end of a stopping router's drain, ends the stream with an error event."""
        account, request = call.account, call.request
        wants_usage = call.prep.client_wants_usage
        read = _READERS.get(call.kind, _chat_event)
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        resp.headers.update(placed_headers(decision))
        buf = b""
        status = 200
        try:
            try:
                async for chunk in up.chunks():
                    buf += chunk
                    if b"\n\n" not in buf:
                        continue
                    *events, buf = buf.split(b"\n\n")
                    if not started.is_set():
                        started.set()
                        call.flight.streaming()
                        await resp.prepare(request)
                    out, done = [], False
                    for event in events:
                        keep, last = read(event, account, wants_usage)
                        done = done or last
                        if keep:
                            out.append(event)
                    if out:  # the events of one upstream read in one write
                        await resp.write(b"\n\n".join(out) + b"\n\n")
                        if done:
                            account.delivered()
                if not started.is_set():
                    started.set()
                    call.flight.streaming()
                    await resp.prepare(request)
                if buf.strip():
                    await resp.write(buf)
            except (UpstreamError, TimeoutError) as exc:
                if not resp.prepared:
                    raise  # nothing sent yet: an HTTP error (or a retry)
                status, message = upstream_failure(decision.worker.name, exc)
                await resp.write(_error_event(call.kind, status, message))
            except asyncio.CancelledError:
                if not (resp.prepared and call.flight.cut):
                    raise
                withdraw_cancel()
                status = 503
                await resp.write(_error_event(call.kind, status, SHUTTING_DOWN))
            await resp.write_eof()
        except ConnectionResetError:  # aiohttp: a write to a client that closed mid-stream
            status = 499  # leaving `up` unread closes its connection: the engine aborts
        return Answer(resp, status)
