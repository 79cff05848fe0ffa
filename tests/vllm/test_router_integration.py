"""`warply-router` in front of two real vLLM CPU engines (stock --kv-events-config streams).

Checks on the engines' own numbers (usage.prompt_tokens_details.cached_tokens): conversations
stick to the worker holding their prefix and their later turns hit; tenants' cache keys never
share KV; streaming, errors and auth behave; the router tokenizes exactly like vLLM's /tokenize;
a prediction the engine fell short of leaves the index holding what the engine stored again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.tokenize import RouterTokenizer
from warply.launch import RouterServer, free_port, http_json, kv_event_engines

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
VLLM_BIN = Path(sys.executable).parent / "vllm"


@pytest.fixture(scope="module")
def model_dir() -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tiny_model.py"), "--size", "tiny"],
        check=True, stdout=subprocess.PIPE, text=True,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def stack(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two engines (cores 0 and 1, with /reset_prefix_cache and the Responses API's store) and
    the router as a subprocess; all stopped by PID."""
    logs = tmp_path_factory.mktemp("router-it")
    pairs = kv_event_engines(
        VLLM_BIN, model_dir, logs,
        args=["--block-size", str(BLOCK), "--max-model-len", "2048", "--max-num-seqs", "4",
              "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0"],
        env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_RESPONSES_API_STORE": "1"},
    )  # fmt: skip
    engines = [engine for engine, _ in pairs]
    workers = [events.worker(f"w{i}", engine.url) for i, (engine, events) in enumerate(pairs)]
    port = free_port()
    config = {
        "model": "tiny",
        "tokenizer": model_dir,
        "port": port,
        "auth_token": TOKEN,
        "strategy": {"name": "prefix_affinity"},
        "pools": [{"name": "cpu", "block_size": BLOCK, "kv_bytes_per_token": 512,
                   "workers": workers}],
    }
    router = RouterServer(config, logs)
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_healthy()
        router.start()
        router.wait_healthy(60)
        yield {"router": router, "engines": engines, "url": router.url, "model": model_dir}
    finally:
        router.stop()
        for e in engines:
            e.stop()


