"""`replay.serve`: simulated OpenAI-compatible workers (a simulator), alone and behind the router.

Everything runs in one event loop on 127.0.0.1: the simulated workers, their event streams (real
ZMQ sockets), and for the last tests the router itself with its index fed by those streams.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from replay.costmodel import ReferenceModel
from replay.engine import EngineConfig, SimEngine, SimRequest
from replay.serve import ServeConfig, SimWorker, serve
from router.app import Router
from router.config import RouterConfig
from router.tokenize import RouterTokenizer
from warply.protocol import (
    BlockStored,
    LoadSnapshot,
    StreamDecoder,
    chain_keys,
    root_seed,
)

BS = 4
WORDS = "the cache holds a prefix of tokens and every turn adds more words to it".split()
Post = Callable[..., Awaitable[tuple[int, dict[str, Any], list[dict[str, Any]]]]]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer with BOS and a chat template (a model folder's two files)."""
    out = tmp_path_factory.mktemp("tok")
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "<|turn|>", *WORDS, *map(str, range(50))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(out / "tokenizer.json"))
    template = "{{ bos_token }} {% for m in messages %}<|turn|> {{ m['content'] }} {% endfor %}"
    config = {"bos_token": "<s>", "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@asynccontextmanager
async def fleet(
    tokenizer_dir: Path, tmp: Path, workers: int = 1, **fields: Any
) -> AsyncIterator[list[dict[str, str]]]:
    """Simulated workers in this loop; yields their manifest entries."""
    stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    cfg = ServeConfig.model_validate(
        {
            "model": "m",
            "tokenizer": tokenizer_dir,
            "workers": workers,
            "manifest": tmp / "m.json",
            "engine": {"block_size": BS, "num_blocks": 256},
            "load_interval_s": 0.05,
            **fields,
        }
    )
    task = asyncio.create_task(serve(cfg, lambda: stop))
    while not (tmp / "m.json").exists():
        assert not task.done(), task
        await asyncio.sleep(0.02)
    try:
        yield json.loads((tmp / "m.json").read_text())["workers"]
    finally:
        stop.set_result(None)
        await task


@asynccontextmanager
async def client() -> AsyncIterator[Post]:
    """POST helper: (status, JSON body or final usage chunk, stream chunks)."""
    async with aiohttp.ClientSession() as session:

        async def post(url: str, body: Any, raw: bytes | None = None) -> Any:
            async with session.post(url, json=None if raw else body, data=raw) as r:
                if not r.headers.get("Content-Type", "").startswith("text/event-stream"):
                    return r.status, await r.json(), []
                events = (await r.text()).strip().split("\n\n")
                assert events[-1] == "data: [DONE]", events
                chunks = [json.loads(e[6:]) for e in events[:-1]]
                return r.status, chunks[-1], chunks

        yield post


def _run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


def _cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def _text(n: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n))


