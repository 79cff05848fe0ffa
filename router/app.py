"""The router's aiohttp application: routes, admin auth, worker health, start-up and shutdown.

Client API: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, /health, /metrics,
/tokenize, /detokenize and a stored response's GET /v1/responses/{id} and its cancel (forwarded
to a worker: `router.passthrough`), and the OpenAPI document of all of them, /openapi.json
(`router.openapi`).
Admin API (Bearer token when `auth_token` is set): /warply/cache_stats, /warply/workers,
POST /warply/workers/{name} (`{"enabled": false}` drains a worker), POST /warply/directives,
POST /warply/pools/{pool}/workers and DELETE /warply/workers/{name} (workers join and leave),
GET|POST /warply/where (where a prompt's prefix lives and what the router would choose).
The health loop also reads decode workers' KV-transfer counters from their /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from router.config import RouterConfig
from router.control import send_directive
from router.cors import Cors
from router.errors import ApiError, read_object
from router.feed import IndexFeed
from router.index import PrefixIndex, open_store
from router.index_health import IndexHealth
from router.load import open_ledger
from router.loop_watch import LoopWatch
from router.membership import Membership
from router.messages import PATH as MESSAGES
from router.messages import anthropic_shaped
from router.metrics import RouterMetrics, kv_transfer_stats
from router.model_cards import read_cards
from router.openapi import openapi_document
from router.parity import Probes
from router.parity import check as check_parity
from router.passthrough import FORWARDED_PATHS, STORED_RESPONSE, Forwarder
from router.placement import Placement
from router.proxy import Proxy
from router.tasks import cancel, periodic
from router.tiering import TierRunner
from router.tokenize import RouterTokenizer
from router.where import where
from router.workers import Worker, Workers
from warply.protocol import Directive
from warply.protocol.api import CacheStats, IndexHealthView, WorkerList

_log = logging.getLogger(__name__)
_METRICS_TIMEOUT = aiohttp.ClientTimeout(total=2)
_CATCH_UP_S = 5.0
"""Longest wait at start-up for the streams' replayed history before serving."""
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(shape: msgspec.Struct) -> web.Response:
    return web.Response(body=msgspec.json.encode(shape), content_type="application/json")


