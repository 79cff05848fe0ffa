"""What `warply-router` logs of each HTTP request: no query strings, no request text and no
stored response's id.

aiohttp's own access line holds the request line, query string included, and
`GET /warply/where?prompt=...` carries a prompt there; its parser logs a malformed request
(a URL or header past 8190 bytes, a body not in its Content-Encoding) with the first 100
bytes of the offending line and a traceback. Prompts stay out of the logs at every level
(docs/reliability.md, Security), so both are replaced here. A stored response's id is in its
path (`GET /v1/responses/{id}`), and whoever holds an id may read that response from the
engine: the route is logged instead.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError

_STORED = "/v1/responses/"


class AccessLog(AbstractAccessLogger):
    """One line per request: client, method, path without its query, status, bytes, time."""

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)  # not called at all below INFO

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        path = request.path
        if path.startswith(_STORED):
            path = _STORED + "{response_id}" + ("/cancel" if path.endswith("/cancel") else "")
        self.logger.info(
            '%s "%s %s" %d %d %.1f ms',
            request.remote,
            request.method,
            path,
            response.status,
            response.body_length,
            time * 1000,
        )


class _MalformedRequests(logging.Filter):
    """aiohttp's record of a request its parser refused, reduced to the error's class and
    status (its message quotes the request's bytes), and a warning: the client's mistake."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg = "malformed HTTP request refused: %s (%d)"
            record.args = (type(exc).__name__, exc.code)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def keep_requests_out_of_logs() -> None:
    """Install the filter on aiohttp's server logger (pass `AccessLog` to `run_app`)."""
    logging.getLogger("aiohttp.server").addFilter(_MalformedRequests())
