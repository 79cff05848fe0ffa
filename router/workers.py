"""Workers: membership (by pool and role), health, drain, role and load accounting.

Membership changes at runtime (`Workers.add`, `Workers.remove`) replace the name map and the
pool's member list instead of changing them in place: a loop over either that awaits part-way
goes on over the membership it started with.

Health comes from two places, both through `Worker.set_health`: the periodic `/health` probe
(`Workers.check`) and the proxy, which marks a worker unhealthy when it refuses a connection
(the next probe brings it back). A circuit breaker (`Breaker`) counts each worker's failed
requests in a row and takes it out of placement while open. Load per worker = the router's
own in-flight requests / tokens (`Worker.book` → `Booking`, one per request attempt) + the
engine's last `LoadSnapshot`; a shared ledger (`router.load`) hears of each
booking's start, first token and end (`Workers.watch`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import aiohttp

from router.config import BreakerConfig, PoolConfig, WorkerConfig
from router.strategies import WorkerLoad
from warply.protocol import LoadSnapshot
from warply.protocol.api import BreakerState, IndexHealthView, Role, StreamStats, WorkerView

_log = logging.getLogger("warply.router")


LoadChanged = Callable[[WorkerLoad], None]
"""Told when a booking starts, reaches its first token or ends (`LoadLedger.changed`)."""


class Breaker:
    """One worker's circuit breaker. `closed`: placed as usual. `open` after `failures` failed
    requests in a row: not placed for `open_s`. `half_open` then: placed only while it has no
    request in flight (one trial at a time); a success closes it, a failure opens it again."""

    __slots__ = ("_config", "_open_until", "failures", "trips")

    def __init__(self, config: BreakerConfig) -> None:
        self._config = config
        self.failures = 0
        """Failed requests in a row."""
        self.trips = 0
        """Times it opened."""
        self._open_until: float | None = None

    @property
    def state(self) -> BreakerState:
        if self._open_until is None:
            return "closed"
        return "open" if time.monotonic() < self._open_until else "half_open"

    def allows(self, in_flight: int) -> bool:
        """May placement choose the worker now (`in_flight`: its requests under way)?"""
        state = self.state
        return state == "closed" or (state == "half_open" and in_flight == 0)

    def succeeded(self) -> None:
        self.failures = 0
        self._open_until = None

    def failed(self, worker: str) -> None:
        self.failures += 1
        if self._open_until is not None or self.failures >= self._config.failures:
            if self._open_until is None or self.state == "half_open":
                self.trips += 1
                _log.warning(
                    "worker %s: circuit breaker open for %.1f s after %d failed requests",
                    worker, self._config.open_s, self.failures,
                )
            self._open_until = time.monotonic() + self._config.open_s


class Booking:
    """One request attempt's load on its worker, from placement until it ends."""

    __slots__ = ("_changed", "_load", "_open", "generated", "prefill_tokens", "prompt_tokens")

    def __init__(
        self,
        load: WorkerLoad,
        prompt_tokens: int,
        prefill_tokens: int,
        changed: LoadChanged | None = None,
    ) -> None:
        self._load = load
        self._changed = changed
        self.prompt_tokens = prompt_tokens
        self.prefill_tokens = prefill_tokens
        """Uncached prompt tokens: queued prefill until the first generated token."""
        self.generated = 0
        self._open = True
        load.in_flight += 1
        load.in_flight_tokens += prompt_tokens
        load.pending_prefill_tokens += prefill_tokens
        if changed is not None:
            changed(load)

    def progressed(self, tokens: int) -> None:
        """`tokens` more generated; the first one ends the request's prefill."""
        load = self._load
        load.in_flight_tokens += tokens
        if self.generated == 0 and tokens:
            load.pending_prefill_tokens -= self.prefill_tokens
            if self._changed is not None:
                self._changed(load)
        self.generated += tokens

    def release(self) -> None:
        """The attempt is done (or failed): give its load back (once)."""
        if not self._open:
            return
        self._open = False
        load = self._load
        load.in_flight -= 1
        load.in_flight_tokens -= self.prompt_tokens + self.generated
        if self.generated == 0:  # never streamed a token (non-streaming, or failed): still queued
            load.pending_prefill_tokens -= self.prefill_tokens
        if self._changed is not None:
            self._changed(load)