class Router:
    """Everything one router process holds; `app` is what aiohttp serves."""

    def __init__(self, config: RouterConfig, tokenizer: RouterTokenizer | None = None) -> None:
        self.config = config
        self.index = PrefixIndex(
            config.model, open_store(config.index), config.index.max_entries
        )
        self.workers = Workers(config.pools, config.breaker)
        self.health = IndexHealth(config.index)
        self.ledger = open_ledger(config.index, self.index.outage)
        if self.ledger.shared:
            self.workers.watch(self.ledger.changed)
        self.placement = Placement(
            config, self.index, self.workers, health=self.health, ledger=self.ledger
        )
        tokenizer = tokenizer or RouterTokenizer(
            config.tokenizer,
            config.tokenizer_cache_mib << 20,
            chat_template=config.chat_template,
            content_format=config.chat_template_content_format,
            default_kwargs=config.default_chat_template_kwargs,
            exclude_tools_when_none=config.exclude_tools_when_tool_choice_none,
            hf_template_name=config.hf_chat_template_name,
        )
        self.tokenizer = tokenizer
        """The engine's tokenizer and chat template (its `engine` set from the cards)."""
        self._probes = Probes.build(tokenizer, config.model) if config.index.parity_check else None
        self.metrics = RouterMetrics(config, self.workers, tokenizer.cache.stats)
        self.metrics.on_request.append(self.health.observe)
        self.feed = IndexFeed(self.workers, self.index, self.metrics, self.health)
        self._down: set[str] = set()
        """Workers found refusing connections whose entries were dropped (until healthy)."""
        self.membership = Membership(
            self.workers, self.placement, self.feed, self.index, self.metrics
        )
        self.proxy = Proxy(
            config.model,
            tokenizer,
            self.placement,
            self.metrics,
            config.request_timeout_s,
            config.lora_adapters,
            config.pd.prefill_timeout_s,
            config.pd.lost_after_s,
            config.upstream_idle_timeout_s,
            config.limits,
            config.trust_request_chat_template,
            config.anthropic_disabled_thinking_effort,
        )
        self.proxy.max_model_len = config.max_model_len
        self.tiering: TierRunner | None = None
        if config.tiering is not None:
            self.tiering = TierRunner(
                config.tiering,
                self.index,
                self.workers,
                self.metrics.series,
                control_token=config.control_token,
            )
            self.metrics.on_request.append(self.tiering.observe)
        self._forwarder = Forwarder(
            self.proxy.upstream,
            self.proxy.drain,
            self.workers,
            self.proxy.served,
            self.metrics,
            self.proxy.timeouts,
        )
        self._health_task: asyncio.Task[None] | None = None
        self._loop_watch = LoopWatch(self.metrics.series.loop_lag, config.loop_stall_dump_s)
        self.app = web.Application(
            middlewares=[self._errors], client_max_size=config.limits.max_body_bytes
        )
        if config.cors_allowed_origins:  # none: nothing on the request path
            cors = Cors(config.cors_allowed_origins)
            self.app.middlewares.insert(0, cors.preflight)
            self.app.on_response_prepare.append(cors.on_prepare)
        self.app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/responses", self._responses),
                web.post(MESSAGES, self._messages),
                web.get(STORED_RESPONSE, self._forwarder.handle),
                web.post(STORED_RESPONSE + "/cancel", self._forwarder.handle),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/openapi.json", self._openapi),
                web.get("/warply/cache_stats", self._cache_stats),
                web.get("/warply/workers", self._workers),
                web.get("/warply/where", self._where),
                web.post("/warply/where", self._where),
                web.post("/warply/workers/{name}", self._set_worker),
                web.delete("/warply/workers/{name}", self._remove_worker),
                web.post("/warply/pools/{pool}/workers", self._add_worker),
                web.post("/warply/directives", self._directive),
                *(web.post(path, self._forwarder.handle) for path in FORWARDED_PATHS),
            ]
        )
        self._openapi_doc = openapi_document(config)
        self.app.on_startup.append(self._startup)
        self.app.on_shutdown.append(self._drain)
        self.app.on_cleanup.append(self._cleanup)

    # -- lifecycle -------------------------------------------------------------------------------

    async def _startup(self, _: web.Application) -> None:
        self._loop_watch.start()
        self.feed.start()
        self.ledger.start(lambda: [w.load for w in self.workers.values()])
        await self.feed.caught_up(_CATCH_UP_S)
        await self.check_health()
        served = await read_cards(self.proxy.session, self.workers.values(), self.config.model)
        self.tokenizer.engine = served.engine
        if self.proxy.max_model_len is None:
            self.proxy.max_model_len = served.max_model_len
        self._health_task = periodic(self.check_health, self.config.health_interval_s, "health")
        if self.tiering is not None:
            self.tiering.start()

    async def _drain(self, _: web.Application) -> None:
        """Stopping (the listener is closed): the requests in flight may finish for up to
        `drain_timeout_s`; those still open then end with a 503 (`router.drain`)."""
        timeout, drain = self.config.drain_timeout_s, self.proxy.drain
        if drain.in_flight:
            _log.info(
                "stopping: %d requests in flight, waiting up to %g s for them (drain_timeout_s)",
                drain.in_flight,
                timeout,
            )
        started, cut = await drain.run_out(timeout)
        if cut:
            _log.warning(
                "stopping: %d of %d requests still open after %g s were ended with a 503",
                cut,
                started,
                timeout,
            )
        elif started:
            _log.info("stopping: the %d requests in flight finished", started)

    async def _cleanup(self, _: web.Application) -> None:
        if self.tiering is not None:
            await self.tiering.stop()
        if self._health_task is not None:
            await cancel([self._health_task])
        await self._loop_watch.stop()
        await self.membership.stop()
        await self.feed.stop()
        await self.proxy.close()
        await self.ledger.close()
        await self.index.store.close()

    async def check_health(self) -> None:
        """Probe every worker's /health once (concurrently); drop the index entries of workers
        that refuse connections and of those whose stream went silent; check tokenizer parity
        with workers that turned healthy; then read the decode workers' KV transfer counters
        from their /metrics."""
        await self.workers.check(
            self.proxy.session, self.config.health_timeout_s, self.config.unhealthy_after
        )
        self._down.intersection_update(self.workers)  # workers that left meanwhile
        for w in list(self.workers.values()):
            if w.refused and w.name not in self._down:
                self._down.add(w.name)
                await self.feed.worker_down(w.name)
            elif w.healthy and w.name in self._down:
                self._down.discard(w.name)
                self.health.up(w.name)
        await self.feed.age_out()
        if self._probes is not None:
            pending = [
                w for w in self.workers.values() if w.healthy and self.health.needs_parity(w.name)
            ]
            await asyncio.gather(*(self._check_parity(w, self._probes) for w in pending))
        decode = [w for w in self.workers.values() if w.role == "decode" and w.healthy]
        if decode:
            await asyncio.gather(*(self._read_transfers(w) for w in decode))

    async def _check_parity(self, worker: Worker, probes: Probes) -> None:
        result, detail = await check_parity(self.proxy.session, worker.config.url, probes)
        self.health.parity_checked(worker.name, result, detail)

    def health_views(self) -> dict[str, IndexHealthView]:
        """Every worker's index health."""
        return {name: self.health.view(name) for name in self.workers}

    async def _read_transfers(self, worker: Worker) -> None:
        try:
            async with self.proxy.session.get(
                worker.config.url + "/metrics", timeout=_METRICS_TIMEOUT
            ) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return
        self.metrics.engine_transfers(worker.name, kv_transfer_stats(text))

    # -- middleware ------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Admin auth (`_auth`), then router errors, aiohttp's own (404 route, 405 method) and
        unexpected ones (500) in the OpenAI error shape, each counted in
        `warply_router_errors_total`. One middleware: each layer costs every request a call."""
        try:
            self._auth(request)
            return await handler(request)
        except ApiError as err:
            error = err
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            code = exc.reason.lower().replace(" ", "_")
            error = ApiError(exc.status, exc.reason, code, headers=allow)
        except Exception:
            # a router bug, not the client's mistake: logged with its traceback (not the body)
            _log.exception("unhandled error on %s %s", request.method, request.path)
            error = ApiError(500, "internal router error (logged)", "internal_error")
        self.metrics.error(error.status, error.code)
        return error.response(anthropic_shaped(request.path))

    def _auth(self, request: web.Request) -> None:
        """401 for an admin path without the configured Bearer token."""
        token = self.config.auth_token
        if token and request.path.startswith("/warply/"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                msg = "a valid 'Authorization: Bearer <token>' is required"
                raise ApiError(401, msg, "invalid_api_key")

    # -- client API ------------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.handle(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.handle(request, "chat")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.handle(request, "responses")

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.handle(request, "messages")

    async def _models(self, _: web.Request) -> web.Response:
        """The base model and its LoRA adapters (each with `parent`, as vLLM lists them)."""
        created = int(time.time())
        cards: list[dict[str, Any]] = []
        for name in (self.config.model, *self.config.lora_adapters):
            card: dict[str, Any] = {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "warply",
            }
            if name != self.config.model:
                card["parent"] = self.config.model
            if self.proxy.max_model_len is not None:
                card["max_model_len"] = self.proxy.max_model_len
            cards.append(card)
        return web.json_response({"object": "list", "data": cards})

    async def _health(self, _: web.Request) -> web.Response:
        healthy = sum(w.available for w in self.workers.values())
        status = 200 if healthy else 503
        body = {"status": "ok" if healthy else "no healthy worker", "healthy_workers": healthy}
        return web.json_response(body, status=status)

    async def _metrics(self, _: web.Request) -> web.Response:
        for name in self.workers:
            if (stream := self.feed.stream_stats(name)) is not None:
                self.metrics.stream_rejections(name, stream.rejected)
        body = self.metrics.render(
            await self.index.stats(), self.placement.strategy_state(), self.health_views()
        )
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def _openapi(self, _: web.Request) -> web.Response:
        return web.json_response(self._openapi_doc)

    # -- admin API -------------------------------------------------------------------------------

    async def cache_stats(self) -> CacheStats:
        """What `/warply/cache_stats` serves."""
        stats = self.metrics.cache_stats(
            await self.index.stats(), self.placement.strategy_state(), self.health_views()
        )
        if self.tiering is not None:
            stats.tiering = self.tiering.stats()
        return stats

    def worker_list(self) -> WorkerList:
        """What `/warply/workers` serves."""
        return WorkerList(
            [
                w.view(self.feed.stream_stats(w.name), self.health.view(w.name))
                for w in self.workers.values()
            ]
        )

    async def _cache_stats(self, _: web.Request) -> web.Response:
        return _json(await self.cache_stats())

    async def _workers(self, _: web.Request) -> web.Response:
        return _json(self.worker_list())

    async def _where(self, request: web.Request) -> web.Response:
        name = self.config.strategy.name
        return _json(await where(request, self.proxy, self.placement, self.workers, name))

    def _worker(self, name: str) -> Worker:
        worker = self.workers.get(name)
        if worker is None:
            raise ApiError(404, f"no worker named {name!r}", "worker_not_found")
        return worker

    async def _set_worker(self, request: web.Request) -> web.Response:
        worker = self._worker(request.match_info["name"])
        body = await read_object(request)
        enabled = body.get("enabled")
        if not isinstance(enabled, bool):
            raise ApiError(400, "'enabled' must be true or false", "invalid_value", "enabled")
        if other := sorted(set(body) - {"enabled"}):
            raise ApiError(400, f"unknown field {other[0]!r}", "invalid_value", other[0])
        if worker.leaving:
            raise ApiError(409, f"worker {worker.name!r} is leaving", "worker_leaving")
        worker.enabled = enabled
        return web.json_response({"name": worker.name, "enabled": worker.enabled})

    async def _add_worker(self, request: web.Request) -> web.Response:
        """A worker joins a pool (the body is a worker entry of the config file): 201 with its
        view; it takes requests once healthy."""
        body = await read_object(request)
        worker = self.membership.join(request.match_info["pool"], body)
        view = worker.view(self.feed.stream_stats(worker.name), self.health.view(worker.name))
        return web.Response(
            body=msgspec.json.encode(view), status=201, content_type="application/json"
        )

    async def _remove_worker(self, request: web.Request) -> web.Response:
        """A worker leaves: drained at once, removed when its in-flight requests end. 202 with
        their number; `?wait=true` waits for the removal (up to `request_timeout_s`): 200."""
        worker = self._worker(request.match_info["name"])
        wait = request.query.get("wait", "false")
        if wait not in ("true", "false"):
            raise ApiError(400, "'wait' must be true or false", "invalid_value", "wait")
        task = self.membership.leave(worker)
        if wait == "true":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), self.config.request_timeout_s)
        body = {"name": worker.name, "in_flight": worker.load.in_flight, "removed": task.done()}
        return web.json_response(body, status=200 if task.done() else 202)

    async def _directive(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        worker = self._worker(str(body.get("worker", "")))
        if not worker.config.control:
            raise ApiError(400, f"worker {worker.name!r} has no control endpoint", "no_control")
        try:
            directive = msgspec.convert(body.get("directive"), Directive)
        except (msgspec.ValidationError, ValueError) as exc:
            raise ApiError(400, f"invalid directive: {exc}", "invalid_value", "directive") from None
        try:
            ack = await send_directive(
                worker.config.control, directive, token=self.config.control_token
            )
        except TimeoutError as exc:
            raise ApiError(504, str(exc), "directive_timeout") from None
        return web.json_response(msgspec.structs.asdict(ack))

