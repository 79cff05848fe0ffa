"""Errors in the OpenAI JSON shape: `{"error": {"message", "type", "param", "code"}}`, or on
the Anthropic Messages API in its own: `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import msgspec
from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""The Anthropic API's error types by status (others: `api_error`), as SGLang 0.5 maps them."""


class ApiError(Exception):
    """An error the router answers itself, before or instead of an engine."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        """Response headers beside the body (e.g. `Allow` on a 405)."""

    @property
    def type(self) -> str:
        """The OpenAI error type for this status."""
        return _TYPES.get(self.status, "api_error")

    def anthropic_body(self) -> dict[str, Any]:
        """The error in the Anthropic Messages API's shape."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, anthropic: bool = False) -> web.Response:
        """The error answer, in the Anthropic shape when `anthropic` (a /v1/messages path)."""
        body = self.anthropic_body() if anthropic else {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        headers = dict(self.headers)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return web.json_response(body, status=self.status, headers=headers)


async def read_body(request: web.Request) -> tuple[dict[str, Any], bytes]:
    """The request's body as a JSON object, and its bytes: 415 unless it is declared
    `application/json`, 413 past the app's `client_max_size` (`limits.max_body_bytes`), 400
    when it is not a JSON object or cannot be read as its `Content-Encoding` says (a "gzip"
    body that is not gzip was a 500).

    The content type is what keeps a web page from sending requests here: a browser sends a
    cross-site POST of `text/plain` (or a form) without asking, but asks the server first
    (a CORS preflight, which the router does not answer) before one of `application/json`.
    Without the check, any page open in a browser on a machine that reaches the router could
    drain its workers or join a worker of its own to receive prompts, where no `auth_token`
    is set. vLLM 0.32 and SGLang 0.5 refuse other content types on their JSON endpoints too."""
    if request.content_type != "application/json":
        raise ApiError(
            415,
            f"Unsupported Media Type {request.content_type!r}: only 'application/json' is "
            "allowed",
            "unsupported_media_type",
        )
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413,
            f"request body is larger than {request.client_max_size} bytes "
            "(the router's limits.max_body_bytes)",
            "request_too_large",
        ) from None
    except web.RequestPayloadError as exc:
        msg = f"request body cannot be read: {' '.join(str(exc).split())}"
        raise ApiError(400, msg, "invalid_json") from None
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    return body, raw


async def read_object(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object (`read_body`'s checks)."""
    return (await read_body(request))[0]


def check_model(model: Any, served: Collection[str]) -> None:
    """400 when a request's `model` is not a string, 404 `model_not_found` when it names a
    model the router does not serve (none or empty: the base model, as vLLM takes it)."""
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be str", "invalid_value", "model")
    if model and model not in served:
        raise ApiError(404, f"The model `{model}` does not exist.", "model_not_found", "model")
