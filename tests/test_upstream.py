"""The request path's HTTP/1.1 client (`router.upstream`) against a raw asyncio server that
answers with scripted bytes: framing (length, chunked split anywhere, up to the close),
keep-alive reuse, and each failure's exception."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from router.upstream import (
    BadAnswer,
    ConnectFailed,
    Disconnected,
    Timeouts,
    Upstream,
)

HOST = "127.0.0.1"
T = Timeouts(10)
_Answer = Callable[[bytes], Awaitable[list[bytes] | None]]
"""Given a request's head, the byte pieces to send (each written on its own, after a pause);
None closes the connection, so does a first piece with `Connection: close` once sent."""


class _Server:
    """Counts connections and requests; answers each request with `answer`'s pieces."""

    def __init__(self, answer: _Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()
        """Set when a client closed its connection."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                pieces = await self.answer(head)
                if pieces is None:
                    break
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.001)
                if b"Connection: close" in pieces[0]:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()
        finally:
            writer.close()


@asynccontextmanager
async def _serving(answer: _Answer) -> AsyncIterator[tuple[_Server, str]]:
    server = _Server(answer)
    srv = await asyncio.start_server(server.handle, HOST, 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield server, f"http://{HOST}:{port}/v1/completions"
    finally:
        srv.close()


def _run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


def _json(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n" + extra
        + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _chunked(events: list[bytes], trailer: bytes = b"") -> bytes:
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in events)
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunks + b"0\r\n" + trailer + b"\r\n"
    )


def test_a_json_answer_is_read_whole_and_its_connection_reused() -> None:
    async def answer(_: bytes) -> list[bytes]:
        return [_json(b'{"a": 1}')]

    async def scenario() -> None:
        async with _serving(answer) as (server, url):
            up = Upstream()
            for i in range(3):
                resp = await up.post(url, b'{"n": %d}' % i, {"Content-Type": "application/json"}, T)
                assert (resp.status, resp.content_type) == (200, "application/json")
                assert await resp.read() == b'{"a": 1}'
                resp.release()
            assert server.connections == 1 and len(server.requests) == 3
            assert server.requests[2].endswith(b'\r\n\r\n{"n": 2}')
            assert b"Host: " in server.requests[0] and b"Content-Length: 8" in server.requests[0]
            up.close()

    _run(scenario())


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_a_chunked_stream_split_anywhere_yields_its_bytes_in_order(size: int) -> None:
    events = [b'data: {"x": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
    raw = _chunked(events, trailer=b"X-Trailer: 1\r\n")

    async def answer(_: bytes) -> list[bytes]:
        return [raw[i : i + size] for i in range(0, len(raw), size)]

    async def scenario() -> None:
        async with _serving(answer) as (server, url):
            up = Upstream()
            for _ in range(2):  # the second request reuses the connection
                resp = await up.post(url, b"{}", {}, T)
                got = b"".join([c async for c in resp.chunks()])
                resp.release()
                assert got == b"".join(events)
            assert server.connections == 1
            up.close()

    _run(scenario())


def test_an_answer_without_length_ends_at_the_close_and_is_not_reused() -> None:
    async def answer(_: bytes) -> list[bytes] | None:
        return [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"]

    async def scenario() -> None:
        async with _serving(answer) as (server, url):
            up = Upstream()
            for _ in range(2):
                resp = await up.post(url, b"{}", {}, T)
                assert await resp.read() == b"all of it"
                resp.release()
            assert server.connections == 2

    _run(scenario())


def test_an_unread_answer_closes_its_connection() -> None:
    """The client went away mid-stream: closing the upstream connection aborts the request."""

    async def answer(_: bytes) -> list[bytes]:
        return [_chunked([b"data: 1\n\n"])[:-5]]  # the stream goes on (never ends)

    async def scenario() -> None:
        async with _serving(answer) as (server, url):
            up = Upstream()
            resp = await up.post(url, b"{}", {}, T)
            resp.release()
            await asyncio.wait_for(server.closed.wait(), 5)
            resp = await up.post(url, b"{}", {}, T)  # a new connection
            resp.release()
            assert server.connections == 2

    _run(scenario())


def test_failures_raise_their_own_errors() -> None:
    async def scenario() -> None:
        up = Upstream()
        with socket.socket() as s:  # a port nothing listens on
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        with pytest.raises(ConnectFailed):
            await up.post(f"http://{HOST}:{port}/v1/completions", b"{}", {}, T)

        async def hang_up(_: bytes) -> None:
            return None

        async with _serving(hang_up) as (_, url):
            with pytest.raises(Disconnected):
                await up.post(url, b"{}", {}, T)

        async def silent(_: bytes) -> list[bytes]:
            await asyncio.sleep(5)
            return []

        async with _serving(silent) as (_, url):
            with pytest.raises(TimeoutError):
                await up.post(url, b"{}", {}, Timeouts(10, read=0.2))
            with pytest.raises(TimeoutError):
                await up.post(url, b"{}", {}, Timeouts(0.2))

        async def garbage(_: bytes) -> list[bytes]:
            return [b"SMTP ready\r\n\r\n"]

        async with _serving(garbage) as (_, url):
            with pytest.raises(BadAnswer):
                await up.post(url, b"{}", {}, T)

        async def partial(_: bytes) -> list[bytes] | None:
            return [_json(b'{"a": 1}')[:-3]]

        async with _serving(partial) as (_, url):
            resp = await up.post(url, b"{}", {}, Timeouts(10, read=0.5))
            with pytest.raises(TimeoutError):  # the rest never comes
                await resp.read()
            resp.release()

    _run(scenario())


def test_an_idle_connection_past_keepalive_is_not_reused() -> None:
    async def answer(_: bytes) -> list[bytes]:
        return [_json(b"{}")]

    async def scenario() -> None:
        async with _serving(answer) as (server, url):
            up = Upstream(keepalive_s=0.2)
            for _ in range(2):
                resp = await up.post(url, b"{}", {}, T)
                await resp.read()
                resp.release()
                await asyncio.sleep(0.3)
            assert server.connections == 2
            burst = await asyncio.gather(*(up.post(url, b"{}", {}, T) for _ in range(5)))
            for resp in burst:  # five new connections (the idle one expired), all idle once read
                await resp.read()
                resp.release()
            assert server.connections == 7 and [len(c) for c in up._idle.values()] == [5]
            for _ in range(4):  # one at a time: the newest is reused, the others age and go
                await asyncio.sleep(0.1)
                resp = await up.post(url, b"{}", {}, T)
                await resp.read()
                resp.release()
            assert server.connections == 7 and [len(c) for c in up._idle.values()] == [1]

    _run(scenario())