@dataclass(slots=True)
class Worker:
    """One engine server as the router tracks it."""

    config: WorkerConfig
    pool: PoolConfig
    load: WorkerLoad
    healthy: bool = False
    """Last health check (or request) succeeded."""
    enabled: bool = True
    """False while an admin drains it."""
    leaving: bool = False
    """Being removed: drained until its in-flight requests end, then dropped."""
    role: Role = "both"
    """What placement may send it: its pool's role (`prefill`, `decode` or `both`)."""
    snapshot: LoadSnapshot | None = None
    """The engine's last load snapshot (its own queues and KV capacity)."""
    unhealthy_since: float | None = None
    """`time.monotonic()` when it last turned unhealthy (None while healthy)."""
    refused: bool = False
    """Its last failure was a refused connection."""
    failed_probes: int = 0
    """`/health` probes failed in a row (not counting refused connections)."""
    breaker: Breaker = dataclasses.field(default_factory=lambda: Breaker(BreakerConfig()))
    changed: LoadChanged | None = None
    """Told of its bookings' changes (`Workers.watch`)."""

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def available(self) -> bool:
        return (
            self.healthy
            and self.enabled
            and not self.leaving
            and self.breaker.allows(self.load.in_flight)
        )

    def answered(self, ok: bool) -> None:
        """A request to this worker ended: answered (`ok`), or failed on the worker's side
        (refused, broken, timed out, 5xx); feeds its circuit breaker."""
        if ok:
            self.breaker.succeeded()
        else:
            self.breaker.failed(self.name)

    def set_health(self, healthy: bool, refused: bool = False) -> None:
        """The last probe or request succeeded, or failed (`refused`: nothing listens on the
        worker's port, as after a crash; otherwise it was slow, hung or answered an error)."""
        if healthy != self.healthy:
            _log.info("worker %s is %s", self.name, "healthy" if healthy else "unhealthy")
            self.unhealthy_since = None if healthy else time.monotonic()
        self.healthy = healthy
        self.refused = refused and not healthy

    def probed(self, ok: bool, refused: bool, unhealthy_after: int) -> None:
        """Apply one `/health` probe: a refused connection marks it unhealthy at once, other
        failures once `unhealthy_after` of them came in a row."""
        self.failed_probes = 0 if ok or refused else self.failed_probes + 1
        if ok or refused or self.failed_probes >= unhealthy_after:
            self.set_health(ok, refused)

    def lost(self, grace_s: float) -> bool:
        """Down for sure: refusing connections, or unhealthy for `grace_s` (a slow probe on a
        busy machine marks a live worker unhealthy for a moment)."""
        if self.healthy:
            return False
        since = self.unhealthy_since
        return self.refused or (since is not None and time.monotonic() - since >= grace_s)

    def book(self, prompt_tokens: int, prefill_tokens: int) -> Booking:
        """Count a request as in flight here, its uncached prompt as queued prefill."""
        return Booking(self.load, prompt_tokens, prefill_tokens, self.changed)

    def engine_load(self, snapshot: LoadSnapshot) -> None:
        """Apply an engine `LoadSnapshot`."""
        self.snapshot = snapshot
        self.load.engine_waiting = snapshot.waiting
        self.load.kv_usage = snapshot.kv_usage

    def view(self, stream: StreamStats | None, index: IndexHealthView) -> WorkerView:
        """This worker as `/warply/workers` shows it."""
        snap = self.snapshot
        return WorkerView(
            name=self.name,
            pool=self.pool.name,
            url=self.config.url,
            healthy=self.healthy,
            enabled=self.enabled,
            in_flight=self.load.in_flight,
            in_flight_tokens=self.load.in_flight_tokens,
            engine_waiting=self.load.engine_waiting,
            kv_usage=self.load.kv_usage,
            stream=stream,
            engine_running=snap.running if snap is not None else 0,
            kv_blocks_total=snap.kv_blocks_total if snap is not None else 0,
            role=self.role,
            failed_probes=self.failed_probes,
            kv_bytes_per_block=snap.kv_bytes_per_block if snap is not None else 0,
            leaving=self.leaving,
            breaker=self.breaker.state,
            breaker_trips=self.breaker.trips,
            index=index,
        )


