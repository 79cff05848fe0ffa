"""Bad client input at the router's HTTP API: every rejection is an OpenAI-shaped 4xx, counted in
`warply_router_errors_total`, never a 500. Known escapes first, then hypothesis over arbitrary
JSON bodies and schemathesis over the router's own /openapi.json (positive and negative cases),
all against a router on 127.0.0.1 in front of in-process fake engines (tests/test_router_api.py).
Example counts are small and derandomized: seconds on 2 cores, the same examples every run
(`WARPLY_FUZZ_EXAMPLES=N` fuzzes N random examples per endpoint and operation instead)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance

from router.app import Router
from router.config import RouterConfig
from router.openapi import openapi_document
from tests.test_router_api import (  # noqa: F401
    FakeEngine,
    _is_error,
    _run,
    running,
    tokenizer_dir,
)

TOKEN = "admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
LIMITS = {"max_body_bytes": 64 << 10, "max_prompt_tokens": 96, "max_messages": 8, "max_prompts": 4}
_DEEP = int(os.environ.get("WARPLY_FUZZ_EXAMPLES", "0"))
"""Examples per fuzzed endpoint (and per OpenAPI operation) for a deeper run, random rather
than derandomized (0: the suite's 60 and 15, the same every run; docs/reliability.md, "Bad
input")."""
FUZZ = settings(
    max_examples=_DEEP or 60,
    derandomize=not _DEEP,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass
class Live:
    """A router served on its own event loop thread; `call` is usable from sync tests."""

    router: Router
    base: str
    loop: asyncio.AbstractEventLoop
    session: aiohttp.ClientSession

    def call(self, method: str, path: str, raw: bytes, **headers: str) -> tuple[int, Any]:
        """`raw` sent as JSON (unless `headers` name another Content-Type)."""

        async def go() -> tuple[int, Any]:
            sent = {"Content-Type": "application/json", **headers}
            async with self.session.request(
                method, self.base + path, data=raw, headers=sent
            ) as r:
                text = await r.text()
                try:
                    return r.status, json.loads(text)
                except ValueError:
                    return r.status, text

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(30)

    def errors(self) -> dict[tuple[str, str], float]:
        """`warply_router_errors_total` by (status, code)."""
        text = self.call("GET", "/metrics", b"")[1]
        return {
            (s.labels["status"], s.labels["code"]): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "warply_router_errors_total"
        }


SGLANG_CARD = b'{"data": [{"id": "m", "max_model_len": 4096, "owned_by": "sglang"}]}'
"""The /v1/models an SGLang 0.5 fleet answers: the router then renders chats, Messages and
Responses bodies as SGLang converts them (router/messages_sglang.py, router/responses_sglang.py)."""


def _serve(tokenizer_dir: Path, card: bytes | None) -> Iterator[Live]:  # noqa: F811
    """A router on its own loop thread over two fake engines answering `card` (None: vLLM's)."""
    loop = asyncio.new_event_loop()
    ready: Future[Live] = Future()
    stop = asyncio.Event()

    async def serve() -> None:
        engines = [FakeEngine(n, max_model_len=4096, models=card) for n in ("a", "b")]
        async with running(
            tokenizer_dir,
            engines,
            auth_token=TOKEN,
            limits=LIMITS,
            lora_adapters=["sql"],
            trust_request_chat_template=True,  # the template error cases below
        ) as (router, _call, session, base):
            ready.set_result(Live(router, base, loop, session))
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield ready.result(30)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


@pytest.fixture(scope="module")
def live(tokenizer_dir: Path) -> Iterator[Live]:  # noqa: F811
    yield from _serve(tokenizer_dir, None)


@pytest.fixture(scope="module")
def live_sglang(tokenizer_dir: Path) -> Iterator[Live]:  # noqa: F811
    yield from _serve(tokenizer_dir, SGLANG_CARD)


def _post(live: Live, path: str, body: Any) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return live.call("POST", path, raw, **{"Content-Type": "application/json"})


ESCAPES = [
    ({"prompt": [1, -1, 2]}, "invalid_prompt"),
    ({"prompt": [1, 10**6]}, "invalid_prompt"),
    ({"prompt": [1, 2**40]}, "invalid_prompt"),
    ({"prompt": [1.5, 2]}, "invalid_prompt"),
    ({"prompt": [True, 2]}, "invalid_prompt"),
    ({"prompt": [[1, 2], [3, -4]]}, "invalid_prompt"),
    ({"prompt": [[1, [2]]]}, "invalid_prompt"),
    ({"prompt": [[]]}, "invalid_prompt"),
    ({"prompt": [["a"]]}, "invalid_prompt"),
    ({"prompt": [None]}, "invalid_prompt"),
    ({"prompt": {"a": 1}}, "invalid_prompt"),
    ({"prompt": "hi", "model": ["m"]}, "invalid_value"),
    ({"prompt": "hi", "model": {"x": 1}}, "invalid_value"),
    ({"prompt": "hi", "stream": "yes"}, "invalid_value"),
    ({"prompt": "hi", "max_tokens": -1}, "invalid_value"),
    ({"prompt": "hi", "max_tokens": "8"}, "invalid_value"),
    ({"prompt": "hi", "n": 1.5}, "invalid_value"),
    ({"prompt": "hi", "stream_options": []}, "invalid_value"),
    ({"prompt": "hi", "warply": []}, "invalid_value"),
    ({"prompt": "hi", "warply": {"cache_key": "a", "extra": 1}}, "invalid_value"),
    ({"prompt": "hi", "warply": {"cache_key": ""}}, "invalid_value"),
    ({"prompt": "hi", "warply": {"cache_key": "a\0sql"}}, "invalid_value"),
    ({"prompt": "hi", "cache_salt": "a\0sql"}, "invalid_value"),
    ({"prompt": "hi", "cache_salt": 5}, "invalid_value"),
    ({"prompt": list(range(97))}, "prompt_too_long"),
    ({"prompt": "the cache holds " * 60}, "prompt_too_long"),
    ({"prompt": ["a", "b", "c", "d", "e"]}, "too_many_prompts"),
]

CHAT_ESCAPES = [
    ({"messages": "hi"}, "invalid_prompt"),
    ({"messages": [{"role": "user", "content": {"a": 1}}]}, "invalid_prompt"),
    ({"messages": [{"role": 1, "content": "x"}]}, "invalid_prompt"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "invalid_prompt"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "invalid_prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{% for %}"},
     "invalid_prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 / 0 }}"},
     "invalid_prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages + 1 }}"},
     "invalid_prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}},
     "invalid_prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}] * 9}, "too_many_messages"),
]


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [("/v1/completions", b, c) for b, c in ESCAPES]
    + [("/v1/chat/completions", b, c) for b, c in CHAT_ESCAPES],
)
def test_known_bad_inputs_are_openai_400s(live: Live, path: str, body: Any, code: str) -> None:
    before = live.errors().get(("400", code), 0)
    status, answer = _post(live, path, body)
    assert status == 400 and _is_error(answer, code), answer
    assert live.errors()[("400", code)] == before + 1


