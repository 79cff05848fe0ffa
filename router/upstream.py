"""The request path's HTTP/1.1 client: pooled keep-alive connections to the workers, one asyncio
protocol each, bodies written as the bytes given, answers read as they arrive.

aiohttp's client cost about 250 µs of CPU per proxied request here (URL objects, header
multidicts, timers, its connector), the largest share of the router's; this one costs a tenth
of that. The router's other HTTP calls (health, /metrics, parity) still use aiohttp.

A connection is reused only after an answer read whole with keep-alive; an answer left unread
(the client went away) closes its connection, which makes vLLM and SGLang abort the request.
Idle connections are dropped after `keepalive_s`, before the engines drop them (vLLM's uvicorn:
`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, 5 s).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

_KEEPALIVE_S = 4.0
_MAX_HEAD = 64 * 1024


class UpstreamError(Exception):
    """A failed exchange with a worker."""


class ConnectFailed(UpstreamError):
    """No connection: refused or unreachable (nothing was sent)."""


class ConnectTimeout(UpstreamError, TimeoutError):
    """No connection within the connect timeout (nothing was sent)."""


class Disconnected(UpstreamError):
    """The connection closed or broke before the answer was whole."""


class BadAnswer(UpstreamError):
    """The worker's bytes are not an HTTP/1.1 answer."""


@dataclass(frozen=True, slots=True)
class Timeouts:
    """`total`: the whole exchange, answer read included; `connect`: a new connection;
    `read`: the longest silence while waiting for the answer (None: no limit)."""

    total: float
    connect: float = 5.0
    read: float | None = None


@dataclass(frozen=True, slots=True)
class _Target:
    key: tuple[str, int, bool]
    host: str
    path: str


