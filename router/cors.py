"""Cross-origin requests from web pages (CORS) to the router's client API, for the origins the
config names (`cors_allowed_origins`; none by default).

vLLM 0.32 answers every origin by default (`--allowed-origins '["*"]'`), so a browser client
that talked to an engine needs the router to say which pages may call it. Only the client API
answers: the admin API (`/warply/*`) never grants a preflight, so a page cannot call it with a
token or a JSON body, whatever origins are allowed (docs/reliability.md, Security). No
credentials (cookies) are ever allowed: the API's own token travels in `Authorization`. The
headers a page asks to send are allowed, as vLLM's default (`--allowed-headers '["*"]'`) allows
them: the JavaScript SDKs send their own (OpenAI's and Anthropic's `x-stainless-*`;
Anthropic's `x-api-key`, `anthropic-version`, `anthropic-dangerous-direct-browser-access`),
and a preflight that leaves one out makes the browser refuse the call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection

from aiohttp import web

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_ADMIN = "/warply/"
_MAX_AGE_S = "600"
_HEADERS = "Authorization, Content-Type, X-Request-Id"
_EXPOSED = "X-Warply-Worker, X-Warply-Predicted-Cached, X-Warply-Mode, X-Warply-Prefill-Worker"


class Cors:
    """The middleware and response hook that answer allowed origins."""

    def __init__(self, origins: Collection[str]) -> None:
        self._any = "*" in origins
        self._origins = frozenset(origins)

    def _allowed(self, request: web.BaseRequest) -> str | None:
        """The `Access-Control-Allow-Origin` value for this request (None: no CORS answer)."""
        origin = request.headers.get("Origin")
        if origin is None or request.path.startswith(_ADMIN):
            return None
        if self._any:
            return "*"
        return origin if origin in self._origins else None

    @web.middleware
    async def preflight(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """An allowed origin's preflight (`OPTIONS` with `Access-Control-Request-Method`) is
        answered 204 before routing; every other request goes on."""
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            allowed = self._allowed(request)
            if allowed is not None:
                asked = request.headers.get("Access-Control-Request-Headers")
                return web.Response(status=204, headers={
                    "Access-Control-Allow-Origin": allowed,
                    "Access-Control-Allow-Methods": "GET, POST",
                    "Access-Control-Allow-Headers": asked or _HEADERS,
                    "Access-Control-Max-Age": _MAX_AGE_S,
                    "Vary": "Origin",
                })  # fmt: skip
        return await handler(request)

    async def on_prepare(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        """Before a response's head is sent (a stream's too): the allowed origin."""
        allowed = self._allowed(request)
        if allowed is not None:
            response.headers["Access-Control-Allow-Origin"] = allowed
            response.headers["Access-Control-Expose-Headers"] = _EXPOSED
            response.headers["Vary"] = "Origin"