def test_deeply_nested_json_is_400(live: Live) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/warply/directives"):
        raw = b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
        status, answer = live.call("POST", path, raw, **ADMIN)
        assert status == 400 and _is_error(answer, "invalid_json"), answer


def test_a_body_not_in_its_content_encoding_is_400(live: Live) -> None:
    """A body said to be gzip that is not was a 500 (aiohttp's payload error escaped); a gzip
    body that is one is served."""
    json_gzip = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    before = live.errors().get(("400", "invalid_json"), 0)
    for path in ("/v1/completions", "/warply/directives"):
        status, answer = live.call("POST", path, b"not gzip", **json_gzip, **ADMIN)
        assert status == 400 and _is_error(answer, "invalid_json"), answer
        assert "content-encoding: gzip" in answer["error"]["message"]
    assert live.errors()[("400", "invalid_json")] == before + 2
    body = gzip.compress(json.dumps({"prompt": "the cache", "max_tokens": 1}).encode())
    assert live.call("POST", "/v1/completions", body, **json_gzip)[0] == 200


def test_negative_token_id_names_it(live: Live) -> None:
    status, answer = _post(live, "/v1/completions", {"model": "m", "prompt": [5, -3]})
    assert status == 400 and answer["error"]["message"].startswith("Token id -3 is out of vocab")


