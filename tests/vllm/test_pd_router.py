"""`warply-router` driving a P/D hand-off between two real vLLM CPU engines.

One prefill engine (WarplyConnector wrapping NixlConnector, kv_producer) and one decode engine
(the same, kv_consumer, `kv_load_failure_policy: recompute`), both exporting their cache state
to the router, which binds the SUB sockets on 127.0.0.1. One engine pair serves the whole
module; the last test kills the prefill engine.

Checks, on the engines' own numbers (usage, /metrics counters) rather than timings (NIXL's CPU
path spins a core: times are noise on 2 cores):
  * greedy outputs through the hand-off equal the decode engine's own, computed without one
    (another cache salt, no kv_transfer_params: plain aggregated vLLM), JSON and streamed;
  * a conversation's second turn is a prefix hit on the prefill engine (its usage, its
    PrefixHit events) and the decode engine pulls fewer NIXL bytes than for the first turn;
  * a short follow-up is prefilled on the decode engine (below `pd.local_prefill_tokens`):
    nothing reaches the prefill engine, nothing crosses NIXL;
  * with `pd.prefill_answers` (a second router), a request is answered whole by the prefill
    engine while the decode engine is busy, with the same greedy output;
  * a prefill engine that stops answering with a prefill in flight, or dies with KV not yet
    pulled: every request ends well within its bound with the reference answer (the decode
    engine prefills locally).

Skips when `nixl` is not importable. ~2.5 min on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HOST, engine, free_port

from router.tokenize import RouterTokenizer
from warply.launch import RouterServer, VllmServer

try:
    import nixl  # noqa: F401

    _NIXL_ERROR = ""
except Exception as exc:  # ImportError, or a broken native library
    _NIXL_ERROR = f"{type(exc).__name__}: {exc}"

pytestmark = [
    pytest.mark.skipif(bool(_NIXL_ERROR), reason=f"`import nixl` fails: {_NIXL_ERROR}"),
    pytest.mark.timeout(420),
]

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
THRESHOLD = 128
"""`pd.local_prefill_tokens` here: a follow-up missing fewer tokens on decode stays local."""
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
REQUEST_TIMEOUT_S = 120


def _connector(role: str, events: str, replay: str, worker: str) -> dict[str, Any]:
    return {
        "kv_connector": "WarplyConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "delegate": {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"},
            "warply": {"events_endpoint": events, "replay_endpoint": replay, "worker": worker},
        },
    }


@pytest.fixture(scope="module")
def pd(tiny_model: str, server_logs: Path) -> Iterator[dict[str, Any]]:
    """Prefill and decode engines (each confined to its core, 0 and 1: see `engine`) and the
    router as a subprocess."""
    engines: dict[str, VllmServer] = {}
    workers = {}
    for i, (name, role) in enumerate((("p", "kv_producer"), ("d", "kv_consumer"))):
        events = f"tcp://{HOST}:{free_port()}"  # the router binds it; the engine connects
        replay = f"tcp://{HOST}:{free_port()}"
        engines[name] = engine(
            tiny_model, server_logs / f"pd-{name}.log", block_size=BLOCK,
            kv_transfer=_connector(role, events, replay, name),
            core=i, env={"VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
                         "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        )  # fmt: skip
        workers[name] = {"name": name, "url": engines[name].url, "events": events,
                         "replay": replay, "bind": True}  # fmt: skip
    port = free_port()
    config = {
        "model": "tiny",
        "tokenizer": tiny_model,
        "port": port,
        "health_interval_s": 0.5,
        # a probe may take seconds on a loaded 2-core machine; 2 slow ones in a row would take
        # a live engine out of placement (a 503 with the only decode worker gone)
        "health_timeout_s": 5,
        "request_timeout_s": REQUEST_TIMEOUT_S,
        # a prefill engine whose decode peer is paused has answered only when the KV's lease
        # (30 s in vLLM 0.32's NixlConnector) ran out: the prefill leg must outlast it
        "pd": {"local_prefill_tokens": THRESHOLD, "local_prefill_by": "threshold",
               "prefill_timeout_s": 60, "lost_after_s": 5},
        "pools": [
            {"name": "prefill", "role": "prefill", "block_size": BLOCK, "workers": [workers["p"]]},
            {"name": "decode", "role": "decode", "block_size": BLOCK, "workers": [workers["d"]]},
        ],
    }
    router = RouterServer(config, server_logs, name="pd-router", env={"PYTHONPATH": str(ROOT)})
    try:
        router.start()  # first: its SUB sockets are bound before the engines connect
        for e in engines.values():
            e.start()
        for e in engines.values():
            e.wait_healthy(240)
        router.wait_healthy(300)  # counted from the router's own start, before the engines
        _wait(lambda: _get(router.url + "/health")[1].get("healthy_workers") == 2, 20)
        yield {"router": router, "url": router.url, "p": engines["p"], "d": engines["d"],
               "tok": RouterTokenizer(Path(tiny_model))}  # fmt: skip
    finally:
        router.stop()
        for e in engines.values():
            e.stop()


def _wait(pred: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.2)


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _post(
    url: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S
) -> tuple[int, Any, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status, headers = r.status, r.headers
    except urllib.error.HTTPError as err:
        raw, status, headers = err.read(), err.code, err.headers
    if headers.get("Content-Type", "").startswith("text/event-stream"):
        return status, raw.decode(), headers
    return status, json.loads(raw), headers


def _chat(url: str, messages: list[dict[str, str]], **extra: Any) -> tuple[dict[str, Any], Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0, **extra}
    status, out, headers = _post(url + "/v1/chat/completions", body)
    assert status == 200, out
    return out, headers


def _reference(server: VllmServer, messages: list[dict[str, str]], max_tokens: int = 16) -> str:
    """The decode engine's own answer: no hand-off, another cache salt (plain vLLM)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "cache_salt": "reference"}  # fmt: skip
    status, out, _ = _post(server.url + "/v1/chat/completions", body)
    assert status == 200, out
    return str(out["choices"][0]["message"]["content"])