@dataclass(slots=True)
class Pool:
    """Workers that share a block size, a KV layout and a role (`workers` is replaced, never
    changed in place, when one joins or leaves)."""

    config: PoolConfig
    workers: list[Worker]

    @property
    def role(self) -> Role:
        return self.config.role


def _load(worker: WorkerConfig, pool: PoolConfig) -> WorkerLoad:
    return WorkerLoad(
        worker.name,
        price_per_hour=pool.price_per_hour,
        prefill_tokens_per_s=pool.prefill_tokens_per_s or 0.0,
    )


class Workers(Mapping[str, Worker]):
    """Every configured worker by name (configuration order), and by pool."""

    def __init__(self, pools: list[PoolConfig], breaker: BreakerConfig | None = None) -> None:
        self.pools: list[Pool] = []
        self._by_name: dict[str, Worker] = {}
        self._breaker = breaker or BreakerConfig()
        self._changed: LoadChanged | None = None
        for pool in pools:
            members = [self._new(wc, pool) for wc in pool.workers]
            self.pools.append(Pool(pool, members))
            self._by_name.update((w.name, w) for w in members)

    def _new(self, config: WorkerConfig, pool: PoolConfig) -> Worker:
        worker = Worker(
            config, pool, _load(config, pool), role=pool.role, breaker=Breaker(self._breaker)
        )
        worker.changed = self._changed
        return worker

    def __getitem__(self, name: str) -> Worker:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def pool(self, name: str) -> Pool | None:
        """The pool named `name`, if any."""
        return next((p for p in self.pools if p.config.name == name), None)

    def watch(self, changed: LoadChanged) -> None:
        """Tell `changed` of every booking's changes, on every worker (joining ones too)."""
        self._changed = changed
        for worker in self._by_name.values():
            worker.changed = changed

    def add(self, pool: Pool, config: WorkerConfig) -> Worker:
        """A worker joining `pool` at runtime (unhealthy until its first probe succeeds); the
        caller checked that its name is free."""
        worker = self._new(config, pool.config)
        pool.workers = [*pool.workers, worker]
        self._by_name = {**self._by_name, worker.name: worker}
        return worker

    def remove(self, name: str) -> Worker:
        """Take a worker out of its pool and of the name map."""
        worker = self._by_name[name]
        for pool in self.pools:
            if worker in pool.workers:
                pool.workers = [w for w in pool.workers if w is not worker]
        self._by_name = {n: w for n, w in self._by_name.items() if n != name}
        return worker

    def engine_load(self, name: str, snapshot: LoadSnapshot) -> None:
        """Apply an engine `LoadSnapshot` (unknown names are ignored)."""
        worker = self._by_name.get(name)
        if worker is not None:
            worker.engine_load(snapshot)

    async def check(
        self, session: aiohttp.ClientSession, timeout_s: float, unhealthy_after: int
    ) -> None:
        """Probe every worker's /health once (concurrently); see `Worker.probed`."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        await asyncio.gather(
            *(self._probe(session, w, timeout, unhealthy_after) for w in self._by_name.values())
        )

    @staticmethod
    async def _probe(
        session: aiohttp.ClientSession,
        worker: Worker,
        timeout: aiohttp.ClientTimeout,
        unhealthy_after: int,
    ) -> None:
        refused = False
        try:
            async with session.get(worker.config.url + "/health", timeout=timeout) as resp:
                healthy = resp.status == 200
        except aiohttp.ClientConnectorError:  # nothing listens there
            healthy, refused = False, True
        except (aiohttp.ClientError, TimeoutError):
            healthy = False
        worker.probed(healthy, refused, unhealthy_after)
