"""Workers joining and leaving a running router (the admin API's POST
/warply/pools/{pool}/workers and DELETE /warply/workers/{name}).

A joining worker gets its load, its pool's role, a state-stream subscription (replay requested
as at start-up) and counters; it takes requests once the health loop finds it healthy. A
leaving one takes no new request at once; when its in-flight requests have ended, its stream is
stopped, its index entries dropped, and it is forgotten by the workers, the strategies and the
metrics. The router is one asyncio thread: every check and the update it guards run with no
await between them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import zmq
from pydantic import ValidationError

from router.config import WorkerConfig
from router.errors import ApiError
from router.feed import IndexFeed
from router.index import PrefixIndex, StoreUnavailable
from router.metrics import RouterMetrics
from router.placement import Placement
from router.tasks import cancel
from router.workers import Worker, Workers

_log = logging.getLogger("warply.router")
_DRAIN_POLL_S = 0.05
"""How often a leaving worker's in-flight count is looked at."""


def _worker_config(body: dict[str, Any]) -> WorkerConfig:
    """The joining worker's configuration, validated as in the config file; a 400 naming the
    first offending field otherwise."""
    try:
        return WorkerConfig.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(400, f"{field or 'worker'}: {err['msg']}", "invalid_value", field) from None


class Membership:
    """Adds and removes workers at runtime; owns the tasks that finish removals."""

    def __init__(
        self,
        workers: Workers,
        placement: Placement,
        feed: IndexFeed,
        index: PrefixIndex,
        metrics: RouterMetrics,
    ) -> None:
        self._workers = workers
        self._placement = placement
        self._feed = feed
        self._index = index
        self._metrics = metrics
        self._leaving: dict[str, asyncio.Task[None]] = {}

    def join(self, pool_name: str, body: dict[str, Any]) -> Worker:
        """Add the worker `body` describes to pool `pool_name`: 404 for an unknown pool, 400 for
        an invalid field, 409 when its name or its url is taken."""
        pool = self._workers.pool(pool_name)
        if pool is None:
            raise ApiError(404, f"no pool named {pool_name!r}", "pool_not_found")
        config = _worker_config(body)
        try:
            pool.config.check_worker(config)
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_value") from None
        if config.name in self._workers:
            raise ApiError(409, f"a worker named {config.name!r} exists", "worker_exists", "name")
        # as in the config file (one engine's requests and index entries would be split); a
        # leaving worker's url is free, for the engine that comes back under a new name
        for other in self._workers.values():
            if other.config.url == config.url and not other.leaving:
                msg = f"worker {other.name!r} has the url {config.url}"
                raise ApiError(409, msg, "worker_exists", "url")
        worker = self._workers.add(pool, config)
        try:
            self._feed.add(worker)
        except zmq.ZMQError as exc:
            self._workers.remove(worker.name)
            msg = f"events: cannot open {config.events!r}: {exc}"
            raise ApiError(400, msg, "invalid_value", "events") from None
        self._metrics.joined(worker.name)
        _log.info("worker %s joined pool %s", worker.name, pool_name)
        return worker

    def leave(self, worker: Worker) -> asyncio.Task[None]:
        """Drain `worker` now and remove it once its in-flight requests end (the task that does
        it; asking again returns the same task)."""
        task = self._leaving.get(worker.name)
        if task is None:
            worker.leaving = True
            task = asyncio.create_task(self._remove(worker), name=f"leave-{worker.name}")
            self._leaving[worker.name] = task
        return task

    async def _remove(self, worker: Worker) -> None:
        name = worker.name
        try:
            while worker.load.in_flight:
                await asyncio.sleep(_DRAIN_POLL_S)
            await self._feed.remove(name)
            try:
                await self._index.drop_worker(name)
            except StoreUnavailable as exc:  # its entries stay until the store's own cap
                self._index.outage.failed("drop_worker", exc)
            self._index.left(name)
            self._workers.remove(name)
            self._placement.forget(name)
            self._metrics.left(name)
            _log.info("worker %s left", name)
        finally:
            del self._leaving[name]

    async def stop(self) -> None:
        """Cancel removals still waiting for their requests (the router is shutting down)."""
        await cancel(self._leaving.values())
