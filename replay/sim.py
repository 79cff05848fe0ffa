"""Offline replay: the real router index and strategies over simulated engines, in simulated time.

For each trace request in arrival order: every simulated engine runs the scheduler passes that
start before the arrival; their cache events go into the router's real `PrefixIndex` over a
`MemoryStore` (driven synchronously with `completed`: its coroutines never suspend); the
strategy gets the request's canonical keys, the index's matches and each worker's load as the
router computes it (in-flight requests and tokens, engine waiting queue, KV usage); the request
joins the chosen engine. Nothing sleeps: time is the simulator's clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from replay.costmodel import CostModel
from replay.engine import EngineConfig, SimEngine, SimRequest
from replay.trace import ExpandedTrace
from router.index import MemoryStore, PrefixIndex, completed
from router.placement import predicted_cached
from router.strategies import RequestView, Strategy, WorkerLoad

Progress = Callable[[int], None]
"""Called with the number of requests placed since the last call."""


@dataclass(slots=True)
class ReplayResult:
    """Everything one replay of one strategy produced."""

    label: str
    workers: int
    requests: list[SimRequest]
    """Finished requests (simulator records: arrival, cached tokens, first token, finish)."""
    placement: dict[int, str]
    """Trace index → worker."""
    engines: dict[str, SimEngine]
    """The simulated engines, in their final state (caches, counters)."""
    index: PrefixIndex
    """The router index the engines fed (over a `MemoryStore`: read it with `completed`)."""
    decision_s: list[float]
    """Router decision time per request (index match + strategy), seconds."""
    rejected: int = 0
    """Requests too large for one engine's cache."""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    """CPU time of this process during the replay (the replay is single-threaded)."""


def _load(engine: SimEngine) -> WorkerLoad:
    return WorkerLoad(
        engine.name,
        in_flight=len(engine.running) + len(engine.waiting),
        in_flight_tokens=engine.live_prompt + engine.live_generated,
        engine_waiting=len(engine.waiting),
        kv_usage=engine.used_blocks / engine.cfg.num_blocks,
        pending_prefill_tokens=engine.pending_prefill,
        prefill_tokens_per_s=engine.prefill_tokens_per_s,
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
    """Replay `trace` through `strategy` over `workers` simulated engines."""
    if workers <= 0:
        raise ValueError("workers must be positive")
    cfg = config or EngineConfig()
    if cfg.block_size != trace.block_size:
        raise ValueError("engine and trace expansion must use the same block size")
    wall, cpu = time.perf_counter(), time.process_time()
    engines = [
        SimEngine(f"w{i}", trace.tokens, cfg, model() if model else None) for i in range(workers)
    ]
    by_name = {e.name: e for e in engines}
    index = PrefixIndex(trace.model, MemoryStore())
    placement: dict[int, str] = {}
    decisions: list[float] = []
    rejected = 0
    step = 0
    clock = time.perf_counter
    for i, req in enumerate(trace.requests):
        now = req.arrival_ms
        for e in engines:
            e.advance(now)
            if e.events:
                completed(index.apply(e.name, e.events))
                e.events.clear()
        if not engines[0].fits(req.input_length, req.output_length):
            rejected += 1
            continue
        keys = trace.keys[i]
        view = RequestView(keys, req.input_length, cfg.block_size)
        loads = [_load(e) for e in engines]
        t0 = clock()
        matches = completed(index.match(keys))
        name = strategy.choose(view, loads, matches)
        decisions.append(clock() - t0)
        placement[i] = name
        hit = predicted_cached(matches[name].blocks if name in matches else 0,
                               req.input_length, cfg.block_size)
        by_name[name].enqueue(SimRequest(i, now, req.input_length, req.output_length, keys,
                                         queued_prefill=req.input_length - hit))
        step += 1
        if progress and step == 256:
            progress(step)
            step = 0
    for e in engines:
        e.advance(float("inf"))
        if e.events:
            completed(index.apply(e.name, e.events))
            e.events.clear()
    if progress and step:
        progress(step)
    finished = sorted((r for e in engines for r in e.stats.finished), key=lambda r: r.index)
    return ReplayResult(
        label or strategy.name,
        workers,
        finished,
        placement,
        by_name,
        index,
        decisions,
        rejected,
        time.perf_counter() - wall,
        time.process_time() - cpu,
    )
