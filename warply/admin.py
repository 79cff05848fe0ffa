"""The router's admin API from Python: one HTTP call decoded into its typed shape
(`warply.protocol.api`), a failure as one `AdminError` line (the SDK raises it, the CLI prints
it)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, TypeVar

import msgspec

from warply.common.urls import check_http_url

_T = TypeVar("_T")


class AdminError(Exception):
    """A failed admin call; `usage`: the request or its configuration was wrong (a 4xx, a bad
    URL), else the router failed or could not be reached."""

    def __init__(self, message: str, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


def call(
    router: str,
    path: str,
    shape: type[_T],
    body: Any = None,
    *,
    token: str | None = None,
    timeout: float = 10.0,
) -> _T:
    """GET `path` (POST `body` as JSON when given) on the router at `router`, decoded as
    `shape`; `token`: the router's admin token, when it has one."""
    try:
        check_http_url(router)
    except ValueError as exc:
        raise AdminError(f"router URL {router!r}: {exc}", usage=True) from None
    url = router.rstrip("/") + path
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    try:
        request = urllib.request.Request(url, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        message = f"{url}: {exc.code} {_message(exc.read()) or exc.reason}"
        raise AdminError(message, usage=400 <= exc.code < 500) from None
    except ValueError as exc:  # a malformed URL
        raise AdminError(f"router URL {router!r}: {exc}", usage=True) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AdminError(f"cannot reach the router at {router}: {reason}") from None
    try:
        return msgspec.json.decode(raw, type=shape)
    except msgspec.DecodeError as exc:
        raise AdminError(f"{url}: not a Warply router's answer ({exc})") from None


def _message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body ("" when it is not one)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""
