"""Engine endpoints the router forwards without placing by prefix: `POST /tokenize` and
`POST /detokenize`, which vLLM 0.32 and SGLang 0.5 both serve and which compute no KV, and a
stored response's `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.

A tokenizer request goes as it came to the available worker with the fewest requests in flight;
a stored response's request to the worker its id names (`router.responses`), or, for an id the
router did not make, to each available worker in turn until one holds it (an engine answers 404
for a response it does not hold). The engine's answer (status, body, content type) is the
client's, with `X-Warply-Worker` naming the worker; an event stream (a stored response's
`GET ...?stream=true`) is relayed as it arrives, ended by the Responses API's error event when
the upstream fails or the router's drain cuts it after it started. A worker that refuses the
connection is marked unhealthy and the next one is tried; a timeout is a 504, any other
upstream failure a 502 (OpenAI-shaped, as on the generation path). Counted in
`warply_router_forwarded_requests_total` by endpoint (the route, ids left out), worker and
status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import partial
from urllib.parse import quote

from aiohttp import web

from router.drain import SHUTTING_DOWN, Drain, InFlight, withdraw_cancel
from router.errors import ApiError, check_model, read_body
from router.messages import COUNT_TOKENS_PATH
from router.metrics import RouterMetrics
from router.proxy import upstream_headers
from router.responses import PATH, error_event, holder_unavailable, owner
from router.upstream import (
    ConnectFailed,
    Response,
    Timeouts,
    Upstream,
    UpstreamError,
    upstream_failure,
)
from router.workers import Worker

FORWARDED_PATHS = ("/tokenize", "/detokenize", COUNT_TOKENS_PATH)
STORED_RESPONSE = PATH + "/{response_id}"
"""GET: a stored response; POST `STORED_RESPONSE + "/cancel"`: cancel a background one."""


@dataclass(frozen=True, slots=True)
class Forwarder:
    """Forwards the `FORWARDED_PATHS` and stored-response requests over the generation path's
    connections and drain."""

    upstream: Upstream
    drain: Drain
    workers: Mapping[str, Worker]
    served: Collection[str]
    """The model names a request may give (the base model and its LoRA adapters)."""
    metrics: RouterMetrics
    timeouts: Timeouts

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One forwarded request; a stopping router's drain waits for it, then answers 503."""
        flight = self.drain.enter()
        try:
            response_id = request.match_info.get("response_id")
            if response_id is None:
                body, raw = await read_body(request)
                check_model(body.get("model"), self.served)
                return await self._forward(request, request.path, raw, self._least_loaded)
            path = _stored_path(request, response_id)
            stored = owner(response_id, self.workers)
            if stored is None:
                return await self._forward(
                    request, path, b"", self._least_loaded, search=True, flight=flight
                )
            return await self._forward(
                request, path, b"", partial(self._named, stored, response_id), flight=flight
            )
        except asyncio.CancelledError:
            if not flight.cut:
                raise  # the client went away
            withdraw_cancel()
            raise ApiError(503, SHUTTING_DOWN, "shutting_down") from None
        finally:
            self.drain.leave(flight)

    async def _forward(
        self,
        request: web.Request,
        path: str,
        body: bytes,
        pick: Callable[[Collection[str]], Worker],
        search: bool = False,
        flight: InFlight | None = None,
    ) -> web.StreamResponse:
        """`body` to `path` on the worker `pick` chooses among those not tried yet (`search`:
        past each one that answers 404 while another is left); an event stream is relayed as
        it arrives (`flight`: the request, whose stream the drain may cut)."""
        headers = upstream_headers(request)
        route = request.match_info.route.resource
        endpoint = (request.path if route is None else route.canonical).removeprefix("/")
        tried: set[str] = set()
        while True:
            worker = pick(tried)
            tried.add(worker.name)
            try:
                up = await self.upstream.send(
                    worker.config.url + path, body, headers, self.timeouts, request.method
                )
                try:
                    if up.content_type == "text/event-stream" and up.status == 200:
                        self._count(endpoint, worker.name, up.status)
                        return await self._relay(request, up, worker, flight)
                    answer = await up.read()
                finally:
                    up.release()
            except ConnectFailed:
                worker.set_health(False, refused=True)  # the health loop brings it back
                worker.answered(False)
                continue
            except (TimeoutError, UpstreamError) as exc:
                worker.answered(False)
                status, message = upstream_failure(worker.name, exc)
                self._count(endpoint, worker.name, status)
                raise ApiError(status, message) from None
            worker.answered(up.status < 500)
            self._count(endpoint, worker.name, up.status)
            if search and up.status == 404 and self._ready(tried):
                continue
            return web.Response(
                body=answer,
                status=up.status,
                content_type=up.content_type or "application/json",
                headers={"X-Warply-Worker": worker.name},
            )

    async def _relay(
        self, request: web.Request, up: Response, worker: Worker, flight: InFlight | None
    ) -> web.StreamResponse:
        """An answer's events to the client as they arrive. Once the stream started, an
        upstream failure or the drain's cut ends it with an error event, not a status."""
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                          "Cache-Control": "no-cache",
                                          "X-Warply-Worker": worker.name})  # fmt: skip
        await out.prepare(request)
        if flight is not None:
            flight.streaming()
        try:
            try:
                async for data in up.chunks():
                    await out.write(data)
            except (TimeoutError, UpstreamError) as exc:
                worker.answered(False)
                await out.write(error_event(*upstream_failure(worker.name, exc)))
            except asyncio.CancelledError:
                if flight is None or not flight.cut:
                    raise  # the client went away; releasing the answer closes the upstream's
                withdraw_cancel()
                await out.write(error_event(503, SHUTTING_DOWN))
            else:
                worker.answered(True)
            await out.write_eof()
        except ConnectionResetError:  # aiohttp: a write to a client that closed mid-stream
            pass  # the answer is released unread: its connection closes, the engine aborts
        return out

    def _ready(self, tried: Collection[str]) -> list[Worker]:
        """The available workers not tried yet."""
        return [w for w in self.workers.values() if w.available and w.name not in tried]

    def _least_loaded(self, tried: Collection[str]) -> Worker:
        """The available worker with the fewest requests in flight (503 when none is left)."""
        ready = self._ready(tried)
        if not ready:
            raise ApiError(503, "no healthy worker to forward the request to", "no_healthy_worker")
        return min(ready, key=lambda w: (w.load.in_flight, w.load.in_flight_tokens))

    def _named(self, name: str, response_id: str, tried: Collection[str]) -> Worker:
        """The worker that stored the response (503 when it cannot answer)."""
        worker = self.workers.get(name)
        if worker is None or not worker.available or name in tried:
            raise holder_unavailable(name, response_id)
        return worker

    def _count(self, endpoint: str, worker: str, status: int) -> None:
        self.metrics.forwarded(endpoint, worker, status)


def _stored_path(request: web.Request, response_id: str) -> str:
    """The engine's path for a stored response's request: built from the id (one path segment,
    percent-encoded) and the route, the query string kept (vLLM's `stream`, `starting_after`),
    so no client path reaches another of the engine's endpoints."""
    if response_id in (".", ".."):
        raise ApiError(404, f"no response {response_id!r}", "not_found")
    path = f"{PATH}/{quote(response_id, safe='')}"
    if request.path.endswith("/cancel"):
        path += "/cancel"
    query = request.rel_url.raw_query_string  # as sent: decoded, it could hold a CR LF
    return f"{path}?{query}" if query else path