def test_oversized_body_is_413(live: Live) -> None:
    before = live.errors().get(("413", "request_too_large"), 0)
    status, answer = _post(live, "/v1/completions", {"prompt": "x" * (65 << 10)})
    assert status == 413 and _is_error(answer, "request_too_large")
    assert str(64 << 10) in answer["error"]["message"]
    status, answer = live.call("POST", "/warply/directives", b"[" * (65 << 10), **ADMIN)
    assert status == 413 and _is_error(answer, "request_too_large")
    assert live.errors()[("413", "request_too_large")] == before + 2


def test_valid_requests_still_pass(live: Live) -> None:
    for path, body in (
        ("/v1/completions", {"model": "sql", "prompt": [1, 2, 3, 4, 5], "max_tokens": None}),
        ("/v1/completions", {"prompt": [[1, 2], "the cache"], "stream": False}),
        ("/v1/completions", {"model": "", "prompt": "the cache"}),  # vLLM: the base model
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 8}),
    ):
        status, answer = _post(live, path, body)
        assert status == 200, answer



UNKEYED = [  # each was a 500 (found by the deeper fuzz run, docs/reliability.md)
    ("live", "/v1/responses",
     {"input": [{"role": "user", "content": [{"type": [], "text": "x"}]}]}),
    ("live", "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": {"type": []}}),
    # fields SGLang 0.5's own conversion trips over or its request model refuses
    ("live_sglang", "/v1/responses",
     {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"text": None}]}]}),
    ("live_sglang", "/v1/responses",
     {"input": "hi", "tools": [{"type": "custom", "name": "f", "description": {"a": 1}}]}),
    ("live_sglang", "/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f"}],
                                      "tool_choice": {"type": "function", "function": [1]}}),
]


@pytest.mark.parametrize(("fleet", "path", "body"), UNKEYED)
def test_bodies_the_router_cannot_key_are_placed_by_load(
    request: pytest.FixtureRequest, fleet: str, path: str, body: dict[str, Any]
) -> None:
    """Not a 500: the router leaves such a body to the engine (the fake engines answer 200)."""
    status, answer = _post(request.getfixturevalue(fleet), path, {"model": "m", **body})
    assert status == 200, answer

# -- hypothesis: arbitrary JSON, shaped like requests -----------------------------------------

_SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
_JSON = st.recursive(
    _SCALAR,
    lambda inner: st.lists(inner, max_size=6)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)
_BLOCKS = st.lists(  # Anthropic content blocks (a chat's text parts among them)
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"])
         | _JSON},
        optional={k: st.text(max_size=12) | _JSON
                  for k in ("text", "id", "name", "thinking", "tool_use_id")}
        | {"input": st.dictionaries(st.text(max_size=4), _SCALAR, max_size=2) | _JSON,
           "content": st.text(max_size=12) | st.lists(_JSON, max_size=2) | _JSON},
    ),
    max_size=4,
)
_TOKEN_LIST = st.lists(st.integers(min_value=-5, max_value=1000), min_size=1, max_size=80)
_FIELDS = {
    "model": st.sampled_from(["m", "sql", "other"]) | _JSON,
    "prompt": st.text(max_size=60) | _TOKEN_LIST | st.lists(_TOKEN_LIST | st.text(), max_size=6)
    | _JSON,
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | _JSON},
                              optional={"content": st.text(max_size=30) | _BLOCKS | _JSON})
        | _JSON,
        max_size=10,
    ) | _JSON,
    # the Anthropic Messages API's
    "system": st.text(max_size=30) | _BLOCKS | _JSON,
    "stream": st.booleans() | _JSON,
    "stream_options": st.just({"include_usage": True}) | _JSON,
    "max_tokens": st.integers(min_value=-2, max_value=10) | _JSON,
    "n": st.integers(min_value=0, max_value=3) | _JSON,
    "add_special_tokens": st.booleans() | _JSON,
    "chat_template_kwargs": _JSON,
    "warply": st.fixed_dictionaries({}, optional={"cache_key": st.text(max_size=8) | _JSON,
                                                  "prefix_reuse": st.booleans() | _JSON}) | _JSON,
    # the Responses API's (a string previous_response_id is the engine's 404, not fuzzed here)
    "input": st.text(max_size=30) | st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "developer"]) | _JSON},
            optional={
                "type": st.sampled_from(["message", "function_call"]) | _JSON,
                "content": st.text(max_size=30) | st.lists(st.fixed_dictionaries(
                    {"type": st.sampled_from(["input_text", "output_text", "input_image"])
                     | _JSON}, optional={"text": st.text(max_size=20) | _JSON}), max_size=3),
            },
        ) | _JSON,
        max_size=6,
    ) | _JSON,
    "instructions": st.text(max_size=30) | _JSON,
    "max_output_tokens": st.integers(min_value=-2, max_value=10) | _JSON,
    "previous_response_id": _SCALAR.filter(lambda v: not isinstance(v, str)),
    "truncation": st.sampled_from(["auto", "disabled"]) | _JSON,
    "tools": st.just([]) | _JSON,
}
_BODY = st.fixed_dictionaries({}, optional=_FIELDS)


