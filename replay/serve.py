"""Simulated OpenAI-compatible workers (a simulator, not an engine): `python -m replay.serve`.

Each simulated worker is an aiohttp server on 127.0.0.1 in front of one `SimEngine` driven in
real time: a request is tokenized with the router's own tokenizer and chat template
(`router.tokenize`), keyed like the router keys it (`warply.protocol.keys`, namespace from
`cache_salt`), enqueued at the current simulated time, and its tokens are released at the
simulated times the engine computes them (`--time-scale` > 1 runs faster than real time). Its
cache events and a load snapshot every `--load-interval-s` go out on a `StatePublisher` stream,
so a router's index follows it as it follows a vLLM engine's `--kv-events-config` stream.

Served: /v1/completions and /v1/chat/completions (JSON, or SSE with `stream`; usage with
`prompt_tokens_details.cached_tokens`; one prompt and `n` 1 only), /v1/models (with
`max_model_len`), /tokenize, /health, /metrics. Output text is filler, exactly `max_tokens`
tokens (as with `ignore_eos`). Every answer carries `"simulator": {"worker", "ttft_ms"}`
(stream: on the usage chunk): the server's own time from reading the request to its first
token, so a client can subtract it from what it measured through a router.

Several workers share one process (one HTTP port and one event port pair each); `--manifest`
writes them, in the router's worker-config shape, once all listen.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from replay.costmodel import ReferenceModel, Scaled
from replay.engine import EngineConfig, SimEngine, SimRequest
from router.chat_shape import PromptError
from router.tokenize import RouterTokenizer, TokenizerError
from warply.common.argtypes import output_file
from warply.launch import HOST
from warply.protocol import LoadSnapshot, chain_keys, request_namespace, root_seed
from warply.protocol.publisher import StatePublisher

_log = logging.getLogger("replay.serve")
_FILLER = (" simulated", " tokens", " from", " a", " replay", " worker", ".")
_MIN_WAIT_S = 0.0005


class ServeConfig(BaseModel):
    """What `python -m replay.serve` runs (validated; flags of the same names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = Field(min_length=1)
    """Served model name (the router's `model`: it also seeds the key chains)."""
    tokenizer: Path
    """Model folder with tokenizer.json (and the chat template), as the router's."""
    workers: int = Field(1, ge=1, le=256)
    port: int = Field(0, ge=0, le=65535)
    """First HTTP port (worker i listens on port + i); 0: free ports."""
    name_prefix: str = Field("sim", min_length=1)
    engine: EngineConfig = EngineConfig()
    speed: float = Field(1.0, gt=0)
    """The reference cost model's pass times divided by this."""
    time_scale: float = Field(1.0, gt=0)
    """Simulated seconds per real second."""
    max_model_len: int = Field(8192, gt=1)
    default_max_tokens: int = Field(16, gt=0)
    load_interval_s: float = Field(0.5, gt=0)
    manifest: Path | None = None


class _Clock:
    """Simulated milliseconds from the event loop's clock, `scale` times faster."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._t0 = time.monotonic()

    def now_ms(self) -> float:
        return (time.monotonic() - self._t0) * 1000 * self.scale

    def delay_s(self, sim_ms: float) -> float:
        """Real seconds from now until simulated time `sim_ms`."""
        return (sim_ms - self.now_ms()) / 1000 / self.scale


class _Metrics:
    """The process's Prometheus series, labelled by worker."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "warply_sim_requests",
            "Simulated requests by worker and outcome",
            ["worker", "status"],
            registry=r,
        )
        self.prompt = Counter(
            "warply_sim_prompt_tokens", "Prompt tokens received", ["worker"], registry=r
        )
        self.cached = Counter(
            "warply_sim_cached_tokens",
            "Prompt tokens served from the simulated prefix cache",
            ["worker"],
            registry=r,
        )
        self.generated = Counter(
            "warply_sim_generated_tokens", "Tokens streamed", ["worker"], registry=r
        )
        self.running = Gauge("warply_sim_running", "Running requests", ["worker"], registry=r)
        self.waiting = Gauge("warply_sim_waiting", "Waiting requests", ["worker"], registry=r)
        self.kv_usage = Gauge(
            "warply_sim_kv_usage", "KV blocks in use / total", ["worker"], registry=r
        )


