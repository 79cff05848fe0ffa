"""Router HTTP API against small in-process fake engines: error shapes, overrides, streaming,
auth, metrics, cancellation. Real-engine behaviour is tested in tests/vllm/test_router_*.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from router.app import Router
from router.chat_shape import PromptError, has_media, sglang_tools, vllm_tools
from router.config import RouterConfig
from router.index import MemoryStore, PrefixIndex
from router.placement import Placement
from router.tiering import Action, TierPolicy, TierState
from router.token_cache import ChunkCache
from router.tokenize import RouterTokenizer, start_prompts
from router.upstream import ConnectTimeout
from router.workers import Workers
from warply.protocol import (
    BlockStored,
    DecodedBatch,
    LoadSnapshot,
    PrefixHit,
    cache_namespace,
    prefix_keys,
    request_namespace,
)
from warply.protocol.api import CacheStats, WorkerList

HOST = "127.0.0.1"
BS = 4
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE tokenizer with a BOS post-processor and a chat template."""
    out = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|start|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the cache holds a prefix of tokens"] * 50, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def usage_block(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    """An OpenAI usage block; `cached` None leaves `prompt_tokens_details` out."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def cut_event(text: str) -> dict[str, Any]:
    """The error of the event that ends a stream cut short by the router (an upstream failure,
    a stopping router's drain): the last event before `data: [DONE]`."""
    events = text.strip().split("\n\n")
    assert events[-1] == "data: [DONE]", events
    error: dict[str, Any] = json.loads(events[-2][len("data: "):])["error"]
    return error