def _valid_mostly(shape: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`shape`, now and then arbitrary JSON in its place."""
    return st.one_of(shape, shape, shape, _JSON)


def _role(*names: str) -> st.SearchStrategy[Any]:
    """A `role` or `type` field: one of `names`, now and then any JSON value (a list is
    unhashable: a lookup of it in a set or dict raised)."""
    return _valid_mostly(st.sampled_from(names))


# Bodies shaped closely enough to pass the first checks, so that the conversions of chats,
# Messages and Responses bodies to the engine's prompt (router/chat_shape.py,
# router/messages*.py, router/responses*.py) see them: arbitrary JSON alone rarely gets there.
_NAME = st.sampled_from(["f", "g", "ns__f"]) | st.text(max_size=6)
_ARGS = st.sampled_from(['{"a": 1}', "{}", "not json"]) | _JSON
_TEXT = st.text(max_size=20)
_CALL = st.fixed_dictionaries(
    {"id": _TEXT, "type": _valid_mostly(st.just("function")),
     "function": _valid_mostly(st.fixed_dictionaries({"name": _NAME, "arguments": _ARGS}))})
_PARTS = st.lists(_valid_mostly(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "input_text", "output_text", "image_url"]) | _JSON},
    optional={"text": _valid_mostly(_TEXT)})), max_size=3)
_CHAT = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.lists(_valid_mostly(st.fixed_dictionaries(
        {"role": _role("user", "assistant", "system", "developer", "tool"),
         "content": _valid_mostly(_TEXT | _PARTS | st.none())},
        optional={"tool_calls": _valid_mostly(st.lists(_CALL, max_size=2)),
                  "tool_call_id": _TEXT | _JSON, "name": _TEXT | _JSON,
                  "reasoning": _TEXT | _JSON})), min_size=1, max_size=6)},
    optional={"tools": _valid_mostly(st.lists(_valid_mostly(st.fixed_dictionaries(
        {"type": _role("function"), "function": _valid_mostly(st.fixed_dictionaries(
            {"name": _NAME}, optional={"parameters": _JSON, "strict": _JSON}))})), max_size=2)),
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | _JSON,
        "reasoning_effort": st.sampled_from(["none", "low", "high"]) | _JSON,
        "chat_template_kwargs": _JSON, "continue_final_message": st.booleans() | _JSON,
        "add_generation_prompt": st.booleans() | _JSON},
)
_ANTHROPIC_BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "redacted_thinking",
                              "image", "server_tool_use", "tool_reference"]) | _JSON},
    optional={"text": _valid_mostly(_TEXT), "id": _valid_mostly(_TEXT),
              "name": _valid_mostly(_NAME), "input": _valid_mostly(st.dictionaries(
                  st.text(max_size=4), _SCALAR, max_size=2)),
              "thinking": _valid_mostly(_TEXT), "signature": _TEXT, "data": _TEXT,
              "tool_use_id": _valid_mostly(_TEXT), "is_error": st.booleans() | _JSON,
              "content": _valid_mostly(_TEXT | st.lists(_valid_mostly(st.fixed_dictionaries(
                  {"type": st.sampled_from(["text", "image"]), "text": _TEXT})), max_size=2)),
              "tool_name": _valid_mostly(_NAME)},
)
_MESSAGES = st.fixed_dictionaries(
    {"model": st.just("m"), "max_tokens": st.integers(min_value=1, max_value=8),
     "messages": st.lists(_valid_mostly(st.fixed_dictionaries(
         {"role": _role("user", "assistant", "system"),
          "content": _TEXT | st.lists(_valid_mostly(_ANTHROPIC_BLOCK), max_size=4)})),
         min_size=1, max_size=6)},
    optional={"system": _valid_mostly(_TEXT | st.lists(_valid_mostly(st.fixed_dictionaries(
        {"type": st.just("text"), "text": _TEXT})), max_size=2)),
        "tools": _valid_mostly(st.lists(_valid_mostly(st.fixed_dictionaries(
            {"name": _NAME}, optional={"input_schema": _JSON, "description": _TEXT,
                                       "type": st.sampled_from(["custom", "web_search_20250305"])
                                       | _JSON, "strict": _JSON})), max_size=3)),
        "tool_choice": _valid_mostly(st.fixed_dictionaries(
            {"type": _role("auto", "any", "none", "tool")},
            optional={"name": _NAME})),
        "thinking": _valid_mostly(st.fixed_dictionaries(
            {"type": _role("enabled", "disabled", "adaptive")},
            optional={"budget_tokens": st.integers(min_value=0, max_value=2048)})),
        "output_config": _valid_mostly(st.fixed_dictionaries(
            {}, optional={"effort": st.sampled_from(["low", "high", "xhigh"]) | _JSON})),
        "stream": st.booleans()},
)
_ITEM = _valid_mostly(st.one_of(
    st.fixed_dictionaries(
        {"role": _role("user", "assistant", "system", "developer")},
        optional={"type": _role("message"), "content": _valid_mostly(_TEXT | _PARTS)}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call", "custom_tool_call"]), "call_id": _TEXT | _JSON,
         "name": _valid_mostly(_NAME)},
        optional={"arguments": _ARGS, "input": _valid_mostly(_TEXT), "namespace": _TEXT}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call_output", "custom_tool_call_output"]),
         "call_id": _TEXT, "output": _valid_mostly(_TEXT | _PARTS)}),
    st.fixed_dictionaries(
        {"type": st.just("reasoning")},
        optional={"summary": _valid_mostly(st.lists(st.fixed_dictionaries(
            {"type": st.just("summary_text"), "text": _TEXT}), max_size=2)),
            "content": _JSON, "encrypted_content": _valid_mostly(_TEXT)}),
))
_RESPONSES = st.fixed_dictionaries(
    {"model": st.just("m"), "input": _TEXT | st.lists(_ITEM, min_size=1, max_size=6)},
    optional={"instructions": _valid_mostly(_TEXT),
              "tools": _valid_mostly(st.lists(_valid_mostly(st.one_of(
                  st.fixed_dictionaries({"type": st.just("function"), "name": _NAME},
                                        optional={"parameters": _JSON, "strict": _JSON}),
                  st.fixed_dictionaries({"type": st.just("custom"), "name": _NAME}, optional={
                      "description": _valid_mostly(_TEXT),
                      "format": _valid_mostly(st.fixed_dictionaries(
                          {"type": st.sampled_from(["grammar", "text"])},
                          optional={"syntax": _valid_mostly(st.sampled_from(["lark", "regex"])),
                                    "definition": _valid_mostly(_TEXT)}))}),
                  st.fixed_dictionaries({"type": st.just("namespace"), "name": _NAME,
                                         "tools": _JSON}))), max_size=3)),
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | _valid_mostly(
                  st.fixed_dictionaries({"type": _role("function", "custom")},
                                        optional={"name": _valid_mostly(_NAME), "function":
                                                  _valid_mostly(st.fixed_dictionaries(
                                                      {"name": _NAME}))})),
              "reasoning": _valid_mostly(st.fixed_dictionaries(
                  {}, optional={"effort": st.sampled_from(["low", "high"]) | _JSON})),
              "truncation": st.sampled_from(["auto", "disabled"]), "stream": st.booleans()},
)
_SHAPED = {"/v1/chat/completions": _CHAT, "/v1/messages": _MESSAGES, "/v1/responses": _RESPONSES}
_RAW = (
    _BODY.map(lambda b: json.dumps(b).encode())
    | _JSON.map(lambda b: json.dumps(b).encode())
    | st.binary(max_size=200)
    | st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass"))
)


def _check_answer(status: int, answer: Any, anthropic: bool = False) -> None:
    assert status < 500, answer
    if status >= 400 and anthropic:
        assert isinstance(answer, dict) and answer["type"] == "error" and set(
            answer["error"]) == {"type", "message"}, answer  # fmt: skip
    elif status >= 400:
        assert isinstance(answer, dict) and set(answer["error"]) == {
            "message", "type", "param", "code"}, answer  # fmt: skip


def _fuzz(live: Live, path: str) -> None:
    """Fuzzed bodies to `path`: none answers 5xx, every 4xx is counted in the error metric."""
    seen: dict[str, int] = {"rejected": 0}
    before = sum(v for (s, _), v in live.errors().items() if s.startswith("4"))

    shaped = _SHAPED.get(path)
    raws = _RAW if shaped is None else st.one_of(
        shaped.map(lambda b: json.dumps(b).encode()), _RAW
    )  # half the bodies shaped for the path

    @FUZZ
    @given(raw=raws)
    def run(raw: bytes) -> None:
        status, answer = _post(live, path, raw)
        _check_answer(status, answer, path == "/v1/messages")
        seen["rejected"] += 400 <= status < 500  # the fake engines answer only 200s

    run()
    after = sum(v for (s, _), v in live.errors().items() if s.startswith("4"))
    assert seen["rejected"] > 0 and after - before == seen["rejected"]


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"]
)
def test_fuzzed_bodies_never_crash_and_every_rejection_is_counted(live: Live, path: str) -> None:
    _fuzz(live, path)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_fuzzed_bodies_on_an_sglang_fleet(live_sglang: Live, path: str) -> None:
    """The same on a fleet of SGLang engines, whose conversions of chats, Responses and
    Messages bodies are the router's own code apart from vLLM's."""
    _fuzz(live_sglang, path)


def test_fuzzed_admin_bodies_never_crash(live: Live) -> None:
    @FUZZ
    @given(
        path=st.sampled_from(
            ["/warply/directives", "/warply/workers/a", "/warply/pools/p/workers",
             "/warply/pools/nope/workers"]  # fmt: skip
        ),
        raw=_RAW | st.fixed_dictionaries({"worker": _JSON, "directive": _JSON}).map(
            lambda b: json.dumps(b).encode()
        ),
    )
    def run(path: str, raw: bytes) -> None:
        status, answer = live.call("POST", path, raw, **ADMIN)
        _check_answer(status, answer)

    run()
    assert live.router.workers["a"].enabled is not None


# -- schemathesis: the router against its own OpenAPI document --------------------------------


def test_openapi_document_is_served(live: Live) -> None:
    status, doc = live.call("GET", "/openapi.json", b"")
    assert status == 200 and doc == json.loads(json.dumps(openapi_document(live.router.config)))
    assert set(doc["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/warply/directives"}


_SCHEMA_CONFIG = RouterConfig.model_validate(
    {"model": "m", "lora_adapters": ["sql"], "tokenizer": "/unused",
     "pools": [{"name": "p", "block_size": 4, "workers": [{"name": "a", "url": "http://x"}]}]}
)  # fmt: skip
schema = schemathesis.openapi.from_dict(
    openapi_document(_SCHEMA_CONFIG),
    config=SchemathesisConfig.from_dict(
        {"generation": {"mode": "all", "max-examples": _DEEP or 15, "deterministic": not _DEEP,
                        "database": "none"}}  # fmt: skip
    ),
)


@schema.parametrize()
def test_router_conforms_to_its_openapi_document(case: Any, live: Live) -> None:
    """Every check but `positive_data_acceptance`: a schema-valid body may still exceed the
    context length the engines report at run time (400 `context_length_exceeded`)."""
    with requests.Session() as session:
        case.call_and_validate(
            base_url=live.base,
            session=session,
            headers=ADMIN,
            excluded_checks=[positive_data_acceptance],
        )


def test_huge_token_list_with_default_limits_is_a_400(tokenizer_dir: Path) -> None:  # noqa: F811
    """1.1 M token ids (7.7 MB of JSON) fit the default body limit and exceed the default
    prompt limit: answered 400 before any tokenizing or placement."""

    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")]) as (router, call, _s, _b):
            ids = b"[" + b",".join([b"7"] * 1_100_000) + b"]"
            status, body = await call("POST", "/v1/completions", b'{"prompt": ' + ids + b"}")
            assert status == 400 and _is_error(body, "prompt_too_long"), body
            assert str(router.config.limits.max_prompt_tokens) in body["error"]["message"]
            many = {"prompt": [[1, 2]] * 1025}
            status, body = await call("POST", "/v1/completions", many)
            assert status == 400 and _is_error(body, "too_many_prompts")

    _run(scenario())
