"""Offline replay: the router's real index and placement over simulated engines, in simulated time.

For each trace request in arrival order: every simulated engine runs the scheduler passes that
start before the arrival (prefill engines first, then the hand-offs they finished, `replay.pd`,
then the engines that answer clients); their cache events go into the router's real
`PrefixIndex` over a `MemoryStore` (driven synchronously with `completed`: its coroutines never
suspend); each worker's load is set as the router computes it (in-flight requests and tokens,
engine waiting queue, KV usage); the router's `Placement` chooses from the prompt's tokens (a
worker, or a prefill / decode pair) with each pool's strategy; the request joins the chosen
engine(s). Aggregated serving is one `both` pool. Nothing sleeps: time is the simulator's clock.

The index may sit on another store (`simulate_pools(store=, drive=)`: e.g. a `RedisStore`, driven
by an event loop's `run_until_complete`); the engines' events of one step then go to it
concurrently, one call per worker at a time, as the router's feed sends them.

With `tiering`, the router's own `TierRunner` runs the configured tier policy every
`interval_s` of simulated time: it tracks each placed request's prefix, snapshots the index and
the workers' loads, calls the policy and delivers its directives to the simulated engines
(`SimEngine.apply`) instead of plugin sockets; their cache changes reach the index as events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from replay.costmodel import CostModel, ReferenceModel, Scaled
from replay.engine import EngineConfig, SimEngine, SimRequest
from replay.pd import REFERENCE_KV_BYTES_PER_TOKEN, Handoff, PdSettings, Served, Transfers
from replay.trace import ExpandedTrace, TraceRequest
from router.config import PoolConfig, RouterConfig, TieringConfig, WorkerConfig
from router.index import IndexStore, MemoryStore, PrefixIndex, completed
from router.metrics.registry import Series
from router.placement import Decision, Placement
from router.strategies import Strategy, WorkerLoad
from router.tiering import TierRunner
from router.workers import Workers
from warply.protocol import BlockRemoved, BlockStored, Directive, DirectiveAck, Event, LoadSnapshot
from warply.protocol.api import Role, TieringStats

Progress = Callable[[int], None]
"""Called with the number of requests placed since the last call."""
_T = TypeVar("_T")


class Drive(Protocol):
    """Runs one index coroutine to its end (`completed`, or an event loop's
    `run_until_complete` for a store that suspends)."""

    def __call__(self, coro: Coroutine[Any, Any, _T], /) -> _T: ...


@dataclass(frozen=True, slots=True)
class SimPool:
    """A pool of identical simulated workers (named `name` + 0, 1, ...) with its strategy."""

    name: str
    role: Role
    workers: int
    strategy: Strategy
    config: EngineConfig | None = None
    """Engine settings (None: the replay's)."""
    speed: float = 1.0
    """Pass times are the cost model's divided by this (faster or slower hardware)."""
    price_per_hour: float = 0.0
    """What one worker costs per hour (the pool's `price_per_hour`, for `cost_aware`)."""


@dataclass(slots=True)
class ReplayResult:
    """Everything one replay of one deployment produced."""

    label: str
    workers: int
    requests: list[SimRequest]
    """Finished requests as their answering engine saw them (arrival, cached tokens — for a
    hand-off the prefill engine's, as the client is told —, first token, finish)."""
    served: dict[int, Served]
    """Trace index → mode, workers, bytes moved P→D."""
    engines: dict[str, SimEngine]
    """The simulated engines, in their final state (caches, counters, busy time)."""
    index: PrefixIndex
    """The router index the engines fed (over a `MemoryStore` unless given another store: read
    that one with `completed`)."""
    decision_s: list[float]
    """Router decision time per request (keys, index match, strategies), seconds."""
    rejected: int = 0
    """Requests too large for one engine's cache."""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    """CPU time of this process during the replay (the replay is single-threaded)."""
    deployment: str = ""
    """The pools, e.g. `8` (aggregated) or `4P+4D`."""
    ingest_s: float = 0.0
    """Seconds spent applying the engines' events to the index."""
    ingested_blocks: int = 0
    """Blocks those events stored or removed."""
    tiering: TieringStats | None = None
    """The tier-policy runner's counters (None: no policy ran)."""

    @property
    def placement(self) -> dict[int, str]:
        """Trace index → the worker that answered."""
        return {i: s.worker for i, s in self.served.items()}


def _load(engine: SimEngine, pending: tuple[int, int], price: float) -> WorkerLoad:
    """The load the router sees, plus `pending` (requests, tokens) not yet on the engine."""
    return WorkerLoad(
        engine.name,
        in_flight=len(engine.running) + len(engine.waiting) + pending[0],
        in_flight_tokens=engine.live_prompt + engine.live_generated + pending[1],
        engine_waiting=len(engine.waiting),
        kv_usage=engine.used_blocks / engine.cfg.num_blocks,
        pending_prefill_tokens=engine.pending_prefill,
        prefill_tokens_per_s=engine.prefill_tokens_per_s,
        price_per_hour=price,
    )


def _blocks(event: Event) -> int:
    return len(event.block_hashes) if isinstance(event, (BlockStored, BlockRemoved)) else 0


def _snapshot(engine: SimEngine) -> LoadSnapshot:
    """The engine's `LoadSnapshot` (KV bytes per block at the replay's reference model)."""
    cfg = engine.cfg
    return LoadSnapshot(
        len(engine.running),
        len(engine.waiting),
        engine.used_blocks / cfg.num_blocks,
        cfg.num_blocks,
        cfg.block_size * REFERENCE_KV_BYTES_PER_TOKEN,
    )


def deployment(pools: Sequence[SimPool]) -> str:
    """`8` for one aggregated pool, else e.g. `4P+4D` (roles' initials, `B` for both)."""
    if len(pools) == 1 and pools[0].role == "both":
        return str(pools[0].workers)
    return "+".join(f"{p.workers}{'B' if p.role == 'both' else p.role[0].upper()}" for p in pools)


class _Fleet:
    """The simulated engines of every pool, the router's view of them, and the hand-offs."""

    def __init__(
        self,
        trace: ExpandedTrace,
        pools: Sequence[SimPool],
        config: EngineConfig,
        model: Callable[[], CostModel] | None,
        pd: PdSettings,
        ranker: Strategy | None,
        store: IndexStore | None = None,
        drive: Drive = completed,
        tiering: TieringConfig | None = None,
    ) -> None:
        self._next_round = 0.0
        self._loop = asyncio.new_event_loop()
        router = RouterConfig(
            model=trace.model,
            tokenizer=Path("."),
            pools=[
                PoolConfig(
                    name=p.name,
                    block_size=trace.block_size,
                    role=p.role,
                    price_per_hour=p.price_per_hour,
                    workers=[
                        WorkerConfig(name=f"{p.name}{j}", url=f"http://{p.name}{j}.replay.invalid")
                        for j in range(p.workers)
                    ],
                )
                for p in pools
            ],
            pd=pd.router(),
        )
        self.workers = Workers(router.pools)
        self.engines: dict[str, SimEngine] = {}
        self._heads: list[SimEngine] = []
        for pool in pools:
            cfg = pool.config or config
            if cfg.block_size != trace.block_size:
                raise ValueError("engine and trace expansion must use the same block size")
            for j in range(pool.workers):
                base = model() if model else ReferenceModel()
                cost = base if pool.speed == 1 else Scaled(base, pool.speed)
                name = f"{pool.name}{j}"
                self.engines[name] = SimEngine(name, trace.tokens, cfg, cost)
                self.workers[name].set_health(True)
            self._heads.append(self.engines[f"{pool.name}0"])
        self.prefill = [e for e in self.engines.values() if self.workers[e.name].role == "prefill"]
        """Prefill engines (with `pd.prefill_answers` they also answer some requests whole)."""
        self.answering = [e for e in self.engines.values() if e not in self.prefill]
        """Engines that answer clients (aggregated and decode workers)."""
        self.index = PrefixIndex(trace.model, store or MemoryStore())
        self.drive = drive
        self._together = drive is not completed
        """Apply the workers' events concurrently (a store that suspends, as the router's feed)."""
        self.ingest_s = 0.0
        self.ingested_blocks = 0
        self.placement = Placement(
            router, self.index, self.workers, {p.name: p.strategy for p in pools}, ranker
        )
        self.transfers = Transfers(pd, trace.block_size)
        self.now_ms = 0.0
        self.tiering = (
            None
            if tiering is None
            else TierRunner(
                tiering,
                self.index,
                self.workers,
                Series(),
                clock=lambda: self.now_ms / 1000,
                deliver=self._deliver,
            )
        )

    async def _deliver(self, worker: str, directive: Directive) -> DirectiveAck:
        return self.engines[worker].apply(directive, self.now_ms)

    def advance_to(self, at_ms: float) -> None:
        """Advance to `at_ms`, running the tier-policy rounds due before it at their times."""
        runner = self.tiering
        if runner is not None:
            step = runner.config.interval_s * 1000
            while self._next_round + step <= at_ms:
                self._next_round += step
                self.now_ms = self._next_round
                self.advance(self.now_ms)
                self.observe(snapshots=True)
                self._loop.run_until_complete(runner.round())
        self.now_ms = max(self.now_ms, at_ms)
        self.advance(at_ms)

    def advance(self, horizon: float) -> None:
        """Run everything that starts before `horizon`; the index sees the engines' events."""
        for e in self.prefill:
            e.advance(horizon)
        self.transfers.run(horizon)
        for e in self.answering:
            e.advance(horizon)
        batches = [(e.name, list(e.events)) for e in self.engines.values() if e.events]
        if not batches:
            return
        for e in self.engines.values():
            e.events.clear()
        t0 = time.perf_counter()
        self.drive(self._apply(batches))
        self.ingest_s += time.perf_counter() - t0
        self.ingested_blocks += sum(_blocks(ev) for _, evs in batches for ev in evs)

    async def _apply(self, batches: list[tuple[str, list[Event]]]) -> None:
        if self._together:
            await asyncio.gather(*(self.index.apply(name, evs) for name, evs in batches))
            return
        for name, evs in batches:
            await self.index.apply(name, evs)

    def fits(self, req: TraceRequest) -> bool:
        return all(e.fits(req.input_length, req.output_length) for e in self._heads)

    def observe(self, snapshots: bool = False) -> None:
        """Set every worker's load from its engine (and the hand-offs bound for it); with
        `snapshots`, also the engine load snapshots tier policies read."""
        pending = self.transfers.pending
        for name, e in self.engines.items():
            worker = self.workers[name]
            worker.load = _load(e, pending(name), worker.pool.price_per_hour)
            if snapshots:
                worker.engine_load(_snapshot(e))

    def close(self) -> None:
        self._loop.close()

    def start(self, i: int, req: TraceRequest, keys: list[int], d: Decision) -> Served:
        """Send request `i` where `d` says: to its answering engine, or through a hand-off."""
        engine, now = self.engines[d.worker.name], req.arrival_ms
        sized = (i, now, req.input_length, req.output_length, keys)
        leg = d.prefill
        if leg is None:
            engine.enqueue(SimRequest(*sized, queued_prefill=d.prefill_tokens))
            return Served(d.mode, engine.name)
        served = Served(d.mode, engine.name, leg.worker.name)
        self.transfers.start(
            Handoff(
                self.engines[leg.worker.name],
                engine,
                SimRequest(i, now, req.input_length, 1, keys, queued_prefill=leg.prefill_tokens),
                SimRequest(
                    *sized, queued_prefill=0, pulled=True,
                    evict_first=self.transfers.settings.drop_pulled,
                ),  # fmt: skip
                served,
            )
        )
        return served


def simulate_pools(
    trace: ExpandedTrace,
    pools: Sequence[SimPool],
    label: str,
    config: EngineConfig | None = None,
    model: Callable[[], CostModel] | None = None,
    progress: Progress | None = None,
    pd: PdSettings | None = None,
    ranker: Strategy | None = None,
    store: IndexStore | None = None,
    drive: Drive = completed,
    tiering: TieringConfig | None = None,
) -> ReplayResult:
    """Replay `trace` over simulated `pools` (roles `both`, or `prefill` + `decode`); `ranker`
    compares the pools' picks (None: as the router's default strategy does); `store` holds the
    index (default: a new `MemoryStore`), its coroutines run by `drive`; `tiering` runs a tier
    policy over the simulated engines (see the module docstring)."""
    if not pools or min(p.workers for p in pools) <= 0:
        raise ValueError("every pool needs a positive number of workers")
    wall, cpu = time.perf_counter(), time.process_time()
    fleet = _Fleet(
        trace, pools, config or EngineConfig(), model, pd or PdSettings(), ranker, store, drive,
        tiering,
    )
    served: dict[int, Served] = {}
    decisions: list[float] = []
    rejected = 0
    step = 0
    clock = time.perf_counter
    choose, drive = fleet.placement.choose, fleet.drive
    for i, req in enumerate(trace.requests):
        fleet.advance_to(req.arrival_ms)
        if not fleet.fits(req):
            rejected += 1
            continue
        fleet.observe()
        tokens = trace.tokens(i)  # numpy: `prefix_keys` packs it without a Python loop
        t0 = clock()
        decision = drive(choose(cast(Sequence[int], tokens)))
        decisions.append(clock() - t0)
        if fleet.tiering is not None:
            fleet.tiering.track(decision)
        served[i] = fleet.start(i, req, trace.keys[i], decision)
        step += 1
        if progress and step == 256:
            progress(step)
            step = 0
    fleet.advance(float("inf"))
    fleet.close()
    if progress and step:
        progress(step)
    answered = [r for e in fleet.answering for r in e.stats.finished]
    answered += [  # requests a prefill worker answered whole (`pd.prefill_answers`), not legs
        r for e in fleet.prefill for r in e.stats.finished if served[r.index].mode == "on_prefill"
    ]
    finished = sorted(answered, key=lambda r: r.index)
    return ReplayResult(
        label,
        sum(p.workers for p in pools),
        finished,
        served,
        fleet.engines,
        fleet.index,
        decisions,
        rejected,
        time.perf_counter() - wall,
        time.process_time() - cpu,
        deployment(pools),
        fleet.ingest_s,
        fleet.ingested_blocks,
        fleet.tiering.stats() if fleet.tiering is not None else None,
    )


def simulate(
    trace: ExpandedTrace,
    strategy: Strategy,
    workers: int,
    label: str | None = None,
    config: EngineConfig | None = None,
    model: Callable[[], CostModel] | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay `trace` through `strategy` over `workers` aggregated simulated engines."""
    if workers <= 0:
        raise ValueError("workers must be positive")
    pool = SimPool("w", "both", workers, strategy)
    return simulate_pools(trace, [pool], label or strategy.name, config, model, progress)