def _text(n: int, words: int) -> str:
    vocab = "cache block prefix token model request memory page value answer data time".split()
    return " ".join(f"{vocab[(n * 7 + i * 3) % len(vocab)]}{(n + i) % 97}" for i in range(words))


def _nixl_bytes(server: VllmServer, before: float) -> float:
    """The decode engine's NIXL byte counter once it moved past `before` (stats are published
    from the engine's 1 s stats loop), or its value after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        value = server.metric(NIXL_BYTES)
        if value != before or time.monotonic() > deadline:
            return value
        time.sleep(0.3)


def _stats(url: str) -> dict[str, Any]:
    return dict(_get(url + "/warply/cache_stats")[1])


def test_greedy_outputs_equal_an_aggregated_engines(pd: dict[str, Any]) -> None:
    url, decode = pd["url"], pd["d"]
    for n in range(3):
        messages = [{"role": "system", "content": _text(100 + n, 120)},
                    {"role": "user", "content": f"Question {n}: {_text(n, 30)}?"}]  # fmt: skip
        out, headers = _chat(url, messages)
        assert headers["X-Warply-Mode"] == "remote", dict(headers)
        assert headers["X-Warply-Prefill-Worker"] == "p" and headers["X-Warply-Worker"] == "d"
        want = _reference(decode, messages)
        assert out["choices"][0]["message"]["content"] == want
    messages = [{"role": "user", "content": f"Stream this: {_text(7, 150)}"}]
    status, text, headers = _post(
        url + "/v1/chat/completions",
        {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0,
         "stream": True, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert status == 200 and headers["X-Warply-Mode"] == "remote", (status, text[:500])
    chunks = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])  # fmt: skip
    assert streamed == _reference(decode, messages)
    assert text.rstrip().endswith("data: [DONE]") and chunks[-1]["usage"]["prompt_tokens"] > 0


def test_second_turn_hits_prefill_and_moves_fewer_bytes(pd: dict[str, Any]) -> None:
    url, prefill, decode, tok = pd["url"], pd["p"], pd["d"], pd["tok"]
    messages = [{"role": "system", "content": _text(1, 400)},
                {"role": "user", "content": "What does the cache hold?"}]  # fmt: skip
    before = _stats(url)["workers"]
    before_hits = before["p"]["engine_prefix_hits"]
    bytes0 = decode.metric(NIXL_BYTES)
    out1, h1 = _chat(url, messages)
    bytes1 = _nixl_bytes(decode, bytes0)
    assert h1["X-Warply-Mode"] == "remote"
    messages += [{"role": "assistant", "content": out1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": f"And then? {_text(2, 120)}"}]  # fmt: skip
    time.sleep(1)  # both engines' KV events reach the router
    prefill_hits0 = prefill.metric("vllm:prefix_cache_hits_total")
    out2, h2 = _chat(url, messages)
    bytes2 = _nixl_bytes(decode, bytes1)
    assert h2["X-Warply-Mode"] == "remote", "the new part is over the threshold"
    first, second = bytes1 - bytes0, bytes2 - bytes1
    print(f"\nNIXL bytes pulled by decode: turn 1 {first:.0f}, turn 2 {second:.0f}; "
          f"prompt tokens {out1['usage']['prompt_tokens']} / {out2['usage']['prompt_tokens']}")
    assert first > 0 and 0 < second < first
    # engine-reported prefix hit on the prefill worker: its usage (what the client is told)...
    prompt1 = len(tok.chat_tokens({"messages": messages[:2], "add_generation_prompt": True}))
    cached = out2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (prompt1 // BLOCK - 1) * BLOCK, (cached, prompt1)
    assert prefill.metric("vllm:prefix_cache_hits_total") - prefill_hits0 >= cached
    assert int(h2["X-Warply-Predicted-Cached"]) == cached
    # ...its PrefixHit on the state stream, and the decode side's reuse in the router's stats
    _wait(lambda: _stats(url)["workers"]["p"]["engine_prefix_hits"] > before_hits, 10)
    held = (prompt1 // BLOCK - 1) * BLOCK
    _wait(
        lambda: _stats(url)["workers"]["d"]["engine_prefix_hit_tokens"]
        - before["d"]["engine_prefix_hit_tokens"] >= held,
        10,
    )  # the decode engine reused what it held (its PrefixHit): those blocks did not cross
    stats = _stats(url)
    assert stats["workers"]["d"]["handoff_held_tokens"] >= held
    assert stats["roles"]["prefill"]["engine_cached_tokens"] >= cached
    _wait(lambda: _stats(url)["pd"]["transfers"].get("d", {}).get("bytes", 0) >= bytes2, 10)
    pd["conversation"] = messages + [
        {"role": "assistant", "content": out2["choices"][0]["message"]["content"]}
    ]


def test_short_follow_up_is_prefilled_on_decode(pd: dict[str, Any]) -> None:
    url, prefill, decode = pd["url"], pd["p"], pd["d"]
    messages = pd.get("conversation")
    if messages is None:
        pytest.skip("needs the conversation of the previous test")
    messages = messages + [{"role": "user", "content": "Why?"}]
    time.sleep(1)  # the decode engine's KV events reach the router
    requests0 = prefill.metric("vllm:request_success_total")
    bytes0 = decode.metric(NIXL_BYTES)
    out, headers = _chat(url, messages)
    assert headers["X-Warply-Mode"] == "local:below_threshold", dict(headers)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > THRESHOLD
    assert out["choices"][0]["message"]["content"] == _reference(decode, messages)
    time.sleep(1.5)
    assert prefill.metric("vllm:request_success_total") == requests0, "prefill saw nothing"
    assert decode.metric(NIXL_BYTES) == bytes0, "nothing crossed NIXL"
    decisions = _stats(url)["pd"]["decisions"]
    assert decisions.get("local:below_threshold", 0) >= 1 and decisions["remote"] >= 2


def test_a_request_the_strategy_gives_the_prefill_worker_is_answered_there(
    pd: dict[str, Any], tiny_model: str, server_logs: Path
) -> None:
    """`pd.prefill_answers`, through a second router on the same engines (no cache events:
    neither worker holds anything for it; the prefill worker is a candidate beside the decode
    worker): the first request goes to the decode engine, and while it streams a long answer
    the next request, a new conversation, goes where less work was routed lately: it is
    answered whole by the prefill engine (a kv_producer serving a request without
    kv_transfer_params as plain vLLM), with the aggregated engine's greedy output; nothing
    crosses NIXL."""
    prefill, decode = pd["p"], pd["d"]
    pools = [{"name": name, "role": role, "block_size": BLOCK,
              "workers": [{"name": name[0], "url": pd[name[0]].url}]}
             for name, role in (("prefill", "prefill"), ("decode", "decode"))]  # fmt: skip
    config = {
        "model": "tiny", "tokenizer": tiny_model, "port": free_port(), "health_interval_s": 0.5,
        "health_timeout_s": 5, "request_timeout_s": REQUEST_TIMEOUT_S, "pools": pools,
        "pd": {"local_prefill_tokens": 0, "local_prefill_by": "cost", "prefill_answers": True},
    }  # fmt: skip
    router = RouterServer(config, server_logs, name="pd-router-answers",
                          env={"PYTHONPATH": str(ROOT)})  # fmt: skip
    streamed: dict[str, tuple[int, Any, Any]] = {}
    try:
        router.start().wait_healthy(120)
        url = router.url
        _wait(lambda: _get(url + "/health")[1].get("healthy_workers") == 2, 20)
        long = {"model": "tiny", "messages": [{"role": "user", "content": _text(300, 40)}],
                "max_tokens": 400, "ignore_eos": True, "temperature": 0,
                "stream": True}  # fmt: skip
        thread = threading.Thread(
            target=lambda: streamed.update(s=_post(url + "/v1/chat/completions", long))
        )
        thread.start()
        _wait(lambda: _in_flight(url).get("d", 0) == 1, 30)  # decode is decoding it
        requests0 = prefill.metric("vllm:request_success_total")
        bytes0 = decode.metric(NIXL_BYTES)
        messages = [{"role": "user", "content": f"Answer this: {_text(301, 30)}?"}]
        out, headers = _chat(url, messages)
        assert (headers["X-Warply-Mode"], headers["X-Warply-Worker"]) == ("on_prefill", "p")
        assert out["choices"][0]["message"]["content"] == _reference(decode, messages)
        thread.join(REQUEST_TIMEOUT_S)
        status, _, stream_headers = streamed["s"]
        assert status == 200 and stream_headers["X-Warply-Mode"] == "local:cheaper_local"
        time.sleep(1.5)  # the engines' 1 s stats loop
        assert prefill.metric("vllm:request_success_total") >= requests0 + 1
        assert decode.metric(NIXL_BYTES) == bytes0, "nothing crossed NIXL"
        assert _stats(url)["pd"]["decisions"].get("on_prefill") == 1
    finally:
        router.stop()


def _workers(url: str) -> dict[str, dict[str, Any]]:
    return {w["name"]: w for w in _get(url + "/warply/workers")[1]["workers"]}


def _in_flight(url: str) -> dict[str, int]:
    """Requests the router has booked on each worker (a prefill leg's booking ends when the
    prefill engine answers)."""
    return {name: w["in_flight"] for name, w in _workers(url).items()}


def test_killing_the_prefill_engine_never_hangs(pd: dict[str, Any]) -> None:
    """The prefill engine stops answering (SIGSTOP) with a request inside its prefill; then,
    running again, it dies (SIGKILL) with the KV of another request computed but not yet
    pulled (the decode engine is paused meanwhile, so the pull cannot have happened); then one
    more request. Each ends well within its bound with the reference answer (the decode engine
    prefills locally, or pulled the KV after all)."""
    url, prefill, decode = pd["url"], pd["p"], pd["d"]
    results: dict[int, tuple[int, Any, str, float]] = {}

    def one(n: int) -> None:
        messages = [{"role": "user", "content": f"Crash {n}: {_text(300 + n, 200)}"}]
        t0 = time.monotonic()
        try:
            status, out, headers = _post(
                url + "/v1/chat/completions",
                {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0,
                 "stream": n == 2},
                timeout=REQUEST_TIMEOUT_S,
            )  # fmt: skip
            mode = headers.get("X-Warply-Mode", "")
        except Exception as exc:  # a hang shows up here as a client timeout
            status, out, mode = -1, repr(exc), ""
        results[n] = (status, (out, messages), mode, time.monotonic() - t0)

    def healthy(name: str) -> bool:
        return bool(_workers(url)[name]["healthy"])

    # a prefill in flight on an engine that stopped answering (its probes time out); placed
    # while the router still counts it healthy (a busy machine can fail one probe earlier)
    _wait(lambda: healthy("p") and _workers(url)["p"]["failed_probes"] == 0, 30)
    os.killpg(prefill.pid, signal.SIGSTOP)
    try:
        in_prefill = threading.Thread(target=one, args=(2,))
        in_prefill.start()
        in_prefill.join(REQUEST_TIMEOUT_S + 10)
    finally:
        os.killpg(prefill.pid, signal.SIGCONT)
    _wait(lambda: healthy("p"), 30)
    # KV computed on the prefill engine, which dies before the decode engine pulls it. The
    # router's bookings tell when the prefill leg answered (the decode leg is then on its way).
    # With the decode engine paused, the prefill engine (vLLM 0.32, NIXL on CPU) has stalled,
    # its answers and /metrics included, until the lease of the KV nobody pulled ran out (30 s).
    os.killpg(decode.pid, signal.SIGSTOP)
    try:
        waiting = threading.Thread(target=one, args=(1,))
        waiting.start()
        _wait(lambda: _in_flight(url) == {"p": 0, "d": 1}, 75)
        os.killpg(prefill.pid, signal.SIGKILL)
        _wait(lambda: not healthy("p"), 30)
    finally:
        os.killpg(decode.pid, signal.SIGCONT)
    waiting.join(REQUEST_TIMEOUT_S + 10)
    _wait(lambda: healthy("d"), 30)  # its probe failed while it was paused
    one(3)
    print("\nprefill engine stopped / killed:",
          {n: (s, m, round(t, 1)) for n, (s, _, m, t) in sorted(results.items())})  # fmt: skip
    for n, (status, (out, messages), mode, seconds) in sorted(results.items()):
        assert status == 200, f"request {n}: {status} after {seconds:.0f}s: {out}"
        if n == 2:
            chunks = [json.loads(e[6:]) for e in out.split("\n\n") if e.startswith("data: {")]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                           if c["choices"])  # fmt: skip
        else:
            text = out["choices"][0]["message"]["content"]
        assert text == _reference(decode, messages), (n, mode)
        assert seconds < 60, (n, seconds)
    # Request 1: the router abandons the decode leg once the prefill worker refuses connections
    # (local prefill), unless the decode engine already read the KV: on one host NIXL's UCX
    # can still read a dead process's registered memory, and the answer is the same.
    assert results[1][2] in ("local:prefill_failed", "remote"), results[1][2]
    assert (results[2][2], results[3][2]) == ("local:prefill_failed", "local:no_prefill_worker")
    failures = _stats(url)["pd"]["prefill_failures"]
    lost = 1 if results[1][2] != "remote" else 0
    assert failures.get("worker_down") == 1, failures
    assert failures.get("lost_before_decode", 0) == lost, failures
