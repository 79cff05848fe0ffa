"""Placement: the request's key chain → index match → strategy choice. It only chooses; the
workers it chooses among (health, drain, load) live in `router.workers`.

One strategy instance per pool (pools differ in block size, so their key chains differ). With
several pools, each pool's strategy picks its worker and the pool whose pick holds the most
cached tokens wins (ties: the lower load).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from router.config import RouterConfig
from router.index import PrefixIndex, WorkerMatch
from router.strategies import NoCandidate, RequestView, Strategy, make_strategy
from router.workers import Worker, Workers
from warply.protocol import prefix_keys


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


def predicted_cached(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Cached tokens an engine reports for a prefix hit: full blocks, never the last token."""
    usable = max(0, prompt_tokens - 1) // block_size
    return min(matched_blocks, usable) * block_size


class Placement:
    """Chooses a worker per request among the available workers."""

    def __init__(self, config: RouterConfig, index: PrefixIndex, workers: Workers) -> None:
        self.model = config.model
        self.index = index
        self.workers = workers
        self._pools = [
            (pool.config.block_size, pool.workers, make_strategy(config.strategy))
            for pool in workers.pools
        ]

    async def choose(
        self,
        tokens: Sequence[int],
        namespace: str = "",
        prefix_reuse: bool = True,
        exclude: Collection[str] = (),
    ) -> Decision:
        """The placement for a prompt; raises `NoCandidate` when no worker may take it."""
        decision = await self._choose(tokens, len(tokens), namespace, prefix_reuse, exclude, False)
        assert decision is not None  # only early choices give up
        return decision

    async def choose_early(
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
        return await self._choose(tokens, prompt_tokens, namespace, prefix_reuse, exclude, True)

    async def _choose(
        self,
        tokens: Sequence[int],
        prompt_tokens: int,
        namespace: str,
        prefix_reuse: bool,
        exclude: Collection[str],
        early: bool,
    ) -> Decision | None:
        best: Decision | None = None
        picks: list[tuple[int, Strategy, Sequence[int], dict[str, WorkerMatch], list[Worker]]]
        picks = []
        for bs, members, strategy in self._pools:
            candidates = [w for w in members if w.available and w.name not in exclude]
            if not candidates:
                continue
            keys = prefix_keys(tokens, bs, self.model, namespace)
            matches = await self.index.match(keys, [w.name for w in candidates])
            if early and any(m.blocks >= len(keys) for m in matches.values()):
                return None
            picks.append((bs, strategy, keys, matches, candidates))
        for bs, strategy, chain, matches, candidates in picks:
            view = RequestView(chain, prompt_tokens, bs, namespace, prefix_reuse)
            name = strategy.choose(view, [w.load for w in candidates], matches)
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