def test_answers_like_an_engine_with_its_prefix_cache(tokenizer_dir: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fleet(tokenizer_dir, tmp_path) as workers, client() as post:
            url = workers[0]["url"]
            body = {"model": "m", "prompt": _text(21), "max_tokens": 3}
            status, first, _ = await post(url + "/v1/completions", body)
            assert status == 200 and first["usage"]["prompt_tokens"] == 22  # BOS + 21 words
            assert _cached(first) == 0 and first["choices"][0]["finish_reason"] == "length"
            status, again, _ = await post(url + "/v1/completions", body)
            assert _cached(again) == 20  # the last block is always recomputed
            salted = dict(body, cache_salt="tenant-a")
            assert _cached((await post(url + "/v1/completions", salted))[1]) == 0
            assert _cached((await post(url + "/v1/completions", salted))[1]) == 20
            chat = {
                "model": "m",
                "messages": [{"role": "user", "content": _text(9)}],
                "max_tokens": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            status, usage, chunks = await post(url + "/v1/chat/completions", chat)
            assert status == 200 and usage["usage"]["completion_tokens"] == 5
            deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
            assert deltas[0] == {"role": "assistant", "content": ""} and len(deltas) == 6
            assert usage["simulator"]["worker"] == "sim0"
            # the first token cannot come before the simulated prefill of the 11-token prompt
            assert usage["simulator"]["ttft_ms"] >= ReferenceModel().prefill_ms(11)
            # tokens come out at their simulated times (>= 5.74 ms per decode pass), not at once
            streamed = {"model": "m", "prompt": _text(3), "max_tokens": 100, "stream": True}
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/completions", json=streamed) as r,
            ):
                reads = [len(piece) async for piece in r.content.iter_any()]
            assert len(reads) > 1, reads
            plain = dict(chat, stream_options=None)
            _, _, chunks = await post(url + "/v1/chat/completions", plain)
            assert not any("usage" in c for c in chunks)
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/tokenize", json=dict(chat, stream=False)) as r:
                    assert (await r.json())["count"] == 11
                async with s.get(url + "/v1/models") as r:
                    assert (await r.json())["data"][0]["max_model_len"] == 8192
                async with s.get(url + "/metrics") as r:
                    assert 'warply_sim_requests_total{status="200",worker="sim0"} 7.0' in (
                        await r.text()
                    )

    _run(scenario())


def test_bad_requests_are_openai_errors(tokenizer_dir: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fleet(tokenizer_dir, tmp_path, max_model_len=40) as workers, client() as post:
            url = workers[0]["url"] + "/v1/completions"
            cases = [
                (b"{not json", None, 400, "invalid_json"),
                (None, {"model": "other", "prompt": "the"}, 404, "model_not_found"),
                (None, {"model": "m", "prompt": "the", "n": 2}, 400, "invalid_value"),
                (None, {"model": "m", "prompt": "the", "max_tokens": 0}, 400, "invalid_value"),
                (None, {"model": "m", "prompt": [1, -3]}, 400, "invalid_prompt"),
                (None, {"model": "m", "prompt": ["the", "a"]}, 400, "invalid_prompt"),
                (None, {"model": "m", "prompt": _text(39)}, 400, "context_length_exceeded"),
            ]
            for raw, body, status, code in cases:
                got, answer, _ = await post(url, body, raw)
                assert (got, answer["error"]["code"]) == (status, code), (body, answer)
                assert set(answer["error"]) == {"message", "type", "param", "code"}
            # a chat template that renders nothing: refused as vLLM refuses it, and the
            # simulated engine (which would stall on a prompt of no tokens) serves on
            empty = {"messages": [{"role": "user", "content": "the"}], "chat_template": ""}
            got, answer, _ = await post(workers[0]["url"] + "/v1/chat/completions", empty)
            assert (got, answer["error"]["message"]) == (400, "The decoder prompt cannot be empty")
            for model in (None, ""):  # no model (or an empty name) is the base model, as in vLLM
                got, answer, _ = await post(url, {"model": model, "prompt": "the"})
                assert got == 200 and answer["usage"]["prompt_tokens"] == 2, answer

    _run(scenario())


def test_a_failed_engine_driver_ends_the_simulator(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A simulator bug in the engine loop stops the process with its error: a worker whose
    driver died would take requests and never answer them."""

    def stalled(self: SimWorker) -> float:
        raise RuntimeError("sim0: simulator stalled")

    monkeypatch.setattr(SimWorker, "_tick", stalled)
    cfg = ServeConfig.model_validate({"model": "m", "tokenizer": tokenizer_dir})

    async def scenario() -> None:
        never = asyncio.get_running_loop().create_future
        with pytest.raises(RuntimeError, match="stalled"):
            await serve(cfg, never)

    _run(scenario())


async def _collect(endpoint: str, out: list[Any], stop: asyncio.Event) -> None:
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    decoder = StreamDecoder("test")
    try:
        while not stop.is_set():
            if await sock.poll(20):
                batch = decoder.decode_frames(await sock.recv_multipart())
                if batch is not None:
                    out.extend(batch.events)
    finally:
        sock.close()


async def _until(pred: Callable[[], bool]) -> None:
    while not pred():
        await asyncio.sleep(0.02)


def test_publishes_cache_events_and_load_and_aborts_a_dropped_stream(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with fleet(tokenizer_dir, tmp_path) as workers, client() as post:
            events: list[Any] = []
            done = asyncio.Event()
            reader = asyncio.create_task(_collect(workers[0]["events"], events, done))
            await _until(lambda: any(isinstance(e, LoadSnapshot) for e in events))
            body = {"model": "m", "prompt": _text(13), "max_tokens": 2, "cache_salt": "t"}
            await post(workers[0]["url"] + "/v1/completions", body)
            await _until(lambda: any(isinstance(e, BlockStored) for e in events))
            stored = [e for e in events if isinstance(e, BlockStored)]
            tokens = [1, *(3 + WORDS.index(w) for w in _text(13).split())]
            assert [h for e in stored for h in e.block_hashes] == chain_keys(
                tokens, BS, root_seed("m", "t")
            )
            assert stored[0].namespace == "t" and stored[0].token_ids == tokens[:12]
            # a client that goes away mid-stream: the engine drops its request
            long = {"model": "m", "prompt": _text(5), "max_tokens": 900, "stream": True}
            async with aiohttp.ClientSession() as s:
                async with s.post(workers[0]["url"] + "/v1/completions", json=long) as r:
                    await r.content.readuntil(b"\n\n")
                    r.close()  # drops the connection mid-stream
            events.clear()
            await _until(lambda: any(isinstance(e, LoadSnapshot) for e in events))
            await _until(lambda: events[-1].running == 0 and events[-1].waiting == 0)
            done.set()
            await reader

    _run(scenario())


def test_the_routers_index_follows_simulated_workers(tokenizer_dir: Path, tmp_path: Path) -> None:
    """The router over two simulated workers: a conversation's later turns stick to one
    worker, and the index's predicted hit equals the simulated engine's reported one."""

    async def scenario() -> None:
        async with fleet(tokenizer_dir, tmp_path, workers=2) as workers:
            config = RouterConfig.model_validate(
                {
                    "model": "m",
                    "tokenizer": tokenizer_dir,
                    "strategy": {"name": "prefix_affinity"},
                    "pools": [{"name": "sim", "block_size": BS, "workers": workers}],
                }
            )
            router = Router(config, RouterTokenizer(tokenizer_dir))
            runner = web.AppRunner(router.app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
            try:
                turns = []
                for conv in range(2):
                    messages = [{"role": "system", "content": _text(10, conv)}]
                    for turn in range(3):
                        messages.append({"role": "user", "content": _text(6, turn)})
                        body = {
                            "model": "m",
                            "messages": messages,
                            "max_tokens": 3,
                            "stream": True,
                            "stream_options": {"include_usage": True},
                        }
                        async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
                            text = await r.text()
                            worker = r.headers["X-Warply-Worker"]
                            predicted = int(r.headers["X-Warply-Predicted-Cached"])
                        chunks = [json.loads(e[6:]) for e in text.split("\n\n") if "usage" in e]
                        turns.append((conv, worker, predicted, _cached(chunks[-1])))
                        messages.append({"role": "assistant", "content": _text(3, 5)})
                        await asyncio.sleep(0.2)  # the events reach the router
                for conv in range(2):
                    mine = [t for t in turns if t[0] == conv]
                    assert len({w for _, w, _, _ in mine}) == 1, turns
                    assert all(p == c > 0 for _, _, p, c in mine[1:]), turns
                assert turns[0][3] == 0
            finally:
                await runner.cleanup()

    _run(scenario())


def test_cli_help_and_bad_options(tokenizer_dir: Path) -> None:
    run = [sys.executable, "-m", "replay.serve"]
    out = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "simulator" in out.stdout and "--time-scale" in out.stdout
    bad = subprocess.run(
        [*run, "--model", "m", "--tokenizer", str(tokenizer_dir), "--time-scale", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--time-scale" in bad.stderr and "Traceback" not in bad.stderr
    missing = subprocess.run(
        [*run, "--model", "m", "--tokenizer", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "tokenizer.json" in missing.stderr


def test_engine_abort_frees_a_request_and_its_counters() -> None:
    eng = SimEngine("e", lambda i, a, b: list(range(a, b)), EngineConfig(block_size=BS))
    tokens = list(range(40))
    keys = chain_keys(tokens, BS, root_seed("m"))
    running, waiting = (SimRequest(i, 0.0, 40, 100, keys) for i in range(2))
    eng.enqueue(running)
    eng.advance(1.0)
    eng.enqueue(waiting)
    assert eng.running == [running] and eng.waiting == [waiting]
    for req in (running, waiting):
        eng.abort(req)
    assert not eng.has_work() and eng.used_blocks == 0
    assert (eng.pending_prefill, eng.live_prompt, eng.live_generated) == (0, 0, 0)
    assert eng.cached_prefix(keys, len(keys)) == len(keys)  # the prefix stays cached
    assert not eng.stats.finished