@lru_cache(maxsize=1024)
def _target(url: str) -> _Target:
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or "localhost"
    port = parts.port or (443 if tls else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return _Target((host, port, tls), parts.netloc, path)


class Response:
    """One answer: `status`, `headers` (lower-case names) and `content_type` once its head
    arrived; its body through `read()` or `chunks()`; `release()` when done with it."""

    def __init__(self, conn: _Connection, deadline: float, read_s: float | None) -> None:
        self._conn = conn
        self._deadline = deadline
        self._read_s = read_s
        self.status = 0
        self.headers: dict[str, str] = {}
        self._data: list[bytes] = []
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False

    @property
    def content_type(self) -> str:
        """The media type without its parameters (aiohttp's default when absent)."""
        value = self.headers.get("content-type", "application/octet-stream")
        return value.split(";", 1)[0].strip().lower()

    # -- fed by the connection ---------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._data.append(data)
        self._wake()

    def _end(self, error: BaseException | None = None) -> None:
        if self._done:
            return
        self._done = True
        self._error = error
        self._wake()

    # -- read by the dispatcher --------------------------------------------------------------

    async def _wait(self) -> None:
        """Until more body, the end, or an error; TimeoutError past the deadline or the
        read timeout."""
        loop = self._conn.loop
        until = self._deadline
        if self._read_s is not None:
            until = min(until, loop.time() + self._read_s)
        waiter = self._waiter = loop.create_future()
        timer = loop.call_at(until, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def _head(self) -> None:
        while not self.status:
            if self._done:
                raise self._error or Disconnected("the connection closed before an answer")
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        while not self._done:
            await self._wait()
        if self._error is not None:
            raise self._error
        data = b"".join(self._data)
        self._data = [data]
        return data

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: all bytes received so far at each step."""
        while True:
            if self._data:
                data = b"".join(self._data)
                self._data.clear()
                yield data
                continue
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            await self._wait()

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool when the answer was read
        whole with keep-alive, else it is closed (an engine aborts the request)."""
        if self._released:
            return
        self._released = True
        self._conn.finished(self._done and self._error is None)


def upstream_failure(worker: str, exc: BaseException) -> tuple[int, str]:
    """The status and message a client gets for an upstream `worker` that timed out (504) or
    failed otherwise (502), as an HTTP error or a stream's error event."""
    if isinstance(exc, TimeoutError):
        return 504, f"upstream {worker} timed out"
    return 502, f"upstream {worker} failed: {exc}"


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("upstream timed out"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one answer at a time (content-length, chunked, or
    up to the close)."""

    def __init__(self, pool: Upstream, key: tuple[str, int, bool]) -> None:
        self.loop = asyncio.get_running_loop()
        self._pool = pool
        self._key = key
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._resp: Response | None = None
        self._buf = b""
        self._keep = True
        self._framing = ""
        """"" (reading the head), "length", "chunked", "close"."""
        self._left = 0
        """Bytes of the body (length) or of the current chunk (chunked) still to come."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's are not Transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self._resp
        if resp is None:
            return
        if self._framing == "close":
            resp._end()
        else:
            reason = f": {exc}" if exc else ""
            resp._end(Disconnected(f"the connection closed before the answer was whole{reason}"))

    def send(self, data: bytes, resp: Response) -> None:
        assert self._transport is not None
        self._resp = resp
        self._buf = b""
        self._framing = ""
        self._keep = True
        self._transport.write(data)

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def finished(self, whole: bool) -> None:
        """The dispatcher is done with the current answer."""
        self._resp = None
        if whole and self._keep and not self.closed:
            self.idle_since = time.monotonic()
            self._pool.idle(self._key, self)
        else:
            self.close()

    # -- parsing -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        resp = self._resp
        if resp is None or resp._done:  # bytes nobody asked for: this connection is spoilt
            self._keep = False
            if resp is None:
                self.close()
            return
        if not self._framing:
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    self._fail(BadAnswer("answer head too large"))
                return
            head, data = self._buf[:end], self._buf[end + 4 :]
            self._buf = b""
            try:
                empty = self._read_head(resp, head)
            except (ValueError, IndexError, UnicodeDecodeError) as exc:
                self._fail(BadAnswer(f"malformed answer head: {exc}"))
                return
            resp._wake()
            if empty:
                resp._end()
        if data:
            self._body(resp, data)

    def _read_head(self, resp: Response, head: bytes) -> bool:
        """The status, headers and framing; True when the answer has no body."""
        lines = head.decode("latin-1").split("\r\n")
        version, code = lines[0].split(" ", 2)[:2]
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not HTTP/1.x: {lines[0]!r}")
        headers = resp.headers
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        resp.status = int(code)
        connection = headers.get("connection", "").lower()
        self._keep = "close" not in connection and (
            version == "HTTP/1.1" or "keep-alive" in connection
        )
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._framing, self._left = "chunked", -1
        elif (length := headers.get("content-length")) is not None:
            self._framing, self._left = "length", int(length)
        elif resp.status in (204, 304) or resp.status < 200:
            self._framing, self._left = "length", 0
        else:
            self._framing, self._keep = "close", False
        return self._framing == "length" and not self._left

    def _body(self, resp: Response, data: bytes) -> None:
        if self._framing == "close":
            resp._feed(data)
        elif self._framing == "length":
            if len(data) > self._left:
                self._keep = False
                data = data[: self._left]
            self._left -= len(data)
            resp._feed(data)
            if not self._left:
                resp._end()
        else:
            self._chunked(resp, data)

    def _chunked(self, resp: Response, data: bytes) -> None:
        buf = self._buf + data
        pos = 0
        out: list[bytes] = []
        while not resp._done:
            if self._left > 0:  # inside a chunk's data
                take = buf[pos : pos + self._left]
                out.append(take)
                pos += len(take)
                self._left -= len(take)
                if self._left:
                    break
                self._left = -2  # its CRLF
            elif self._left == -2:
                if len(buf) - pos < 2:
                    break
                pos += 2
                self._left = -1
            elif self._left == -1:  # a size line
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                try:
                    size = int(buf[pos:end].split(b";", 1)[0], 16)
                except ValueError:
                    self._fail(BadAnswer("malformed chunk size"))
                    return
                pos = end + 2
                self._left = size if size else -3
            else:  # after the last chunk: trailers up to an empty line
                if buf.startswith(b"\r\n", pos):
                    pos += 2
                else:
                    end = buf.find(b"\r\n\r\n", pos)
                    if end < 0:
                        break
                    pos = end + 4
                if out:
                    resp._feed(b"".join(out))
                    out = []
                resp._end()
        self._buf = buf[pos:]
        if out:
            resp._feed(b"".join(out))

    def _fail(self, error: UpstreamError) -> None:
        self._keep = False
        if self._resp is not None:
            self._resp._end(error)
        self.close()


class Upstream:
    """Keep-alive connections per worker; `post` sends one request and returns its answer
    once the head arrived."""

    def __init__(self, keepalive_s: float = _KEEPALIVE_S) -> None:
        self._keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    def idle(self, key: tuple[str, int, bool], conn: _Connection) -> None:
        """`conn` may be reused; the oldest idle ones past keep-alive (or closed by the worker)
        are dropped, so a burst's connections do not stay open."""
        idle = self._idle.setdefault(key, [])
        expired = conn.idle_since - self._keepalive_s
        while idle and (idle[0].closed or idle[0].idle_since <= expired):
            idle.pop(0).close()
        idle.append(conn)

    async def _connect(self, key: tuple[str, int, bool], timeout_s: float) -> _Connection:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive_s:
                return conn
            conn.close()
        host, port, tls = key
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key), host, port, ssl=self._tls if tls else None
                )
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {host}:{port} in {timeout_s} s") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        timeouts: Timeouts,
        method: str = "POST",
    ) -> Response:
        """POST (or `method`) `body` to `url`; the answer once its status and headers arrived
        (release it). Raises `ConnectFailed`, `ConnectTimeout`, `Disconnected` (nothing
        answered), `BadAnswer` or TimeoutError."""
        target = _target(url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeouts.total
        conn = await self._connect(target.key, min(timeouts.connect, timeouts.total))
        head = f"{method} {target.path} HTTP/1.1\r\nHost: {target.host}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()
        )
        data = f"{head}Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body
        resp = Response(conn, deadline, timeouts.read)
        conn.send(data, resp)
        try:
            await resp._head()
        except BaseException:
            resp.release()
            raise
        return resp

    async def send(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        timeouts: Timeouts,
        method: str = "POST",
    ) -> Response:
        """`post`, retried once when nothing reached the engine: a pooled connection it closed
        meanwhile (its keep-alive ran out: the server disconnects before answering), or a
        connection not made in time (a stalled machine). A refused connection is not retried
        (`ConnectFailed`: the caller tries another worker)."""
        try:
            return await self.post(url, body, headers, timeouts, method)
        except (Disconnected, ConnectTimeout):
            return await self.post(url, body, headers, timeouts, method)

    def close(self) -> None:
        """Close every idle connection (those in use close when released)."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