@dataclass
class FakeEngine:
    """An OpenAI-ish engine: records bodies, reports usage, streams, can hang or be down."""

    name: str
    cached_tokens: int | None = None
    """What its usage reports cached (None: no `prompt_tokens_details`, as vLLM without
    `--enable-prompt-tokens-details`)."""
    hang: bool = False
    linger_s: float = 0.0
    """How long its stream stays open after `data: [DONE]`."""
    down: bool = False
    """Not served: its port refuses connections."""
    max_model_len: int = 64
    models: bytes | None = None
    """What its /v1/models answers instead of its card (a broken or foreign engine)."""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)
    """The bytes of each body, as received."""
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    tokenize: bool = False
    """Serves /tokenize and /detokenize (one id per word: the router's parity probe then finds
    a mismatch, so off unless a test forwards them)."""
    metrics_text: str = ""
    """What its /metrics answers (e.g. vLLM's KV-transfer counters)."""
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Its Responses API's stored responses by id (as vLLM with its store on)."""
    paths: list[str] = field(default_factory=list)
    """The raw path (query included) of each stored-response request it got."""
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/v1/models", self._models),
                web.get("/metrics", self._metrics),
                web.post("/v1/completions", self._generate),
                web.post("/v1/chat/completions", self._generate),
                web.post("/v1/responses", self._respond),
                web.get("/v1/responses/{id}", self._stored),
                web.post("/v1/responses/{id}/cancel", self._stored),
                web.post("/v1/messages", self._message),
                web.post("/v1/messages/count_tokens", self._count_tokens),
            ]
        )
        if self.tokenize:
            app.add_routes(
                [web.post("/tokenize", self._tokenize), web.post("/detokenize", self._tokenize)]
            )
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({})

    async def _models(self, _: web.Request) -> web.Response:
        if self.models is not None:
            return web.Response(body=self.models, content_type="application/json")
        return web.json_response({"data": [{"id": "m", "max_model_len": self.max_model_len}]})

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text)

    async def _tokenize(self, request: web.Request) -> web.Response:
        """/tokenize (a string `prompt`: one id per word) and /detokenize (`tokens`: a word per
        id), naming the engine; anything else is a 400 in vLLM's error shape."""
        self.raw.append(await request.read())
        body = json.loads(self.raw[-1])
        self.bodies.append(body)
        prompt, tokens = body.get("prompt"), body.get("tokens")
        if request.path == "/tokenize" and isinstance(prompt, str):
            ids = [len(word) for word in prompt.split()]
            answer = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        elif request.path == "/detokenize" and isinstance(tokens, list):
            answer = {"prompt": " ".join("w" * t for t in tokens if isinstance(t, int))}
        else:
            error = {"message": "bad input", "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": error}, status=400)
        return web.json_response({**answer, "engine": self.name})

    async def _respond(self, request: web.Request) -> web.StreamResponse:
        """/v1/responses: answers the engine's name; a stream's events as vLLM 0.32 sends them
        (`event: TYPE` lines); an unknown `previous_response_id` is a 404."""
        self.raw.append(await request.read())
        body = json.loads(self.raw[-1])
        self.bodies.append(body)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            error = {"message": f"Response with id '{previous}' not found.",
                     "type": "invalid_request_error", "param": None, "code": 404}  # fmt: skip
            return web.json_response({"error": error}, status=404)
        usage = {"input_tokens": 10, "output_tokens": 2, "total_tokens": 12}
        if self.cached_tokens is not None:
            usage["input_tokens_details"] = {"cached_tokens": self.cached_tokens}  # type: ignore[assignment]
        text = {"type": "output_text", "text": self.name}
        answer = {"id": body.get("request_id", "resp_fake"), "object": "response",
                  "output": [{"type": "message", "role": "assistant", "content": [text]}],
                  "usage": usage}  # fmt: skip
        self.stored[answer["id"]] = answer
        if not body.get("stream"):
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {k: v for k, v in answer.items() if k != "usage"}
        events = [("response.created", {"response": head}),
                  ("response.in_progress", {"response": head}),
                  ("response.output_text.delta", {"delta": self.name[:1]}),
                  ("response.output_text.delta", {"delta": self.name[1:]}),
                  ("response.completed", {"response": answer})]  # fmt: skip
        for kind, data in events:
            while self.hang and kind == "response.output_text.delta":
                await asyncio.sleep(0.05)
            event = f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"
            await resp.write(event.encode())
        return resp

    async def _message(self, request: web.Request) -> web.StreamResponse:
        """/v1/messages: answers the engine's name with vLLM 0.32's Anthropic usage (the cached
        tokens apart); a stream's events as vLLM sends them, held at the first delta while
        `hang`."""
        self.raw.append(await request.read())
        body = json.loads(self.raw[-1])
        self.bodies.append(body)
        usage: dict[str, int] = {"input_tokens": 10 - (self.cached_tokens or 0),
                                 "output_tokens": 2}  # fmt: skip
        if self.cached_tokens is not None:
            usage["cache_read_input_tokens"] = self.cached_tokens
        answer = {"id": "msg_fake", "type": "message", "role": "assistant", "model": "m",
                  "content": [{"type": "text", "text": self.name}], "stop_reason": "end_turn",
                  "usage": usage}  # fmt: skip
        if not body.get("stream"):
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = {**answer, "content": [], "usage": {"input_tokens": 0, "output_tokens": 0}}
        events = [("message_start", {"message": start}),
                  ("content_block_start", {"index": 0, "content_block": {"type": "text"}}),
                  ("content_block_delta", {"delta": {"type": "text_delta", "text": "a"}}),
                  ("content_block_delta", {"delta": {"type": "text_delta", "text": "b"}}),
                  ("content_block_stop", {"index": 0}),
                  ("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": usage}),
                  ("message_stop", {})]  # fmt: skip
        for kind, data in events:
            event = f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"
            await resp.write(event.encode())
            while self.hang and kind == "content_block_delta":
                await asyncio.sleep(0.05)
        return resp

    async def _count_tokens(self, request: web.Request) -> web.Response:
        self.bodies.append(json.loads(await request.read()))
        return web.json_response({"input_tokens": 10, "engine": self.name})

    async def _stored(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/responses/{id} and its cancel: the stored response, or a 404; with
        `stream=true` its events (held after the first while `hang`)."""
        self.paths.append(request.raw_path)
        stored = self.stored.get(request.match_info["id"])
        if stored is None:
            error = {"message": "not found", "type": "invalid_request_error", "param": None,
                     "code": 404}  # fmt: skip
            return web.json_response({"error": error}, status=404)
        if request.method != "GET" or request.query.get("stream") != "true":
            return web.json_response({**stored, "engine": self.name})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for kind in ("response.created", "response.completed"):
            event = {"type": kind, "response": stored}
            await resp.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())
            while self.hang:
                await asyncio.sleep(0.05)
        return resp

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.raw.append(await request.read())
        body = json.loads(self.raw[-1])
        self.bodies.append(body)
        usage = usage_block(10, 2, self.cached_tokens)
        if not body.get("stream"):
            return web.json_response({"id": "x", "choices": [{"text": self.name}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for piece in ("a", "b"):
                chunk = {"choices": [{"index": 0, "text": piece}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                while self.hang:
                    await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        if (body.get("stream_options") or {}).get("include_usage"):
            final = {"choices": [], "usage": usage}
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(self.linger_s)
        return resp


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://{HOST}:{port}"


def _refused_port() -> int:
    """A local port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
    return port


async def serve_engines(engines: Sequence[FakeEngine]) -> list[web.AppRunner]:
    """Serve each engine on 127.0.0.1 and set its url; a `down` one gets a refusing port."""
    runners = []
    for e in engines:
        if e.down:
            e.url = f"http://{HOST}:{_refused_port()}"
            continue
        runner, e.url = await _serve(e.app())
        runners.append(runner)
    return runners


Client = Callable[..., Awaitable[tuple[int, Any]]]


@asynccontextmanager
async def running(
    tokenizer_dir: Path,
    engines: Sequence[FakeEngine],
    streams: dict[str, dict[str, Any]] | None = None,
    **overrides: Any,
) -> AsyncIterator[tuple[Router, Client, aiohttp.ClientSession, str]]:
    """Fake engines + a router in this event loop; yields (router, call, session, base url).
    `streams`: per engine name, more worker fields (`events`, `replay`, ...)."""
    runners = await serve_engines(engines)
    config = RouterConfig.model_validate(
        {
            "model": "m",
            "tokenizer": tokenizer_dir,
            "pools": [
                {
                    "name": "p",
                    "block_size": BS,
                    "kv_bytes_per_token": 100,
                    "workers": [
                        {"name": e.name, "url": e.url, **(streams or {}).get(e.name, {})}
                        for e in engines
                    ],
                }
            ],
            "health_interval_s": 0.1,
            **overrides,
        }
    )
    tokenizer = RouterTokenizer(
        tokenizer_dir, config.tokenizer_cache_mib << 20, chat_template=config.chat_template
    )
    router = Router(config, tokenizer)
    router_runner, base = await _serve(router.app)
    session = aiohttp.ClientSession()

    async def call(method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else None
        if data is not None:
            kw["headers"] = {"Content-Type": "application/json", **kw.get("headers", {})}
        async with session.request(
            method, base + path, json=None if data else body, data=data, **kw
        ) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text

    try:
        yield router, call, session, base
    finally:
        await session.close()
        await router_runner.cleanup()
        for runner in runners:
            await runner.cleanup()


def _run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


def _is_error(body: Any, code: str) -> bool:
    err = body["error"]
    return set(err) == {"message", "type", "param", "code"} and err["code"] == code


def test_errors_are_openai_shaped(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")]) as (_, call, _s, _b):
            status, body = await call("POST", "/v1/completions", b"{not json")
            assert status == 400 and _is_error(body, "invalid_json")
            status, body = await call("POST", "/v1/completions", {"model": "x", "prompt": "hi"})
            assert status == 404 and _is_error(body, "model_not_found")
            assert body["error"]["param"] == "model"
            long = {"model": "m", "prompt": "the cache " * 40}  # > max_model_len 64 (engine)
            status, body = await call("POST", "/v1/completions", long)
            assert status == 400 and _is_error(body, "context_length_exceeded")
            status, body = await call("POST", "/v1/chat/completions", {"messages": []})
            assert status == 400 and _is_error(body, "invalid_prompt")
            bad = {"prompt": "hi", "warply": {"cache_key": 3}}
            status, body = await call("POST", "/v1/completions", bad)
            assert status == 400 and body["error"]["param"] == "warply"
            status, body = await call("GET", "/v1/nowhere")
            assert status == 404 and "error" in body

    _run(scenario())


def test_no_healthy_worker_is_503(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")]) as (router, call, _s, _b):
            for w in router.workers.values():
                w.enabled = False
            status, body = await call("POST", "/v1/completions", {"prompt": "hi"})
            assert status == 503 and _is_error(body, "no_healthy_worker")
            status, _ = await call("GET", "/health")
            assert status == 503

    _run(scenario())


def test_passthrough_and_overrides(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        engine = FakeEngine("a", cached_tokens=4)
        async with running(tokenizer_dir, [engine]) as (router, call, _s, _b):
            req = {
                "model": "m",
                "prompt": "the cache holds",
                "max_tokens": 3,
                "logit_bias": {"5": 1},
                "warply": {"cache_key": "tenant-a", "prefix_reuse": False},
            }
            status, body = await call("POST", "/v1/completions", req)
            assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
            sent = engine.bodies[-1]
            assert "warply" not in sent and sent["cache_salt"] == "tenant-a"
            assert sent["logit_bias"] == {"5": 1} and sent["max_tokens"] == 3
            stats = await router.cache_stats()
            assert stats.affinity[0].namespace == "tenant-a"
            assert stats.engine_cached_tokens == 4

    _run(scenario())


def test_a_body_the_router_need_not_rewrite_is_sent_as_it_came(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        engine = FakeEngine("a")
        async with running(tokenizer_dir, [engine]) as (_r, call, _s, _b):
            raw = b'{ "prompt" : "caf\\u00e9 holds",  "max_tokens":3, "model":"m" }'
            status, _ = await call(
                "POST", "/v1/completions", raw, headers={"Content-Type": "application/json"}
            )
            assert status == 200 and engine.raw[-1] == raw
            streamed = b'{"prompt": "x", "stream": true, "model": "m"}'
            status, _ = await call("POST", "/v1/completions", streamed)
            assert status == 200 and engine.raw[-1] != streamed  # usage asked for: rewritten
            assert engine.bodies[-1]["stream_options"] == {"include_usage": True}

    _run(scenario())


def test_a_chat_with_an_image_is_served_by_load_and_sent_as_it_came(tokenizer_dir: Path) -> None:
    """The engine's block hashes of a prompt with images hold the images' own hashes, which
    the router cannot compute: the request is placed by load alone, predicted nothing, and
    its body reaches the engine byte for byte (it was a 400 before)."""

    async def scenario() -> None:
        engines = [FakeEngine("a"), FakeEngine("b")]
        async with running(tokenizer_dir, engines) as (router, _c, session, base):
            text = "the cache holds a prefix of tokens the cache holds a prefix"
            plain = {"model": "m", "messages": [{"role": "user", "content": text}]}
            ids = RouterTokenizer(tokenizer_dir).chat_tokens(plain)
            n = len(ids) // BS * BS
            stored = BlockStored(list(range(1, n // BS + 1)), None, ids[:n], BS)
            await router.index.apply("b", [stored])
            image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}}
            parts = [{"type": "text", "text": text}, image]
            media = {"model": "m", "messages": [{"role": "user", "content": parts}]}

            async def placed(body: dict[str, Any]) -> tuple[str, int, bytes]:
                raw = json.dumps(body).encode()
                async with session.post(
                    base + "/v1/chat/completions", data=raw,
                    headers={"Content-Type": "application/json"},
                ) as r:  # fmt: skip
                    assert r.status == 200, await r.text()
                    predicted = int(r.headers["X-Warply-Predicted-Cached"])
                    return r.headers["X-Warply-Worker"], predicted, raw

            for _ in range(2):  # the text alone: its cached prefix on b decides
                worker, predicted, _ = await placed(plain)
                assert worker == "b" and predicted > 0
            seen = []
            for _ in range(4):
                worker, predicted, raw = await placed(media)
                seen.append(worker)
                assert predicted == 0 and engines["ab".index(worker)].raw[-1] == raw
            assert sorted(seen) == ["a", "a", "b", "b"]  # idle and equal: in turn
            stats = msgspec.json.decode(
                await (await session.get(base + "/warply/cache_stats")).read(), type=CacheStats
            )
            assert (stats.requests, stats.placed_unkeyed) == (6, 4)  # counted, for operators
            metrics = await (await session.get(base + "/metrics")).text()
            assert "warply_router_unkeyed_requests_total 4.0" in metrics

    _run(scenario())


def test_only_text_parts_count_as_text() -> None:
    def chat(*content: Any) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": c} for c in content]}

    assert not has_media(chat("x", [{"type": "text", "text": "y"}], None))
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    assert has_media(chat("x", [audio]))
    assert has_media(chat([{"type": "refusal", "refusal": "no"}]))  # text to vLLM, not to all
    assert not has_media({"messages": "x"}) and not has_media({})


def test_cache_key_namespaces_the_key_chain(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a"), FakeEngine("b")]) as (
            router,
            call,
            _s,
            _b,
        ):
            tok = RouterTokenizer(tokenizer_dir)
            prompt = "the cache holds a prefix of tokens the cache holds a prefix"
            ids = tok.encode(prompt, True)
            n = len(ids) // BS * BS
            await router.index.apply(
                "b",
                [BlockStored(list(range(1, n // BS + 1)), None, ids[:n], BS, namespace="t1")],
            )
            for ns, want in (("t1", "b"), ("t2", None)):
                tokens = ids
                d = await router.placement.choose(tokens, ns)
                assert (d.matched_blocks > 0) == (want is not None)
                if want:
                    assert d.worker.name == want
            assert prefix_keys(ids, BS, "m", "t1") != prefix_keys(ids, BS, "m", "t2")
            req = {"prompt": prompt, "warply": {"cache_key": "t1"}}
            for _ in range(3):  # affinity holds across requests
                status, body = await call("POST", "/v1/completions", req)
                assert status == 200 and body["choices"][0]["text"] == "b"
            req["warply"] = {"cache_key": "t1", "prefix_reuse": False}
            names = []
            for _ in range(4):
                names.append((await call("POST", "/v1/completions", req))[1]["choices"][0]["text"])
            # load alone decides (idle, equal: in turn); b's cached prefix does not pin the prompt
            assert sorted(names) == ["a", "a", "b", "b"]

    _run(scenario())


def test_lora_adapters_are_served_and_keyed_apart(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        engines = [FakeEngine("a"), FakeEngine("b")]
        async with running(tokenizer_dir, engines, lora_adapters=["sql"]) as (
            router,
            call,
            _s,
            _b,
        ):
            status, body = await call("GET", "/v1/models")
            assert [(c["id"], c.get("parent")) for c in body["data"]] == [("m", None), ("sql", "m")]
            prompt = "the cache holds a prefix of tokens the cache holds a prefix"
            ids = RouterTokenizer(tokenizer_dir).encode(prompt, True)
            n = len(ids) // BS * BS
            # Worker b holds the prompt's blocks under adapter `sql` (as the plugins report it).
            lora_ns = cache_namespace(None, "sql")
            stored = BlockStored(list(range(1, n // BS + 1)), None, ids[:n], BS, namespace=lora_ns)
            await router.index.apply("b", [stored])
            req = {"model": "sql", "prompt": prompt}
            for _ in range(3):
                status, body = await call("POST", "/v1/completions", req)
                assert status == 200 and body["choices"][0]["text"] == "b"
            assert engines[1].bodies[-1]["model"] == "sql"  # the engine picks the adapter
            # The base model's identical prompt matches none of the adapter's blocks.
            d = await router.placement.choose(ids, request_namespace({"model": "m"}, "m"))
            assert d.matched_blocks == 0
            status, body = await call("POST", "/v1/completions", {"model": "other", "prompt": "x"})
            assert status == 404 and _is_error(body, "model_not_found")

    _run(scenario())


def test_the_strategys_own_state_is_exported(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a"), FakeEngine("b")]) as (
            router,
            call,
            _s,
            _b,
        ):
            assert router.config.strategy.name == "adaptive"  # the default
            for i in range(5):
                status, _ = await call("POST", "/v1/completions", {"prompt": f"question {i}"})
                assert status == 200
            stats = await router.cache_stats()
            state = stats.strategy_state["p"]
            assert state.gauges["placements"] == 5
            assert 0 <= state.gauges["eviction_loss"] <= 1
            assert set(state.workers["routed_share"]) <= {"a", "b"}
            status, text = await call("GET", "/metrics")
            assert 'warply_strategy_state{name="placements",pool="p"} 5.0' in text
            assert "warply_strategy_worker_state{" in text

    _run(scenario())


def _document(seed: int, lines: int) -> str:
    words = "the cache holds a prefix of tokens".split()
    rng = random.Random(seed)
    return "".join(" ".join(rng.choice(words) for _ in range(12)) + ".\n" for _ in range(lines))


def test_long_prompts_are_placed_from_their_leading_part(tokenizer_dir: Path) -> None:
    """A long never-seen prompt is placed once its second new chunk is reached, and tokenized
    whole only when some worker's cached prefix runs through the part already tokenized."""

    async def scenario() -> None:
        engines = [FakeEngine("a", max_model_len=100_000), FakeEngine("b", max_model_len=100_000)]
        async with running(tokenizer_dir, engines) as (router, call, _s, _b):
            early: list[bool] = []
            choose_early = router.placement.choose_early

            async def spy(*args: Any, **kw: Any) -> Any:
                decision = await choose_early(*args, **kw)
                early.append(decision is not None)
                return decision

            router.placement.choose_early = spy  # type: ignore[method-assign]
            tok = RouterTokenizer(tokenizer_dir)  # not the router's: its chunk cache is cold
            held, cold = _document(1, 120), _document(2, 120)
            ids = tok.encode(held, True)
            n = len(ids) // BS * BS
            stored = BlockStored(list(range(1, n // BS + 1)), None, ids[:n], BS)
            await router.index.apply("b", [stored])
            for _ in range(2):
                status, body = await call("POST", "/v1/completions", {"prompt": held})
                assert status == 200 and body["choices"][0]["text"] == "b"
            assert early == [False], "b's prefix runs past the leading part: tokenize it all"
            before = await router.cache_stats()
            status, _ = await call("POST", "/v1/completions", {"prompt": cold})
            assert status == 200 and early == [False, True]
            after = await router.cache_stats()
            # the metrics count the exact length, tokenized after the request left
            assert after.prompt_tokens - before.prompt_tokens == len(tok.encode(cold, True))
            assert (before.placed_early, after.placed_early) == (0, 1)
            assert after.tokenizer_cache is not None
            misses = after.tokenizer_cache.misses
            assert (await call("POST", "/v1/completions", {"prompt": cold}))[0] == 200
            again = (await router.cache_stats()).tokenizer_cache
            assert again is not None and again.misses == misses, "the rest was cached"
            assert early == [False, True], "a prompt seen before is tokenized whole"

    _run(scenario())


def test_streaming_hides_usage_unless_asked(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        engine = FakeEngine("a", cached_tokens=8)
        async with running(tokenizer_dir, [engine]) as (router, _c, session, base):
            for include in (False, True):
                req: dict[str, Any] = {"prompt": "the cache", "stream": True}
                if include:
                    req["stream_options"] = {"include_usage": True}
                async with session.post(base + "/v1/completions", json=req) as r:
                    assert r.status == 200
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    text = (await r.read()).decode()
                events = [e for e in text.split("\n\n") if e]
                assert events[-1] == "data: [DONE]"
                assert ('"usage"' in text) == include
                assert engine.bodies[-1]["stream_options"]["include_usage"] is True
            stats = await router.cache_stats()
            assert stats.engine_cached_tokens == 16
            assert stats.ttft_s.n == 2

    _run(scenario())


def test_a_client_that_stops_at_done_is_counted_whole(tokenizer_dir: Path) -> None:
    """The OpenAI SDK closes a stream's response once it reads `[DONE]`, before the engine's
    stream ends: the request still counts as answered (200) with its engine's cached tokens."""

    async def scenario() -> None:
        engine = FakeEngine("a", cached_tokens=8, linger_s=0.5)
        async with running(tokenizer_dir, [engine]) as (router, _c, session, base):
            req = {"prompt": "the cache", "stream": True, "stream_options": {"include_usage": True}}
            async with session.post(base + "/v1/completions", json=req) as r:
                await r.content.readuntil(b"data: [DONE]\n\n")
                r.close()
            for _ in range(50):
                stats = await router.cache_stats()
                if stats.requests:
                    break
                await asyncio.sleep(0.05)
            assert stats.requests == 1 and stats.engine_cached_tokens == 8
            text = await (await session.get(base + "/metrics")).text()
            assert 'warply_router_requests_total{status="200",worker="a"} 1.0' in text

    _run(scenario())


def test_client_disconnect_cancels_upstream(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        engine = FakeEngine("a", hang=True)
        async with running(tokenizer_dir, [engine]) as (router, _c, session, base):
            req = {"prompt": "the cache", "stream": True}
            async with session.post(base + "/v1/completions", json=req) as r:
                await r.content.readuntil(b"\n\n")  # first chunk arrived; now hang up
                assert router.workers["a"].load.in_flight == 1
            await asyncio.wait_for(engine.cancelled.wait(), 5)
            for _ in range(50):
                if router.workers["a"].load.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
            assert router.workers["a"].load.in_flight == 0
            assert router.workers["a"].load.in_flight_tokens == 0

    _run(scenario())


def test_a_client_gone_mid_stream_is_a_499_not_a_router_error(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A write to a client whose connection is already closing raises aiohttp's
    ClientConnectionResetError (seen under load, before the handler is cancelled): the request
    counts as 499 (client gone), with no 500 and no traceback in the router's log."""
    write = web.StreamResponse.write

    async def closing(self: web.StreamResponse, data: bytes) -> None:
        if "X-Warply-Worker" in self.headers:  # the router's answer, not the fake engine's
            raise ClientConnectionResetError("Cannot write to closing transport")
        await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", closing)

    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")]) as (router, call, session, base):
            req = {"prompt": "the cache", "stream": True}
            with contextlib.suppress(aiohttp.ClientError):
                async with session.post(base + "/v1/completions", json=req) as r:
                    await r.read()
            for _ in range(50):
                if router.workers["a"].load.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
            assert router.workers["a"].load.in_flight == 0
            _, text = await call("GET", "/metrics")
            counted = [line for line in text.splitlines()
                       if line.startswith("warply_router_requests_total{")]  # fmt: skip
            assert len(counted) == 1 and 'status="499"' in counted[0], counted

    with caplog.at_level(logging.ERROR, logger="router"):
        _run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_auth_on_admin_endpoints_only(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")], auth_token="s3cret") as (
            _r,
            call,
            _s,
            _b,
        ):
            status, body = await call("GET", "/warply/cache_stats")
            assert status == 401 and _is_error(body, "invalid_api_key")
            bad = {"Authorization": "Bearer nope"}
            assert (await call("GET", "/warply/workers", headers=bad))[0] == 401
            good = {"Authorization": "Bearer s3cret"}
            status, body = await call("GET", "/warply/workers", headers=good)
            assert status == 200 and body["workers"][0]["name"] == "a"
            status, _ = await call("POST", "/warply/workers/a", {"enabled": False}, headers=good)
            assert status == 200
            assert (await call("POST", "/v1/completions", {"prompt": "hi"}))[0] == 503
            assert (await call("GET", "/v1/models"))[0] == 200  # client API needs no token

    _run(scenario())


def test_metrics_and_alert(tokenizer_dir: Path) -> None:
    fired: list[tuple[float, float]] = []

    async def scenario() -> None:
        alerts = {"min_hit_ratio": 0.5, "min_requests": 3, "window": 10,
                  "callback": f"{__name__}:record_alert"}
        async with running(tokenizer_dir, [FakeEngine("a")], alerts=alerts) as (
            router,
            call,
            _s,
            _b,
        ):
            _ALERTS.clear()
            for _ in range(3):
                assert (await call("POST", "/v1/completions", {"prompt": "the cache"}))[0] == 200
            assert router.metrics.alert_firing
            fired.extend(_ALERTS)
            status, text = await call("GET", "/metrics")
            assert status == 200
            assert "warply_router_hit_ratio_alert 1.0" in text
            assert 'warply_router_requests_total{status="200",worker="a"} 3.0' in text
            assert "warply_router_overhead_seconds_bucket" in text
            assert "warply_router_engine_cached_tokens_total" in text
            # one prompt three times: encoded once, then served by the tokenizer's chunk cache
            assert 'warply_router_tokenizer_chunks{result="miss"} 1.0' in text
            assert 'warply_router_tokenizer_chunks{result="hit"} 2.0' in text

    _run(scenario())
    assert fired and fired[0][1] == 0.5


def test_a_blocked_event_loop_is_measured_and_its_stacks_logged(
    tokenizer_dir: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Something on the loop that blocks it for 1.2 s: the lag histogram counts a late timer,
    a warning says how late, and (stall dump after 0.5 s) every thread's stack is on stderr,
    naming the blocking call."""

    def _blocking_call() -> None:
        time.sleep(1.2)

    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")], loop_stall_dump_s=0.5) as (
            _r, call, _s, _b,
        ):  # fmt: skip
            await asyncio.sleep(0.3)  # the watch has ticked and armed its dump
            _blocking_call()
            await asyncio.sleep(0.3)
            _, text = await call("GET", "/metrics")
            families = {f.name: f for f in text_string_to_metric_families(text)}
            lag = families["warply_router_event_loop_lag_seconds"].samples
            late = [s.value for s in lag if s.labels.get("le") == "1.0"]
            count = [s.value for s in lag if s.name.endswith("_count")]
            assert count[0] - late[0] >= 1, lag  # at least one tick a second or more late

    with caplog.at_level(logging.WARNING, logger="router.loop_watch"):
        _run(scenario())
    messages = [r.getMessage() for r in caplog.records]
    assert any("event loop ran a timer" in m for m in messages), messages
    assert sum("has not run for" in m for m in messages) == 1, messages  # one dump per stall
    err = capfd.readouterr().err
    assert "_blocking_call" in err, err[-2000:]


def test_tokenizer_cache_keeps_its_configured_budget(tokenizer_dir: Path) -> None:
    """Many distinct long prompts through a 1 MiB tokenizer cache: chunks stay within 1 MiB,
    remembered prompts within half of it, both filled and both on /metrics."""

    async def scenario() -> None:
        engine = FakeEngine("a", max_model_len=100_000)
        async with running(tokenizer_dir, [engine], tokenizer_cache_mib=1) as (
            router,
            call,
            _s,
            _b,
        ):
            rng = random.Random(3)
            words = ["cache", "prefix", "block", "token", "router", "engine", "tenant"]
            cache = router.proxy._tokenizer.cache
            for n in range(60):
                lines = (" ".join(rng.choices(words, k=12)) for _ in range(300))
                prompt = f"Document {n}.\n" + "\n".join(lines)
                assert (await call("POST", "/v1/completions", {"prompt": prompt}))[0] == 200
                assert cache.stats.bytes <= 1 << 20 and cache.seen_bytes <= 1 << 19
            assert cache.stats.bytes > 3 << 18 and cache.seen_bytes > 1 << 18, "filled"
            text = (await call("GET", "/metrics"))[1]
            gauges = {
                s.name: s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name.startswith("warply_router_tokenizer_")
            }
            assert gauges["warply_router_tokenizer_cache_bytes"] == cache.stats.bytes
            assert gauges["warply_router_tokenizer_texts_bytes"] == cache.seen_bytes

    _run(scenario())


_ALERTS: list[tuple[float, float]] = []


def record_alert(ratio: float, threshold: float) -> None:
    """Alert callback target (`module:function`) used by test_metrics_and_alert."""
    _ALERTS.append((ratio, threshold))


def test_bytes_cached_by_tier(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")]) as (router, call, _s, _b):
            await router.index.apply("a", [BlockStored([1, 2], None, list(range(2 * BS)), BS)])
            status, stats = await call("GET", "/warply/cache_stats")
            assert status == 200
            assert stats["index"]["bytes_by_tier"] == {"gpu": 2 * BS * 100}
            assert stats["index"]["bytes_by_pool"] == {"p": 2 * BS * 100}
            # a pool that states no bytes per token: the engine's own figure, once it reports
            a = router.workers["a"]
            a.pool = a.pool.model_copy(update={"kv_bytes_per_token": 0})
            _, stats = await call("GET", "/warply/cache_stats")
            assert stats["index"]["bytes_cached"] == 0
            snap = LoadSnapshot(0, 0, 0.0, kv_blocks_total=10, kv_bytes_per_block=64 * BS)
            router.workers.engine_load("a", snap)
            _, stats = await call("GET", "/warply/cache_stats")
            assert stats["index"]["bytes_by_tier"] == {"gpu": 2 * 64 * BS}
            _, workers = await call("GET", "/warply/workers")
            assert workers["workers"][0]["kv_bytes_per_block"] == 64 * BS

    _run(scenario())


def test_refused_connection_is_retried_on_another_worker(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        engines = [FakeEngine("a", down=True), FakeEngine("b")]
        # no probe during the test: only the proxy can mark "a" unhealthy again
        async with running(tokenizer_dir, engines, health_interval_s=60) as (router, call, _s, _b):
            a = router.workers["a"]
            assert not a.healthy, "the start-up probe found nothing listening"
            a.set_health(True)  # as if it went down after its last probe
            prompt = "the cache holds a prefix of tokens"
            ids = RouterTokenizer(tokenizer_dir).encode(prompt, True)
            n = len(ids) // BS * BS
            stored = BlockStored(list(range(1, n // BS + 1)), None, ids[:n], BS)
            await router.index.apply("a", [stored])
            assert (await router.placement.choose(ids)).worker.name == "a"  # a's prefix draws it
            status, body = await call("POST", "/v1/completions", {"prompt": prompt})
            assert status == 200 and body["choices"][0]["text"] == "b"
            assert not a.healthy
            for w in router.workers.values():  # both attempts gave their load back
                load = w.load
                assert (load.in_flight, load.in_flight_tokens, load.pending_prefill_tokens) == (
                    0, 0, 0
                )
            stats = await router.cache_stats()
            assert stats.workers["b"].engine_cached_tokens == 0 and stats.workers["b"].requests

    _run(scenario())


def test_tokenize_and_detokenize_are_forwarded_as_they_came(tokenizer_dir: Path) -> None:
    """To the available worker with the least in flight, past one that refuses connections;
    the engine's answer, errors included, is the client's; the model is checked first."""

    async def scenario() -> None:
        engines = [FakeEngine("a", down=True), FakeEngine("b"), FakeEngine("c", tokenize=True)]
        async with running(tokenizer_dir, engines, health_interval_s=60) as (
            router, call, session, base,
        ):  # fmt: skip
            a, b = router.workers["a"], router.workers["b"]
            a.set_health(True)  # as if it went down after its last probe
            b.load.in_flight = 2
            raw = b'{"model": "m",  "prompt": "the cache holds", "return_token_strs": false}'
            json_type = {"Content-Type": "application/json"}
            async with session.post(base + "/tokenize", data=raw, headers=json_type) as resp:
                assert resp.status == 200 and resp.headers["X-Warply-Worker"] == "c"
                assert await resp.json() == {
                    "count": 3, "max_model_len": 64, "tokens": [3, 5, 5], "engine": "c"
                }
            assert engines[2].raw == [raw] and not a.healthy
            status, body = await call("POST", "/detokenize", {"tokens": [1, 2]})
            assert (status, body) == (200, {"prompt": "w ww", "engine": "c"})
            status, body = await call("POST", "/tokenize", {"messages": []})
            assert status == 400 and body["error"]["message"] == "bad input"  # the engine's
            status, body = await call("POST", "/tokenize", {"model": "x", "prompt": "hi"})
            assert status == 404 and _is_error(body, "model_not_found")
            status, body = await call("POST", "/tokenize", {"model": 3, "prompt": "hi"})
            assert status == 400 and _is_error(body, "invalid_value")
            status, _ = await call("GET", "/tokenize")
            assert status == 405
            assert len(engines[2].raw) == 3  # the router's own refusals sent nothing
            b.enabled = router.workers["c"].enabled = False
            status, body = await call("POST", "/detokenize", {"tokens": [1]})
            assert status == 503 and _is_error(body, "no_healthy_worker")
            forwarded = {
                (s.labels["endpoint"], s.labels["worker"], s.labels["status"]): s.value
                for f in text_string_to_metric_families((await call("GET", "/metrics"))[1])
                if f.name == "warply_router_forwarded_requests"
                for s in f.samples
                if s.name.endswith("_total")
            }
            assert forwarded == {
                ("tokenize", "c", "200"): 1, ("detokenize", "c", "200"): 1,
                ("tokenize", "c", "400"): 1,
            }  # fmt: skip

    _run(scenario())


def test_a_connection_not_made_in_time_is_tried_once_more(tokenizer_dir: Path) -> None:
    """Nothing reached the engine (a stalled machine): the same worker is asked again."""

    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")]) as (router, call, _s, _b):
            upstream = router.proxy.upstream
            post = upstream.post
            calls = []

            async def stalled(url: str, *args: Any) -> Any:
                calls.append(url)
                if len(calls) == 1:
                    raise ConnectTimeout(f"no connection to {url} in 5 s")
                return await post(url, *args)

            upstream.post = stalled  # type: ignore[method-assign]
            status, body = await call("POST", "/v1/completions", {"prompt": "a prefix"})
            assert status == 200 and body["choices"][0]["text"] == "a"
            assert len(calls) == 2 and router.workers["a"].healthy

    _run(scenario())


def test_an_engine_reporting_fewer_cached_tokens_is_counted_and_the_index_kept(
    tokenizer_dir: Path,
) -> None:
    """The index credits "a" with the whole prompt. While its engine reports that hit, nothing
    is counted; once it reports one block, the blocks after that one are counted as
    over-predicted for "a", and the index still holds them (the engine stores what it
    recomputes again, and its events, not the report, say what it holds)."""

    async def scenario() -> None:
        engine = FakeEngine("a")
        async with running(tokenizer_dir, [engine]) as (router, call, _s, _b):
            prompt = "the cache holds a prefix of tokens the cache holds a prefix of tokens"
            ids = RouterTokenizer(tokenizer_dir).encode(prompt, True)
            n = len(ids) // BS * BS
            stored = BlockStored(list(range(1, n // BS + 1)), None, ids[:n], BS)
            await router.index.apply("a", [stored])
            predicted = (await router.placement.choose(ids)).predicted_cached
            assert predicted >= 2 * BS
            keys = prefix_keys(ids, BS, "m")
            for reported, over in ((predicted, {}), (BS, {"a": predicted // BS - 1})):
                engine.cached_tokens = reported
                status, _ = await call("POST", "/v1/completions", {"prompt": prompt})
                assert status == 200
                assert (await router.index.match(keys))["a"].blocks == n // BS
                _, stats = await call("GET", "/warply/cache_stats")
                assert stats["index"]["overpredicted"] == over
            _, text = await call("GET", "/metrics")
            assert f'warply_index_overpredicted_blocks{{worker="a"}} {predicted // BS - 1}' in text

    _run(scenario())


@pytest.mark.parametrize(
    "models",
    [
        b'{"data": [{"id": "m", "max_model_len": -1}]}',
        b'{"data": [{"id": "m", "max_model_len": true}]}',
        b'{"data": [{"id": "m", "max_model_len": "64"}]}',
        b'{"data": 5}',
        b"[1]",
        b"not json",
        b'{"data": [{"id": "other", "max_model_len": 64}]}',
    ],
)
def test_a_context_limit_it_cannot_trust_is_left_to_the_engine(
    tokenizer_dir: Path, models: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """An odd /v1/models answer neither stops the router's start (`{"data": 5}` was a
    traceback that ended the process) nor becomes its limit (-1 and `true` refused every
    request): the limit stays unknown and the engine judges prompt lengths. A worker that lists
    other models only is named in a warning."""
    caplog.set_level(logging.WARNING, "warply.router")

    async def scenario() -> None:
        engine = FakeEngine("a", models=models)
        async with running(tokenizer_dir, [engine]) as (router, call, _s, _b):
            assert router.proxy.max_model_len is None
            status, _ = await call("POST", "/v1/completions", {"prompt": "the cache " * 40})
            assert status == 200 and len(engine.bodies) == 1

    _run(scenario())
    foreign = [r.getMessage() for r in caplog.records if "the router's model" in r.getMessage()]
    assert bool(foreign) is (b"other" in models), foreign


def test_an_impossible_cached_count_is_passed_on_and_not_counted(tokenizer_dir: Path) -> None:
    """A broken upstream's usage (cached tokens negative, past its prompt, a boolean) reaches
    the client as the engine sent it and counts nothing (a negative count was a 500 for a
    served request; a huge one put the engine hit rate in the billions)."""

    async def scenario() -> None:
        engine = FakeEngine("a")
        async with running(tokenizer_dir, [engine]) as (router, call, _s, _b):
            for bad in (-5, 10**12, True):
                engine.cached_tokens = bad
                status, body = await call("POST", "/v1/completions", {"prompt": "the cache"})
                assert status == 200
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == bad
            engine.cached_tokens = 1
            assert (await call("POST", "/v1/completions", {"prompt": "the cache"}))[0] == 200
            _, stats = await call("GET", "/warply/cache_stats")
            assert stats["engine_cached_tokens"] == 1 and stats["requests"] == 4
            assert 0 < stats["hit_rate"]["engine"] <= 1

    _run(scenario())


def test_engine_load_and_prefix_hits_are_shown(tokenizer_dir: Path) -> None:
    """`LoadSnapshot` running / capacity on /warply/workers; `PrefixHit` (engine-confirmed reuse)
    per worker in cache_stats and on /metrics; both endpoints decode as their typed shapes."""

    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a"), FakeEngine("b")]) as (
            router,
            call,
            session,
            base,
        ):
            events = [
                LoadSnapshot(running=3, waiting=2, kv_usage=0.5, kv_blocks_total=900),
                PrefixHit("r1", [11, 12], hit_tokens=8, prompt_tokens=12),
                PrefixHit("r2", [11], hit_tokens=4, prompt_tokens=9),
            ]
            await router.feed.on_batch("a", DecodedBatch(1, 0.0, events, "warply"))  # type: ignore[arg-type]
            async with session.get(base + "/warply/workers") as r:
                workers = msgspec.json.decode(await r.read(), type=WorkerList).workers
            a, b = workers
            assert (a.engine_running, a.engine_waiting, a.kv_usage, a.kv_blocks_total) == (
                3, 2, 0.5, 900
            )
            assert (b.engine_running, b.kv_blocks_total, a.role) == (0, 0, "both")
            assert router.workers["a"].load.load == 2  # what the strategies see: waiting
            async with session.get(base + "/warply/cache_stats") as r:
                stats = msgspec.json.decode(await r.read(), type=CacheStats)
            hits = stats.workers["a"]
            assert (hits.engine_prefix_hits, hits.engine_prefix_hit_tokens) == (2, 12)
            assert stats.workers["b"].engine_prefix_hits == 0
            _, text = await call("GET", "/metrics")
            assert 'warply_engine_prefix_hit_tokens_total{worker="a"} 12.0' in text

    _run(scenario())


class FailingTierPolicy(TierPolicy):
    """A user tier policy with a bug: every round raises."""

    name = "failing"

    def decide(self, state: TierState) -> Sequence[Action]:
        raise ValueError(f"bug after {len(state.prefixes)} prefixes")


def test_a_failing_tier_policy_is_counted_and_routing_goes_on(tokenizer_dir: Path) -> None:
    tiering = {"policy": {"name": f"{__name__}:FailingTierPolicy"}, "interval_s": 0.05}

    async def scenario() -> None:
        engine = FakeEngine("a")
        async with running(tokenizer_dir, [engine], tiering=tiering) as (router, call, _s, _b):
            req = {"model": "m", "prompt": "the cache holds a prefix", "max_tokens": 2}
            for _ in range(3):
                status, _body = await call("POST", "/v1/completions", req)
                assert status == 200
                await asyncio.sleep(0.06)
            stats = await router.cache_stats()
            assert stats.tiering is not None and stats.tiering.policy == "failing"
            assert stats.tiering.policy_failures >= 2
            assert stats.tiering.last_error.startswith("ValueError: bug after 1 prefixes")
            _, text = await call("GET", "/metrics")
            assert "warply_tiering_policy_failures_total" in text

    _run(scenario())


def test_growing_prompts_keep_their_key_chains_exact(tokenizer_dir: Path) -> None:
    """Growing texts, encoded with and without the BOS head in turn: every prompt's chain,
    extended from an earlier prompt's where the tokenizer reports one, equals a fresh chain."""
    tok = RouterTokenizer(tokenizer_dir)
    tok.cache = ChunkCache(tok._tok, min_chunk_chars=16, min_level_chars=32)
    config = RouterConfig.model_validate(
        {"model": "m", "tokenizer": tokenizer_dir,
         "pools": [{"name": "p", "block_size": BS, "workers": [{"name": "a", "url": "http://a"}]}]}
    )
    placement = Placement(config, PrefixIndex("m", MemoryStore()), Workers(config.pools))
    text, extended = "the cache holds\n", 0
    for step in range(40):
        text += f"line {step}: the cache holds a prefix of tokens\n"
        prompt = tok.finish(tok.start(text, add_special_tokens=step % 3 == 0))
        lineage = prompt.lineage
        assert lineage is not None
        keys = placement.keys(prompt.tokens, BS, "", lineage)
        assert keys == prefix_keys(prompt.tokens, BS, "m", "")
        extended += lineage.shared > 0
    assert extended > 30


def test_only_long_new_text_is_left_for_the_tokenizer_thread(tokenizer_dir: Path) -> None:
    """`start_prompts` with a budget (the router's test for tokenizing on its event loop): a
    never-seen long text is left as a call, which gives the prompt a whole-text encode gives;
    a next turn whose history is remembered is tokenized at once. A batch of texts is left
    whole by its length; token ids are no encoding work."""
    tok = RouterTokenizer(tokenizer_dir)
    fresh = RouterTokenizer(tokenizer_dir)
    history = [{"role": "user", "content": "the cache holds a prefix of tokens " * 80}]
    body: dict[str, Any] = {"messages": history}
    left = start_prompts(tok, "chat", body, 256)
    assert callable(left)
    assert list(tok.finish(left()[0]).tokens) == fresh.chat_tokens(body)
    body = {"messages": [*history, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "and then?"}]}
    started = start_prompts(tok, "chat", body, 256)
    assert isinstance(started, list)
    lineage = started[0].lineage
    assert lineage is not None and lineage.shared > 500
    assert list(tok.finish(started[0]).tokens) == fresh.chat_tokens(body)
    assert callable(start_prompts(tok, "completion", {"prompt": ["x " * 200, "y"]}, 256))
    assert isinstance(start_prompts(tok, "completion", {"prompt": [1, 2, 3]}, 0), list)


TOOL_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls', []) %}[{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}]{% endfor %}|{% endfor %}"
)


def test_tool_call_arguments_reach_the_template_as_objects(tokenizer_dir: Path) -> None:
    """Both engines parse an assistant tool call's `arguments` (a JSON string in the OpenAI
    API) into an object before rendering (vLLM 0.32 `_postprocess_messages`, SGLang 0.5
    `normalize_assistant_tool_call_arguments`); the router rendered the string, so a tool
    conversation's prompt differed from the engine's from its first tool call on. Real vLLM:
    tests/vllm/test_chat_parity.py."""
    tok = RouterTokenizer(tokenizer_dir)
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "b", "function": {"name": "g", "arguments": ""}},
        {"id": "c", "function": {"name": "h", "arguments": "not json"}},
        {"id": "d", "function": {"name": "k", "arguments": "[1]"}},
        {"id": "e", "function": {"name": "m", "arguments": {"y": 2}}},
    ]
    body = {"chat_template": TOOL_TEMPLATE, "add_generation_prompt": False, "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": calls},
        {"role": "assistant", "content": "none", "tool_calls": []},
    ]}  # fmt: skip
    assert tok.render_chat(body) == (
        'user:go|assistant:[f {"x": 1}][g {}][h {}][k {}][m {"y": 2}]|assistant:none|'
    )
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    bad = {**body, "messages": [{"role": "assistant", "tool_calls": [{"type": "code"}]}]}
    with pytest.raises(PromptError, match="tool_calls"):
        tok.render_chat(bad)


def test_tools_reach_the_template_as_vllm_dumps_them(tokenizer_dir: Path) -> None:
    """vLLM 0.32 hands the template its pydantic dump of each tool (nulls for an unset
    description or parameters, `strict` / `defer_loading` only when set, other keys dropped):
    the router renders a vLLM fleet's tool chats with that (real vLLM:
    tests/vllm/test_chat_parity.py), an SGLang fleet's with SGLang's own dump."""
    tools = [
        {"type": "function", "cache": "x", "defer_loading": True,
         "function": {"parameters": {"type": "object"}, "name": "f", "colour": "red"}},
        {"type": "function", "function": {"name": "g", "description": "d", "strict": False}},
    ]  # fmt: skip
    assert vllm_tools(tools) == [
        {"type": "function", "defer_loading": True, "function": {
            "name": "f", "description": None, "parameters": {"type": "object"},
            "defer_loading": True}},
        {"type": "function", "function": {
            "name": "g", "description": "d", "parameters": None, "strict": False}},
    ]  # fmt: skip
    assert [list(t["function"]) for t in vllm_tools(tools)] == [
        ["name", "description", "parameters", "defer_loading"],
        ["name", "description", "parameters", "strict"],
    ]
    assert vllm_tools("x") == "x" and vllm_tools([{"type": "function"}]) == [{"type": "function"}]

    async def scenario(card: bytes | None, vllm: bool) -> None:
        engine = FakeEngine("a", max_model_len=4096, models=card)
        template = "{{ tools | tojson }}{{ messages[0]['content'] }}"  # the engines' flag:
        async with running(tokenizer_dir, [engine], chat_template=template) as (router, *_):
            body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
            tokens, _, _ = await router.proxy.tokens(dict(body), "chat")
            dump = vllm_tools(tools) if vllm else sglang_tools(body)
            text = json.dumps(dump, ensure_ascii=False) + "hi"
            assert tokens == RouterTokenizer(tokenizer_dir).whole(text, False)

    _run(scenario(None, vllm=True))  # vLLM's card, or none: vLLM's dump
    sglang = b'{"data": [{"id": "m", "max_model_len": 4096, "owned_by": "sglang"}]}'
    _run(scenario(sglang, vllm=False))  # SGLang's own (tests/sglang/test_chat_shape.py)


def test_developer_messages_render_as_vllm_renders_them(tokenizer_dir: Path) -> None:
    """vLLM 0.32 turns `developer` messages into `system` ones when the template never names
    the role, merging every system message into the first when one is not first (real vLLM:
    tests/vllm/test_chat_parity.py); a template that names it gets them as they are, and so
    does an SGLang fleet's rendering."""
    tok = RouterTokenizer(tokenizer_dir)
    shown = "{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
    chat = [{"role": "system", "content": "a"}, {"role": "user", "content": "u"},
            {"role": "developer", "content": "b", "tools": [1]},
            {"role": "developer", "content": ""}]  # fmt: skip

    def render(messages: list[dict[str, Any]], template: str = shown) -> str:
        return tok.render_chat({"messages": messages, "chat_template": template,
                                "add_generation_prompt": False})  # fmt: skip

    assert render(chat) == "system=a\n\nb;user=u;"
    assert render(chat[2:3] + chat[1:2]) == "system=b;user=u;"  # first: nothing to merge
    named = shown + "{% if false %}'developer'{% endif %}"
    assert render(chat, named) == "system=a;user=u;developer=b;developer=;"
    sglang = RouterTokenizer(tokenizer_dir, chat_template=shown)  # SGLang ignores a request's
    sglang.engine = "sglang"
    assert sglang.render_chat({"messages": chat, "add_generation_prompt": False}) == (
        "system=a;user=u;developer=b;developer=;")  # fmt: skip


def test_messages_reach_the_template_as_vllm_parses_them(tokenizer_dir: Path) -> None:
    """vLLM 0.32's chat parser hands the template a message's role, text (None: ""), string
    name and task, an assistant's tool calls and `reasoning` (also as `reasoning_content`), a
    tool result's id, and nothing else (real vLLM: tests/vllm/test_chat_parity.py); an SGLang
    fleet's rendering gets SGLang 0.5's dump of it: its known fields that are not null, a user
    message's content alone (SGLang's own code: tests/sglang/test_chat_shape.py)."""
    tok = RouterTokenizer(tokenizer_dir)
    shown = "{% for m in messages %}{{ m | tojson }};{% endfor %}"
    chat = [{"role": "user", "content": "u", "name": "ops", "id": 3, "task": 1},
            {"role": "assistant", "content": None, "reasoning": "r", "reasoning_content": "x",
             "refusal": None}, {"role": "tool", "content": "t", "tool_call_id": "c", "id": 1}]
    body = {"messages": chat, "chat_template": shown, "add_generation_prompt": False}
    assert tok.render_chat(body) == (
        '{"role": "user", "content": "u", "name": "ops"};'
        '{"role": "assistant", "content": "", "reasoning": "r", "reasoning_content": "r"};'
        '{"role": "tool", "content": "t", "tool_call_id": "c"};'
    )
    sglang = RouterTokenizer(tokenizer_dir, chat_template=shown)  # SGLang ignores a request's
    sglang.engine = "sglang"
    assert sglang.render_chat({k: v for k, v in body.items() if k != "chat_template"}) == (
        '{"role": "user", "content": "u"};'
        '{"role": "assistant", "content": "", "reasoning_content": "x"};'
        '{"role": "tool", "content": "t", "tool_call_id": "c"};'
    )
