"""Engine endpoints the router forwards without placing by prefix: `POST /tokenize` and
`POST /detokenize`, which vLLM 0.32 and SGLang 0.5 both serve and which compute no KV.

The body goes as it came to the available worker with the fewest requests in flight; its answer
(status, body, content type) is the client's, with `X-Warply-Worker` naming the worker. A
worker that refuses the connection is marked unhealthy and the next one is tried; a timeout is a
504, any other upstream failure a 502 (OpenAI-shaped, as on the generation path). Counted in
`warply_router_forwarded_requests_total` by endpoint, worker and status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from aiohttp import web

from router.drain import SHUTTING_DOWN, Drain, withdraw_cancel
from router.errors import ApiError, check_model, read_body
from router.metrics import RouterMetrics
from router.proxy import upstream_headers
from router.upstream import ConnectFailed, Timeouts, Upstream, UpstreamError
from router.workers import Worker

FORWARDED_PATHS = ("/tokenize", "/detokenize")


@dataclass(frozen=True, slots=True)
class Forwarder:
    """Forwards the `FORWARDED_PATHS` requests over the generation path's connections and drain."""

    upstream: Upstream
    drain: Drain
    workers: Mapping[str, Worker]
    served: Collection[str]
    """The model names a request may give (the base model and its LoRA adapters)."""
    metrics: RouterMetrics
    timeouts: Timeouts

    async def handle(self, request: web.Request) -> web.Response:
        """One forwarded request; a stopping router's drain waits for it, then answers 503."""
        flight = self.drain.enter()
        try:
            return await self._forward(request)
        except asyncio.CancelledError:
            if not flight.cut:
                raise  # the client went away
            withdraw_cancel()
            raise ApiError(503, SHUTTING_DOWN, "shutting_down") from None
        finally:
            self.drain.leave(flight)

    async def _forward(self, request: web.Request) -> web.Response:
        body, raw = await read_body(request)
        check_model(body.get("model"), self.served)
        headers = upstream_headers(request)
        tried: set[str] = set()
        while True:
            worker = self._pick(tried)
            try:
                up = await self.upstream.send(
                    worker.config.url + request.path, raw, headers, self.timeouts
                )
                try:
                    answer = await up.read()
                finally:
                    up.release()
            except ConnectFailed:
                worker.set_health(False, refused=True)  # the health loop brings it back
                worker.answered(False)
                tried.add(worker.name)
                continue
            except TimeoutError:
                worker.answered(False)
                self._count(request.path, worker.name, 504)
                raise ApiError(504, f"upstream {worker.name} timed out") from None
            except UpstreamError as exc:
                worker.answered(False)
                self._count(request.path, worker.name, 502)
                raise ApiError(502, f"upstream {worker.name} failed: {exc}") from None
            worker.answered(up.status < 500)
            self._count(request.path, worker.name, up.status)
            return web.Response(
                body=answer,
                status=up.status,
                content_type=up.content_type or "application/json",
                headers={"X-Warply-Worker": worker.name},
            )

    def _pick(self, tried: Collection[str]) -> Worker:
        """The available worker with the fewest requests in flight (503 when none is left)."""
        ready = [w for w in self.workers.values() if w.available and w.name not in tried]
        if not ready:
            raise ApiError(503, "no healthy worker to forward the request to", "no_healthy_worker")
        return min(ready, key=lambda w: (w.load.in_flight, w.load.in_flight_tokens))

    def _count(self, path: str, worker: str, status: int) -> None:
        self.metrics.forwarded(path.removeprefix("/"), worker, status)