class _ApiError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code

    def response(self) -> web.Response:
        kind = "NotFoundError" if self.status == 404 else "BadRequestError"
        error = {"message": str(self), "type": kind, "param": None, "code": self.code}
        return web.json_response({"error": error}, status=self.status)


@dataclass(slots=True, eq=False)
class _Live:
    """A request being served: its prompt, its engine request and what was released."""

    tokens: list[int]
    req: SimRequest
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    released: int = 0
    """Tokens whose simulated time has come."""


class SimWorker:
    """One simulated worker: engine, driver task, HTTP app and event stream."""

    def __init__(
        self,
        name: str,
        cfg: ServeConfig,
        tokenizer: RouterTokenizer,
        clock: _Clock,
        metrics: _Metrics,
    ) -> None:
        self.name = name
        self.cfg = cfg
        self._tok = tokenizer
        self._clock = clock
        self._metrics = metrics
        self.engine = SimEngine(name, self._tokens, cfg.engine, Scaled(ReferenceModel(), cfg.speed))
        self._seed = root_seed(cfg.model)
        self._live: dict[int, _Live] = {}
        self._ids = itertools.count()
        self._kick = asyncio.Event()
        self._publisher: StatePublisher | None = None
        self._last_load = 0.0
        self.events_endpoint = self.replay_endpoint = ""
        self.url = ""
        self.driver: asyncio.Task[None] | None = None
        """Runs the engine in real time (`start`); its end is the simulator's failure."""
        self.app = web.Application(client_max_size=64 << 20)
        self.app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.get("/v1/models", self._models),
                web.post("/tokenize", self._tokenize),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics_page),
            ]
        )

    def _tokens(self, index: int, start: int, stop: int) -> list[int]:
        return self._live[index].tokens[start:stop]

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self, port: int) -> None:
        """Listen on 127.0.0.1:`port` (0: any), bind the event stream, start the driver."""
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        self.url = f"http://{HOST}:{bound}"
        self._publisher = StatePublisher(
            f"tcp://{HOST}:*", replay_endpoint=f"tcp://{HOST}:*", worker=self.name, bind=True
        )
        self.events_endpoint = self._publisher.endpoint
        self.replay_endpoint = self._publisher.replay_endpoint or ""
        self.driver = asyncio.create_task(self._drive(), name=f"drive-{self.name}")

    async def stop(self) -> None:
        if self.driver is None:
            return
        self.driver.cancel()
        await asyncio.gather(self.driver, return_exceptions=True)
        await self._runner.cleanup()
        if self._publisher is not None:
            self._publisher.close()

    def manifest(self) -> dict[str, str]:
        """This worker as a router `WorkerConfig` mapping."""
        return {
            "name": self.name,
            "url": self.url,
            "events": self.events_endpoint,
            "replay": self.replay_endpoint,
        }

    # ---- the engine in real time ---------------------------------------------------------
    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            wake = self._tick()
            delay = min(self._clock.delay_s(wake), self.cfg.load_interval_s)
            handle = loop.call_later(max(delay, _MIN_WAIT_S), self._kick.set)
            await self._kick.wait()
            self._kick.clear()
            handle.cancel()

    def _tick(self) -> float:
        """Run the passes due by now, release the tokens whose time has come, publish the
        cache changes (and a load snapshot when due); the simulated time to wake up at."""
        eng, now = self.engine, self._clock.now_ms()
        self._advance(now)
        eng.stats.finished.clear()
        wake = eng.now if eng.has_work() else float("inf")
        for live in self._live.values():
            if live.req.generated > live.released:
                wake = min(wake, live.req.finished)
        events, eng.events = eng.events, []
        if time.monotonic() - self._last_load >= self.cfg.load_interval_s:
            self._last_load = time.monotonic()
            events.append(self._load())
        if events and self._publisher is not None:
            self._publisher.publish(events)
        return wake

    def _advance(self, now: float) -> None:
        """Release the tokens due by `now`, then run the passes that start before it (a pass
        stamps its tokens with its end, which may lie ahead: they wait for a later call)."""
        for live in self._live.values():
            req = live.req
            if req.generated > live.released and req.finished <= now:
                live.released = req.generated
                live.ready.set()
        self.engine.advance(now)

    def _load(self) -> LoadSnapshot:
        eng, m, w = self.engine, self._metrics, self.name
        usage = eng.used_blocks / eng.cfg.num_blocks
        m.running.labels(w).set(len(eng.running))
        m.waiting.labels(w).set(len(eng.waiting))
        m.kv_usage.labels(w).set(usage)
        return LoadSnapshot(len(eng.running), len(eng.waiting), usage, eng.cfg.num_blocks)

    def _submit(self, tokens: list[int], output: int, namespace: str) -> _Live:
        seed = root_seed(self.cfg.model, namespace) if namespace else self._seed
        now = self._clock.now_ms()
        req = SimRequest(
            next(self._ids),
            now,
            len(tokens),
            output,
            chain_keys(tokens, self.cfg.engine.block_size, seed),
            namespace=namespace,
        )
        self._advance(now)
        live = self._live[req.index] = _Live(tokens, req)
        self.engine.enqueue(req, at=now)
        self._kick.set()
        return live

    def _drop(self, live: _Live) -> None:
        """Forget a request; abort it in the engine if it did not finish."""
        if live.req.generated < live.req.output:
            self.engine.abort(live.req)
        del self._live[live.req.index]
        self._kick.set()

    # ---- HTTP ----------------------------------------------------------------------------
    async def _health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def _metrics_page(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._metrics.registry), content_type="text/plain")

    async def _models(self, _: web.Request) -> web.Response:
        card = {
            "id": self.cfg.model,
            "object": "model",
            "created": 0,
            "owned_by": "warply-simulator",
            "root": self.cfg.model,
            "max_model_len": self.cfg.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            tokens = self._prompt("chat" if "messages" in body else "completion", body)
        except _ApiError as err:
            return err.response()
        return web.json_response(
            {"tokens": tokens, "count": len(tokens), "max_model_len": self.cfg.max_model_len}
        )

    def _prompt(self, kind: str, body: dict[str, Any]) -> list[int]:
        try:
            if kind == "chat":
                return self._tok.chat_tokens(body)
            prompts = self._tok.completion_tokens(body)
        except PromptError as exc:
            raise _ApiError(400, str(exc), "invalid_prompt") from None
        if len(prompts) != 1:
            raise _ApiError(400, "the simulator serves one prompt per request", "invalid_prompt")
        if any(t < 0 for t in prompts[0]):
            raise _ApiError(400, "token ids must be non-negative", "invalid_prompt")
        return prompts[0]

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        started = time.monotonic()
        try:
            body, tokens, output = self._validate(await _body(request), kind)
        except _ApiError as err:
            self._metrics.requests.labels(self.name, str(err.status)).inc()
            return err.response()
        live = self._submit(tokens, output, request_namespace(body, self.cfg.model))
        try:
            if body.get("stream"):
                return await self._stream(request, kind, body, live, started)
            return await self._whole(kind, live, started)
        finally:
            self._drop(live)

    def _validate(self, body: dict[str, Any], kind: str) -> tuple[dict[str, Any], list[int], int]:
        if body.get("model") not in (self.cfg.model, None, ""):  # vLLM 0.32: none is the base
            raise _ApiError(
                404, f"The model `{body.get('model')}` does not exist.", "model_not_found"
            )
        if body.get("n", 1) != 1:
            raise _ApiError(400, "the simulator serves n=1 only", "invalid_value")
        output = body.get("max_tokens", body.get("max_completion_tokens"))
        output = self.cfg.default_max_tokens if output is None else output
        if not isinstance(output, int) or isinstance(output, bool) or output < 1:
            raise _ApiError(400, "max_tokens must be a positive integer", "invalid_value")
        tokens = self._prompt(kind, body)
        if not tokens:  # vLLM 0.32's refusal; the simulated engine would stall on it
            raise _ApiError(400, "The decoder prompt cannot be empty", "invalid_prompt")
        if len(tokens) + output > self.cfg.max_model_len:
            raise _ApiError(
                400,
                f"This model's maximum context length is {self.cfg.max_model_len} tokens; the "
                f"request has {len(tokens)} prompt tokens and asks for {output} more.",
                "context_length_exceeded",
            )
        if not self.engine.fits(len(tokens), output):
            raise _ApiError(
                400,
                "the request needs more KV blocks than the simulated engine has",
                "context_length_exceeded",
            )
        return body, tokens, output

    async def _released(self, live: _Live, sent: int) -> int:
        """Wait until more tokens than `sent` are released; their count."""
        while live.released <= sent:
            await live.ready.wait()
            live.ready.clear()
        return live.released

    def _usage(self, live: _Live, ttft_s: float) -> dict[str, Any]:
        req = live.req
        self._metrics.requests.labels(self.name, "200").inc()
        self._metrics.prompt.labels(self.name).inc(req.prompt)
        self._metrics.cached.labels(self.name).inc(req.cached_tokens)
        self._metrics.generated.labels(self.name).inc(req.output)
        return {
            "usage": {
                "prompt_tokens": req.prompt,
                "completion_tokens": req.output,
                "total_tokens": req.prompt + req.output,
                "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
            },
            "simulator": {"worker": self.name, "ttft_ms": round(ttft_s * 1000, 3)},
        }

    async def _whole(self, kind: str, live: _Live, started: float) -> web.Response:
        await self._released(live, 0)
        ttft = time.monotonic() - started
        while live.released < live.req.output:
            await self._released(live, live.released)
        text = "".join(_text(i) for i in range(live.req.output))
        if kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": text},
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        head = _head(kind, live, chunk=False)
        return web.json_response({**head, "choices": [choice], **self._usage(live, ttft)})

    async def _stream(
        self, request: web.Request, kind: str, body: dict[str, Any], live: _Live, started: float
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        head = _head(kind, live, chunk=True)
        sent, ttft, out = 0, 0.0, live.req.output
        while sent < out:
            released = await self._released(live, sent)
            if not sent:
                ttft = time.monotonic() - started
            frames = []
            if kind == "chat" and not sent:
                frames.append(
                    _sse(
                        {
                            **head,
                            "choices": [_delta(kind, {"role": "assistant", "content": ""}, None)],
                        }
                    )
                )
            for i in range(sent, released):
                piece = {"content": _text(i)} if kind == "chat" else _text(i)
                frames.append(
                    _sse(
                        {
                            **head,
                            "choices": [_delta(kind, piece, "length" if i == out - 1 else None)],
                        }
                    )
                )
            await resp.write(b"".join(frames))
            sent = released
        usage = self._usage(live, ttft)
        options = body.get("stream_options")
        tail = b""
        if isinstance(options, dict) and options.get("include_usage"):
            tail = _sse({**head, "choices": [], **usage})
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _text(i: int) -> str:
    return _FILLER[i % len(_FILLER)]


def _head(kind: str, live: _Live, chunk: bool) -> dict[str, Any]:
    prefix, obj = ("chatcmpl", "chat.completion") if kind == "chat" else ("cmpl", "text_completion")
    return {
        "id": f"{prefix}-sim-{live.req.index}",
        "object": obj + ".chunk" if chunk and kind == "chat" else obj,
        "created": int(time.time()),
        "model": "simulated",
    }


def _delta(kind: str, piece: Any, finish: str | None) -> dict[str, Any]:
    if kind == "chat":
        return {"index": 0, "delta": piece, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except ValueError:
        raise _ApiError(400, "the body is not valid JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise _ApiError(400, "the body must be a JSON object", "invalid_json")
    return body


async def serve(cfg: ServeConfig, until: Callable[[], asyncio.Future[Any]] | None = None) -> None:
    """Start `cfg.workers` workers, write the manifest, run until `until()` resolves (default:
    SIGINT or SIGTERM), then stop them all."""
    tokenizer = RouterTokenizer(cfg.tokenizer)
    clock, metrics = _Clock(cfg.time_scale), _Metrics()
    workers = [
        SimWorker(f"{cfg.name_prefix}{i}", cfg, tokenizer, clock, metrics)
        for i in range(cfg.workers)
    ]
    try:
        for i, w in enumerate(workers):
            await w.start(cfg.port + i if cfg.port else 0)
        if cfg.manifest is not None:
            _write_manifest(cfg, workers)
        _log.info("%d simulated workers listening: %s", len(workers), workers[0].url)
        stop = until() if until is not None else _signalled()
        drivers = [w.driver for w in workers if w.driver is not None]
        await asyncio.wait([stop, *drivers], return_when=asyncio.FIRST_COMPLETED)
        for driver in drivers:  # a simulator bug: fail loudly rather than serve no tokens
            if driver.done():
                driver.result()
    finally:
        for w in workers:
            await w.stop()


def _write_manifest(cfg: ServeConfig, workers: list[SimWorker]) -> None:
    assert cfg.manifest is not None
    data = {
        "model": cfg.model,
        "block_size": cfg.engine.block_size,
        "pid": os.getpid(),
        "workers": [w.manifest() for w in workers],
    }
    tmp = cfg.manifest.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(cfg.manifest)


def _signalled() -> asyncio.Future[None]:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def stop() -> None:
        if not done.done():
            done.set_result(None)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    return done


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m replay.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="served model name (the router's `model`)")
    ap.add_argument("--tokenizer", required=True, help="model folder with tokenizer.json")
    ap.add_argument("--workers", type=int, default=1, help="simulated workers in this process")
    ap.add_argument("--port", type=int, default=0, help="first HTTP port (0: free ports)")
    ap.add_argument("--name-prefix", default="sim", help="worker names: PREFIX0, PREFIX1, ...")
    ap.add_argument(
        "--manifest",
        type=output_file,
        help="write the workers (router worker config) to this JSON",
    )
    for name, default in EngineConfig().model_dump().items():
        ap.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(default),
            default=default,
            help=f"simulated engine: {name} (default {default})",
        )
    ap.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="divide the reference cost model's pass times by this",
    )
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="simulated seconds per real second (>1: faster than real time)",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=8192,
        help="longest prompt + output, tokens (longer: a 400, as vLLM answers)",
    )
    ap.add_argument(
        "--default-max-tokens",
        type=int,
        default=16,
        help="output tokens of a request that sets no max_tokens",
    )
    ap.add_argument(
        "--load-interval-s",
        type=float,
        default=0.5,
        help="seconds between load snapshots on each stream",
    )
    return ap


def config_from_args(argv: list[str] | None = None) -> ServeConfig:
    """Parse flags into a validated config; raises `ValueError` naming the bad flag."""
    args = _parser().parse_args(argv)
    engine = {k: getattr(args, k) for k in EngineConfig.model_fields}
    fields = {k: v for k, v in vars(args).items() if k not in engine and v is not None}
    try:
        return ServeConfig.model_validate({**fields, "engine": engine})
    except ValidationError as err:
        lines = [
            f"  --{'.'.join(str(p) for p in e['loc'][-1:]).replace('_', '-')}: {e['msg']}"
            for e in err.errors()
        ]
        raise ValueError("invalid simulator options:\n" + "\n".join(lines)) from None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = config_from_args(argv)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        factory = None
    else:
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        try:
            runner.run(serve(cfg))  # the tokenizer is loaded first, before anything listens
        except TokenizerError as exc:
            print(f"--tokenizer: {exc}", file=sys.stderr)
            return 2
        except (OSError, zmq.ZMQError) as exc:
            print(f"cannot start the simulated workers: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
