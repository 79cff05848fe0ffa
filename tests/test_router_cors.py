"""Cross-origin requests (CORS): none answered by default; the configured origins may call the
client API from a browser, never the admin API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest

from router.config import RouterConfig
from tests.test_router_api import (  # noqa: F401
    FakeEngine,
    _run,
    running,
    tokenizer_dir,
)

APP = "https://app.example"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip


async def _answer(session: Any, method: str, url: str, **kw: Any) -> tuple[int, dict[str, str]]:
    async with session.request(method, url, **kw) as r:
        await r.read()
        return r.status, dict(r.headers)


def test_no_origin_is_answered_by_default(tokenizer_dir: Path) -> None:  # noqa: F811
    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")]) as (_, _c, session, base):
            status, headers = await _answer(session, "OPTIONS", base + "/v1/completions",
                                            headers=PREFLIGHT)  # fmt: skip
            assert status == 405 and "Access-Control-Allow-Origin" not in headers
            body, origin = {"prompt": "hi"}, {"Origin": APP}
            status, headers = await _answer(session, "POST", base + "/v1/completions",
                                            json=body, headers=origin)  # fmt: skip
            assert status == 200 and "Access-Control-Allow-Origin" not in headers

    _run(scenario())


def test_allowed_origins_call_the_client_api_and_never_the_admin_api(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    async def scenario() -> None:
        async with running(
            tokenizer_dir, [FakeEngine("a")], cors_allowed_origins=[APP]
        ) as (_, _c, session, base):
            status, headers = await _answer(session, "OPTIONS", base + "/v1/chat/completions",
                                            headers=PREFLIGHT)  # fmt: skip
            assert status == 204 and headers["Access-Control-Allow-Origin"] == APP
            assert "POST" in headers["Access-Control-Allow-Methods"]
            assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
            for path in ("/v1/completions", "/warply/workers/a", "/warply/directives"):
                other = {**PREFLIGHT, "Origin": "https://elsewhere.example"}
                status, headers = await _answer(session, "OPTIONS", base + path, headers=other)
                assert status == 405 and "Access-Control-Allow-Origin" not in headers
            status, headers = await _answer(session, "OPTIONS", base + "/warply/workers/a",
                                            headers=PREFLIGHT)  # fmt: skip
            assert status == 405 and "Access-Control-Allow-Origin" not in headers
            for stream in (False, True):  # a stream's head carries it too
                status, headers = await _answer(
                    session, "POST", base + "/v1/completions", headers={"Origin": APP},
                    json={"prompt": "hi", "stream": stream},
                )  # fmt: skip
                assert status == 200 and headers["Access-Control-Allow-Origin"] == APP
                assert "X-Warply-Worker" in headers["Access-Control-Expose-Headers"]
            status, headers = await _answer(session, "GET", base + "/warply/cache_stats",
                                            headers={"Origin": APP})  # fmt: skip
            assert status == 200 and "Access-Control-Allow-Origin" not in headers

    _run(scenario())


def test_the_headers_a_browser_sdk_sends_are_allowed(tokenizer_dir: Path) -> None:  # noqa: F811
    """The Anthropic and OpenAI JavaScript SDKs in a page send headers of their own: the
    preflight allows what it is asked for (as vLLM's default `--allowed-headers '["*"]'`), and
    the call itself goes through."""
    sdk = ("anthropic-dangerous-direct-browser-access, anthropic-version, content-type, "
           "x-api-key, x-stainless-arch, x-stainless-lang, x-stainless-retry-count")

    async def scenario() -> None:
        async with running(
            tokenizer_dir, [FakeEngine("a", max_model_len=4096)], cors_allowed_origins=[APP]
        ) as (_, _c, session, base):
            asked = {**PREFLIGHT, "Access-Control-Request-Headers": sdk}
            status, headers = await _answer(session, "OPTIONS", base + "/v1/messages",
                                            headers=asked)  # fmt: skip
            assert status == 204 and headers["Access-Control-Allow-Headers"] == sdk
            bare = {k: v for k, v in PREFLIGHT.items() if k != "Access-Control-Request-Headers"}
            status, headers = await _answer(session, "OPTIONS", base + "/v1/messages",
                                            headers=bare)  # fmt: skip
            assert status == 204 and "Authorization" in headers["Access-Control-Allow-Headers"]
            body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            sent = {"Origin": APP, "x-api-key": "k", "anthropic-version": "2023-06-01"}
            status, headers = await _answer(session, "POST", base + "/v1/messages", json=body,
                                            headers=sent)  # fmt: skip
            assert status == 200 and headers["Access-Control-Allow-Origin"] == APP

    _run(scenario())


def test_any_origin(tokenizer_dir: Path) -> None:  # noqa: F811
    async def scenario() -> None:
        async with running(
            tokenizer_dir, [FakeEngine("a")], cors_allowed_origins=["*"]
        ) as (_, _c, session, base):
            status, headers = await _answer(session, "OPTIONS", base + "/v1/responses",
                                            headers=PREFLIGHT)  # fmt: skip
            assert status == 204 and headers["Access-Control-Allow-Origin"] == "*"

    _run(scenario())


@pytest.mark.parametrize(
    "origin", ["https://app.example/", "app.example", "ftp://app.example", "https://x:99999",
               "https://user@app.example", "https://app.example?x=1", ""],
)  # fmt: skip
def test_an_origin_that_is_not_one_is_a_config_error(origin: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="is not an origin"):
        RouterConfig.model_validate(
            {"model": "m", "tokenizer": "/t", "cors_allowed_origins": [origin],
             "pools": [{"name": "p", "block_size": 4, "workers": [{"url": "http://h:1"}]}]}
        )  # fmt: skip
