"""Placement: the request's key chain → index match → strategy choice, plus per-worker load.

One strategy instance per pool (pools differ in block size, so their key chains differ). With
several pools, each pool's strategy picks its worker and the pool whose pick holds the most
cached tokens wins (ties: the lower load). Load per worker = the router's own in-flight
requests / tokens + the engine's last `LoadSnapshot`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from router.config import PoolConfig, RouterConfig, WorkerConfig
from router.index import PrefixIndex, WorkerMatch
from router.strategies import NoCandidate, RequestView, Strategy, WorkerLoad, make_strategy
from warply.protocol import prefix_keys


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

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def available(self) -> bool:
        return self.healthy and self.enabled


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes and what the index predicted for it there."""

    worker: Worker
    keys: Sequence[int]
    matched_blocks: int
    """Leading blocks of the prompt the chosen worker holds (index view)."""
    predicted_cached: int
    """Tokens the engine should report as cached (it always recomputes the last token)."""
    prompt_tokens: int
    namespace: str

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the engine is expected to compute (not served from its cache)."""
        return self.prompt_tokens - self.predicted_cached


@dataclass(slots=True)
class _Pool:
    config: PoolConfig
    strategy: Strategy
    workers: list[Worker] = field(default_factory=list)


def predicted_cached(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Cached tokens an engine reports for a prefix hit: full blocks, never the last token."""
    usable = max(0, prompt_tokens - 1) // block_size
    return min(matched_blocks, usable) * block_size


class Placement:
    """Chooses a worker per request and keeps the load the strategies see."""

    def __init__(self, config: RouterConfig, index: PrefixIndex) -> None:
        self.model = config.model
        self.index = index
        self.strategy_name = config.strategy.name
        self._pools = [_Pool(p, make_strategy(config.strategy)) for p in config.pools]
        self.workers: dict[str, Worker] = {}
        for pool in self._pools:
            for wc in pool.config.workers:
                worker = Worker(wc, pool.config, WorkerLoad(wc.name))
                pool.workers.append(worker)
                self.workers[wc.name] = worker

    def choose(
        self,
        tokens: Sequence[int],
        namespace: str = "",
        prefix_reuse: bool = True,
        exclude: Collection[str] = (),
    ) -> Decision:
        """The placement for a prompt; raises `NoCandidate` when no worker may take it."""
        decision = self._choose(tokens, len(tokens), namespace, prefix_reuse, exclude, False)
        assert decision is not None  # only early choices give up
        return decision

    def choose_early(
        self,
        tokens: Sequence[int],
        prompt_tokens: int,
        namespace: str = "",
        prefix_reuse: bool = True,
        exclude: Collection[str] = (),
    ) -> Decision | None:
        """The placement for a prompt of `prompt_tokens` tokens from its leading `tokens` alone;
        None when some worker holds every full block of them (the rest could extend its match,
        so the caller must tokenize the whole prompt and `choose`). Key chains are prefix
        hashes: once every worker's match has ended inside `tokens`, no later token changes it.
        """
        return self._choose(tokens, prompt_tokens, namespace, prefix_reuse, exclude, True)

    def _choose(
        self,
        tokens: Sequence[int],
        prompt_tokens: int,
        namespace: str,
        prefix_reuse: bool,
        exclude: Collection[str],
        early: bool,
    ) -> Decision | None:
        best: Decision | None = None
        picks: list[tuple[_Pool, Sequence[int], dict[str, WorkerMatch], list[Worker]]] = []
        for pool in self._pools:
            candidates = [w for w in pool.workers if w.available and w.name not in exclude]
            if not candidates:
                continue
            keys = prefix_keys(tokens, pool.config.block_size, self.model, namespace)
            matches = self.index.match(keys, [w.name for w in candidates])
            if early and any(m.blocks >= len(keys) for m in matches.values()):
                return None
            picks.append((pool, keys, matches, candidates))
        for pool, chain, matches, candidates in picks:
            bs = pool.config.block_size
            view = RequestView(chain, prompt_tokens, bs, namespace, prefix_reuse)
            name = pool.strategy.choose(view, [w.load for w in candidates], matches)
            worker = self.workers[name]
            blocks = matches.get(name, WorkerMatch(0, {})).blocks
            predicted = predicted_cached(blocks, prompt_tokens, bs)
            decision = Decision(worker, chain, blocks, predicted, prompt_tokens, namespace)
            if best is None or (decision.predicted_cached, -worker.load.load) > (
                best.predicted_cached,
                -best.worker.load.load,
            ):
                best = decision
        if best is None:
            raise NoCandidate("no healthy worker is available")
        return best

    def started(self, decision: Decision) -> None:
        """Count a request as in flight on its worker, its uncached prompt as queued prefill."""
        load = decision.worker.load
        load.in_flight += 1
        load.in_flight_tokens += decision.prompt_tokens
        load.pending_prefill_tokens += decision.prefill_tokens

    def progressed(self, decision: Decision, generated_before: int, tokens: int) -> None:
        """Generated tokens of an in-flight request; the first one ends its prefill."""
        load = decision.worker.load
        load.in_flight_tokens += tokens
        if generated_before == 0 and tokens:
            load.pending_prefill_tokens -= decision.prefill_tokens

    def finished(self, decision: Decision, generated: int) -> None:
        """The request is done (or failed): release its load."""
        load = decision.worker.load
        load.in_flight -= 1
        load.in_flight_tokens -= decision.prompt_tokens + generated
        if generated == 0:  # never streamed a token (non-streaming, or failed): still queued
            load.pending_prefill_tokens -= decision.prefill_tokens

    def engine_load(self, worker: str, waiting: int, kv_usage: float) -> None:
        """Apply an engine `LoadSnapshot`."""
        w = self.workers.get(worker)
        if w is not None:
            w.load.engine_waiting = waiting
            w.load.kv_usage = kv_usage