def _post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    """POST JSON; returns (status, parsed body, response headers)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers


def _cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def _chat(url: str, messages: list[dict[str, str]], **extra: Any) -> tuple[dict[str, Any], str]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0, **extra}
    status, out, headers = _post(url + "/v1/chat/completions", body)
    assert status == 200, out
    return out, headers["X-Warply-Worker"]


def _conversation(url: str, n: int, results: dict[int, list[tuple[str, int, int]]]) -> None:
    """Three turns of conversation `n`; records (worker, prompt tokens, cached tokens) per turn."""
    system = f"Conversation {n}: you answer questions about cache block {n * 7} in depth. " * 6
    messages = [{"role": "system", "content": system}]
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn} about prefix {n}?"})
        out, worker = _chat(url, messages)
        results[n].append((worker, out["usage"]["prompt_tokens"], _cached(out)))
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        time.sleep(0.5)  # the engine's KV events reach the router


def test_conversations_stick_to_their_prefix(stack: dict[str, Any]) -> None:
    results: dict[int, list[tuple[str, int, int]]] = {n: [] for n in range(4)}
    threads = [
        threading.Thread(target=_conversation, args=(stack["url"], n, results)) for n in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for n, turns in results.items():
        assert len(turns) == 3, results
        first = turns[0][0]
        assert all(w == first for w, _, _ in turns), f"conversation {n} moved: {turns}"
        for (_, prev_prompt, _), (_, _, cached) in zip(turns, turns[1:], strict=False):
            assert cached >= (prev_prompt // BLOCK) * BLOCK - BLOCK, f"conversation {n}: {turns}"
    assert {turns[0][0] for turns in results.values()} == {"w0", "w1"}, results
    stats = _stats(stack["url"])
    assert stats["hit_rate"]["engine"] > 0.3 and stats["index"]["entries"] > 0
    assert stats["index"]["bytes_by_tier"]["gpu"] == stats["index"]["entries"] * BLOCK * 512


def _stats(url: str) -> dict[str, Any]:
    req = urllib.request.Request(url + "/warply/cache_stats", headers=ADMIN)
    with urllib.request.urlopen(req, timeout=10) as r:
        return dict(json.loads(r.read()))


def _lines(seed: int, n: int) -> str:
    words = "engines keep prefix blocks while the router reads their event streams".split()
    return "".join(
        f"{seed}.{i} " + " ".join(words[(seed + i * j) % len(words)] for j in range(9)) + ".\n"
        for i in range(n)
    )


def test_a_new_long_prompt_is_placed_early_and_its_next_turn_sticks(
    stack: dict[str, Any],
) -> None:
    """A never-seen prompt of two text chunks is placed from its first: the metrics still get
    its exact length (the engine's own count), and the extended prompt goes to the same worker
    and hits there."""
    url = stack["url"]
    first = _lines(11, 24)  # ~1.5k characters: two chunks of the router's tokenizer cache
    body = {"model": "tiny", "prompt": first, "max_tokens": 4, "temperature": 0}
    before = _stats(url)
    status, out, headers = _post(url + "/v1/completions", body)
    assert status == 200, out
    after = _stats(url)
    assert after["placed_early"] == before["placed_early"] + 1
    assert after["prompt_tokens"] - before["prompt_tokens"] == out["usage"]["prompt_tokens"]
    time.sleep(0.5)  # the engine's KV events reach the router
    longer = dict(body, prompt=first + _lines(12, 20))
    status, again, headers2 = _post(url + "/v1/completions", longer)
    assert status == 200, again
    assert headers2["X-Warply-Worker"] == headers["X-Warply-Worker"]
    held = out["usage"]["prompt_tokens"] // BLOCK * BLOCK
    assert _cached(again) >= held - BLOCK, (_cached(again), held)
    assert int(headers2["X-Warply-Predicted-Cached"]) == _cached(again)


def test_streaming_through_the_router(stack: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "Stream a short answer about caches."}]
    for include in (False, True):
        body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 8,
                                "temperature": 0, "stream": True}
        if include:
            body["stream_options"] = {"include_usage": True}
        req = urllib.request.Request(
            stack["url"] + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = [e for e in r.read().decode().split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        text = "".join(d.get("content") or "" for d in deltas)
        assert text
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert bool(usage) == include
        if include:
            assert "cached_tokens" in usage[-1]["prompt_tokens_details"]


def test_tenants_never_share_kv(stack: dict[str, Any]) -> None:
    url = stack["url"]
    assert _post(url + "/warply/workers/w1", {"enabled": False}, ADMIN)[0] == 200
    try:  # one worker: tenants share an engine, so only the salt can keep them apart
        prompt = "Tenant data: the quarterly cache report lists block counts. " * 12
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        seen = []
        for key in ("tenant-a", "tenant-a", "tenant-b", "tenant-b", None):
            req = dict(body, warply={"cache_key": key}) if key else dict(body)
            status, out, headers = _post(url + "/v1/completions", req)
            assert status == 200, out
            seen.append((key, _cached(out), int(headers["X-Warply-Predicted-Cached"])))
            time.sleep(0.5)
        (_, a1, _), (_, a2, pa2), (_, b1, pb1), (_, b2, _), (_, plain, pplain) = seen
        assert a1 == 0 and a2 > 0 and pa2 == a2, seen  # A reuses its own prefix
        assert b1 == 0 and pb1 == 0, seen  # B never hits A's prefix (engine and index agree)
        assert b2 > 0, seen  # ... but does reuse its own
        assert plain == 0 and pplain == 0, seen  # unsalted requests see neither
    finally:
        _post(url + "/warply/workers/w1", {"enabled": True}, ADMIN)


def test_errors_are_openai_shaped(stack: dict[str, Any]) -> None:
    url = stack["url"]
    status, body, _ = _post(url + "/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body, _ = _post(url + "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    long = {"model": "tiny", "prompt": "word " * 3000, "max_tokens": 4}
    status, body, _ = _post(url + "/v1/completions", long)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    # Token ids outside the vocabulary: the router refuses what vLLM refuses (past the end in
    # vLLM's words; vLLM's request model refuses a negative id before that check) and passes
    # the largest id (tiny: 8192 ids).
    engine = stack["engines"][0].url
    for bad in (-1, 8192):
        req = {"model": "tiny", "prompt": [5, bad], "max_tokens": 1}
        direct_status, direct, _ = _post(engine + "/v1/completions", req)
        status, body, _ = _post(url + "/v1/completions", req)
        words = f"Token id {bad} is out of vocabulary"
        assert direct_status == 400 and (bad < 0 or words in direct["error"]["message"]), direct
        assert status == 400 and body["error"]["code"] == "invalid_prompt", body
        assert words in body["error"]["message"]
    req = {"model": "tiny", "prompt": [5, 8191], "max_tokens": 1}
    assert _post(url + "/v1/completions", req)[0] == 200


def test_the_router_takes_the_model_names_and_templates_vllm_takes(stack: dict[str, Any]) -> None:
    """No `model` (or an empty one) is the base model, in vLLM 0.32 and through the router; a
    request's own chat template is refused by both (neither was told to trust one)."""
    engine = stack["engines"][0].url
    for model in (None, ""):
        req = {"model": model, "prompt": "the cache", "max_tokens": 1}
        assert _post(engine + "/v1/completions", req)[0] == 200
        assert _post(stack["url"] + "/v1/completions", req)[0] == 200
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template": "{{ messages[0].content }}"}  # fmt: skip
    direct_status, direct, _ = _post(engine + "/v1/chat/completions", chat)
    assert direct_status == 400 and "--trust-request-chat-template" in direct["error"]["message"]
    status, routed, _ = _post(stack["url"] + "/v1/chat/completions", chat)
    assert status == 400 and routed["error"]["code"] == "untrusted_chat_template", routed


def test_a_chat_with_an_image_is_the_engines_to_judge(stack: dict[str, Any]) -> None:
    """The router sends a chat with an image part on as it came (placed by load: it cannot
    know the engine's hashes of media); what the engine answers it directly, it answers
    through the router (the router answered 400 itself before). The tiny model is text-only."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    parts = [{"type": "text", "text": "What is in the picture?"}, image]
    body = {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 4}
    engine = stack["engines"][0].url
    direct_status, direct, _ = _post(engine + "/v1/chat/completions", body)
    status, routed, headers = _post(stack["url"] + "/v1/chat/completions", body)
    assert status == direct_status, (direct, routed)
    assert headers["X-Warply-Predicted-Cached"] == "0"
    if status != 200:
        assert routed["error"]["message"] == direct["error"]["message"]


def test_admin_token_enforced(stack: dict[str, Any]) -> None:
    url = stack["url"]
    assert http_json("GET", url + "/warply/cache_stats")[0] == 401
    assert http_json("GET", url + "/warply/workers")[0] == 401
    req = urllib.request.Request(url + "/warply/workers", headers=ADMIN)
    with urllib.request.urlopen(req, timeout=10) as r:
        workers = json.loads(r.read())["workers"]
    assert {w["name"] for w in workers} == {"w0", "w1"}
    assert all(w["stream"]["last_seq"] is not None for w in workers)
    assert http_json("GET", url + "/v1/models")[0] == 200


CHATS = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Why cache?\n"}],
    [{"role": "user", "content": "Unicode: naïve café — 東京 🚀"},
     {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "More <|eot_id|>"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                  {"type": "text", "text": "part two"}]}],
]
PROMPTS = ["plain text prompt", "  leading spaces\nand\ttabs", "<|begin_of_text|>explicit bos", ""]


def test_tokenization_parity_with_vllm(stack: dict[str, Any]) -> None:
    tok = RouterTokenizer(Path(stack["model"]))
    engine = stack["engines"][0].url
    for messages in CHATS:
        for gen in (True, False):
            body = {"model": "tiny", "messages": messages, "add_generation_prompt": gen}
            status, want = http_json("POST", engine + "/tokenize", body)
            assert status == 200, want
            assert tok.chat_tokens(body) == want["tokens"], messages
    for prompt in PROMPTS:
        for special in (True, False):
            body = {"model": "tiny", "prompt": prompt, "add_special_tokens": special}
            status, want = http_json("POST", engine + "/tokenize", body)
            assert status == 200, want
            assert tok.completion_tokens(body) == [want["tokens"]], prompt


def test_tokenize_and_detokenize_through_the_router_are_the_engines(
    stack: dict[str, Any],
) -> None:
    """vLLM 0.32's /tokenize and /detokenize answer through the router as they do directly,
    errors included; a model the router does not serve is its own 404."""
    engine, url = stack["engines"][0].url, stack["url"]
    bodies = [
        ("/tokenize", {"model": "tiny", "prompt": PROMPTS[1], "return_token_strs": True}),
        ("/tokenize", {"messages": CHATS[0], "add_generation_prompt": True}),
        ("/detokenize", {"model": "tiny", "tokens": [1, 2, 3]}),
        ("/detokenize", {"tokens": [-1]}),
    ]
    for path, body in bodies:
        direct_status, direct = http_json("POST", engine + path, body)
        status, routed = http_json("POST", url + path, body)
        assert (status, routed) == (direct_status, direct), (path, body)
    assert direct_status == 400  # the negative id, refused by the engine
    status, body = http_json("POST", url + "/tokenize", {"model": "other", "prompt": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def _respond(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str, int]:
    """A response through the router: (its body, the worker, the predicted cached tokens)."""
    body = {"model": "tiny", "max_output_tokens": 16, "temperature": 0, **body}
    status, out, headers = _post(url + "/v1/responses", body)
    assert status == 200, out
    return out, headers["X-Warply-Worker"], int(headers["X-Warply-Predicted-Cached"])


def _said(out: dict[str, Any]) -> str:
    """A response's output text."""
    return "".join(
        part["text"] for item in out["output"] if item["type"] == "message"
        for part in item["content"] if part["type"] == "output_text"
    )  # fmt: skip


def test_a_responses_conversation_is_keyed_as_the_engine_renders_it(
    stack: dict[str, Any],
) -> None:
    """vLLM 0.32 renders a Responses input through the chat template: the router keys a text
    input by the same tokens (its /warply/where length is the engine's `input_tokens`), so a
    conversation that sends its whole history each turn (`store` off) stays on its worker
    and hits what the router predicted. A chain through `previous_response_id` (the engine's
    store on) and the stored response's retrieval reach the worker that holds it."""
    url = stack["url"]
    instructions = "You answer questions about the prefix cache in depth. " * 8
    items: list[dict[str, Any]] = [{"role": "user", "content": "Which blocks does it keep?"}]
    workers = []
    for turn in range(3):
        body = {"instructions": instructions, "input": items, "store": False}
        status, where, _ = _post(url + "/warply/where", {"model": "tiny", **body}, ADMIN)
        assert status == 200, where
        out, worker, predicted = _respond(url, body)
        usage = out["usage"]
        assert where["prompt_tokens"] == usage["input_tokens"], (turn, where, usage)
        if turn:
            assert predicted == usage["input_tokens_details"]["cached_tokens"] >= 4 * BLOCK
        workers.append(worker)
        text = {"type": "output_text", "text": _said(out)}
        items += [
            {"type": "message", "role": "assistant", "content": [text]},
            {"role": "user", "content": [{"type": "input_text", "text": f"And {turn}?"}]},
        ]
        time.sleep(0.5)  # the engine's KV events reach the router
    assert len(set(workers)) == 1, workers

    first, owner, _ = _respond(url, {"input": "Name one block.", "store": True})
    for _ in range(3):
        follow = {"input": "Another one?", "previous_response_id": first["id"], "store": True}
        out, worker, _ = _respond(url, follow)
        assert worker == owner and out["previous_response_id"] == first["id"]
    status, got = http_json("GET", url + f"/v1/responses/{first['id']}")
    assert status == 200 and got["id"] == first["id"] and _said(got) == _said(first)
    other = next(e for i, e in enumerate(stack["engines"]) if f"w{i}" != owner)
    status, _ = http_json("GET", other.url + f"/v1/responses/{first['id']}")
    assert status == 404  # only its worker holds it: the router's routing is what finds it


def test_the_openai_sdk_streams_a_response_through_the_router(stack: dict[str, Any]) -> None:
    """The OpenAI SDK (as vLLM 0.32 pins it) reads a streamed response relayed by the router
    event by event, and retrieves the stored response by its id; the router counts the
    stream's usage (its last event) in cache_stats."""
    import openai  # vLLM's own dependency: in the engine's venv

    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused")
    before = _stats(stack["url"])["requests"]
    events = list(client.responses.create(
        model="tiny", input="Stream three words about caches.", max_output_tokens=12,
        temperature=0, stream=True, store=True,
    ))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "response.output_text.delta" in kinds
    done = events[-1].response
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == done.output_text and done.usage is not None
    assert client.responses.retrieve(done.id).output_text == done.output_text
    assert _stats(stack["url"])["requests"] == before + 1


def test_a_messages_conversation_is_keyed_as_the_engine_renders_it(
    stack: dict[str, Any],
) -> None:
    """vLLM 0.32 converts an Anthropic Messages body to a chat and renders it: the router keys
    it by the same tokens (its /warply/where length is the engine's input and cached tokens),
    so a conversation stays on its worker and hits what the router predicted."""
    url = stack["url"]
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=01"},
              {"type": "text", "text": "You answer questions about the prefix cache. " * 20}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Which blocks does it keep?"}]
    workers = []
    for turn in range(3):
        body = {"model": "tiny", "system": system, "messages": messages, "max_tokens": 16,
                "temperature": 0}  # fmt: skip
        status, where, _ = _post(url + "/warply/where?api=messages", body, ADMIN)
        assert status == 200, where
        status, out, headers = _post(url + "/v1/messages", body)
        assert status == 200, out
        usage = out["usage"]  # input tokens apart from those read from and written to cache
        cached = usage.get("cache_read_input_tokens", 0)
        total = usage["input_tokens"] + cached + usage.get("cache_creation_input_tokens", 0)
        assert where["prompt_tokens"] == total, (turn, where, usage)
        if turn:
            assert int(headers["X-Warply-Predicted-Cached"]) == cached >= 4 * BLOCK
        workers.append(headers["X-Warply-Worker"])
        said = "".join(b["text"] for b in out["content"] if b["type"] == "text")
        messages += [{"role": "assistant", "content": [{"type": "text", "text": said}]},
                     {"role": "user", "content": f"And {turn}?"}]  # fmt: skip
        time.sleep(0.5)  # the engine's KV events reach the router
    assert len(set(workers)) == 1, workers


def test_the_anthropic_sdk_streams_a_message_through_the_router(stack: dict[str, Any]) -> None:
    """The Anthropic SDK (as vLLM 0.32 pins it) reads a streamed message relayed by the router
    and the router's own errors in Anthropic's shape; the router counts the stream's usage."""
    import anthropic  # vLLM's own dependency: in the engine's venv

    client = anthropic.Anthropic(base_url=stack["url"], api_key="unused")
    before = _stats(stack["url"])["requests"]
    with client.messages.stream(
        model="tiny", max_tokens=12,
        messages=[{"role": "user", "content": "Stream three words about caches."}],
    ) as stream:  # fmt: skip
        text = "".join(stream.text_stream)
        done = stream.get_final_message()
    assert text and done.content[0].text == text and done.usage.output_tokens > 0
    assert _stats(stack["url"])["requests"] == before + 1
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="nope", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert err.value.body["error"]["type"] == "not_found_error"


def test_a_missed_prediction_keeps_what_the_engine_stored_again(stack: dict[str, Any]) -> None:
    """An engine's cache emptied behind the router's back (vLLM 0.32 publishes AllBlocksCleared
    only at its next scheduler step, so the index still credits it) reports no hit for a prompt
    the router placed there for its prefix. The engine computes the prompt and caches its
    blocks again under the same hashes; the index must still hold them afterwards, so the
    next identical prompt is predicted exactly what the engine then reports."""
    url = stack["url"]
    body = {"model": "tiny", "prompt": "The cache loses this prompt and finds it again. " * 12,
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    status, out, headers = _post(url + "/v1/completions", body)
    assert status == 200, out
    worker = headers["X-Warply-Worker"]
    engine = stack["engines"][int(worker[1:])]
    time.sleep(0.5)  # its BlockStored events reach the router
    status, reply = http_json("POST", engine.url + "/reset_prefix_cache")
    assert status == 200, reply
    status, out, headers = _post(url + "/v1/completions", body)
    assert status == 200, out
    predicted = int(headers["X-Warply-Predicted-Cached"])
    assert headers["X-Warply-Worker"] == worker and predicted >= 4 * BLOCK
    assert _cached(out) == 0  # the index credited blocks the reset had dropped
    time.sleep(0.5)  # AllBlocksCleared, then the recomputed blocks' BlockStored, reach it
    status, where, _ = _post(url + "/warply/where", body, ADMIN)
    assert status == 200, where
    held = {w["name"]: w["cached_tokens"] for pool in where["pools"] for w in pool["workers"]}
    status, out, _ = _post(engine.url + "/v1/completions", body)
    assert status == 200, out
    assert held[worker] == _cached(out) == predicted
