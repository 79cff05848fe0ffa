"""Placement: the request's key chain → index match → strategy choice. It only chooses; the
workers it chooses among (health, drain, load) live in `router.workers`, and the requests are
sent by `router.dispatch`.

One strategy instance per pool (pools differ in block size, so their key chains differ). The
pools that answer clients (roles `both` and `decode`) compete: each pool's strategy picks its
worker and the router's strategy compares the picks (`Strategy.prefer`: by default the most
cached tokens wins, ties the lower load; `cost_aware` weighs price and wait). When the winner
is a `decode` worker, the request is handed off (`Decision.prefill`): the prefill pools pick
their worker the same way (cached prefix, tier-aware), unless fewer than
`pd.local_prefill_tokens` prompt tokens are missing on the decode worker (conditional
disaggregation), or (`pd.local_prefill_by: cost`) the decode worker's predicted time to first
token beats the hand-off's (`local_cheaper`), or no prefill worker is available; then the
decode worker prefills locally. With `pd.prefill_answers` the prefill workers also stand among
a decode pool's candidates, and a pick of one runs the whole request there (`on_prefill`).
SGLang decode workers cannot prefill alone (`PoolConfig.local_prefill`): they always get a
prefill worker, and compete only while one is available.
A network index store that cannot answer never stops placement: its workers then count as
holding nothing (load decides), and the failure is counted in `PrefixIndex.outage`. Matches are
weighed by each worker's index health (`IndexHealth.trim`): a degraded worker's match counts
for half its blocks, a fallback worker's for none.

`explain` runs the same choice without changing anything (no strategy state, no turn taken):
each pool's strategy previews its pick with the scores behind it (`Strategy.preview`), for
`/warply/where`.

A prompt that repeats one placed before (a conversation's next turn: `Lineage` from the chunk
cache) extends that prompt's key chain instead of hashing its history again; chains are kept
per (prompt, block size, namespace), at most `CHAIN_KEYS` keys in all, least recently used
dropped first. An early placement hashes only the prompt's leading part; once the rest is
tokenized (off the request's path), `whole` extends the kept chain to the whole prompt, so the
next turn hashes only its own new blocks.

The candidates' loads come from a `LoadLedger` (`router.load`): this router's own bookings, plus
other replicas' when they share them, read concurrently with the index match.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from router.config import PdConfig, RouterConfig
from router.index import PrefixIndex, WorkerMatch
from router.index_health import IndexHealth
from router.load import LoadLedger, LocalLedger
from router.strategies import (
    NO_MATCH,
    NoCandidate,
    Pick,
    RequestView,
    Score,
    Strategy,
    WorkerLoad,
    make_strategy,
)
from router.token_cache import Lineage
from router.workers import Pool, Worker, Workers
from warply.protocol import chain_keys, prefix_keys, root_seed
from warply.protocol.api import Role, StrategyState

Mode = Literal["aggregated", "remote", "local", "on_prefill"]
"""How a request is served: by a `both` worker alone; prefilled on a prefill worker and decoded
on a decode worker; prefilled and decoded on a decode worker; or prefilled and decoded on a
prefill worker (`pd.prefill_answers`)."""

CHAIN_KEYS = 1 << 20
"""Keys kept of recent prompts' chains (~40 MiB), for their next turns to extend."""

LocalReason = Literal[
    "", "below_threshold", "cheaper_local", "no_prefill_worker", "prefill_failed", "batch",
    "responses", "messages",
]  # fmt: skip
"""Why a decode worker prefills a request itself ("" unless the mode is `local`);
`cheaper_local`: its predicted time to first token beats the hand-off's (`pd.local_prefill_by:
cost`); `batch`: the request has several prompts or asks for several choices, which one
hand-off cannot carry; `responses` / `messages`: a Responses or Anthropic Messages API request,
which the router does not hand off to vLLM (its prefill leg would need that API's own one-token
form)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes and what the index predicted for it there."""

    worker: Worker
    """The worker that answers the client (an aggregated or a decode worker)."""
    keys: Sequence[int]
    matched_blocks: int
    """Leading blocks of the prompt the chosen worker holds (index view)."""
    predicted_cached: int
    """Tokens of the prompt the chosen worker holds as full blocks, minus the last token (which
    an engine always recomputes): its cached tokens if it prefills the prompt itself."""
    index_cached: int
    """`predicted_cached` as the index itself has it, before index health's caution
    (`IndexHealth.trim`) cut the match: what the engine's report tells the index's accuracy
    by."""
    prompt_tokens: int
    namespace: str
    prefill: Decision | None = None
    """The prefill worker's leg of a hand-off (None: `worker` prefills the prompt itself)."""
    local_reason: LocalReason = ""

    @property
    def mode(self) -> Mode:
        if self.prefill is not None:
            return "remote"
        role = self.worker.role
        return "local" if role == "decode" else "on_prefill" if role == "prefill" else "aggregated"

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens `worker` is expected to compute (0 when another worker prefills)."""
        return 0 if self.prefill is not None else self.prompt_tokens - self.predicted_cached

    @property
    def reported_cached(self) -> int:
        """Cached tokens the client's usage should report: the tokens no engine computed for
        this request (the prefill worker's hit in a hand-off)."""
        leg = self.prefill
        return leg.predicted_cached if leg is not None else self.predicted_cached

    @property
    def missing_tokens(self) -> int:
        """Prompt tokens `worker` does not hold (a hand-off transfers these)."""
        return self.prompt_tokens - self.predicted_cached

    def local(self, reason: LocalReason) -> Decision:
        """This decision with the decode worker prefilling the prompt itself."""
        return dataclasses.replace(self, prefill=None, local_reason=reason)


def predicted_cached(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Cached tokens an engine reports for a prefix hit: full blocks, never the last token."""
    usable = max(0, prompt_tokens - 1) // block_size
    return min(matched_blocks, usable) * block_size


def local_cheaper(decode: Decision, prefill: Decision, pd: PdConfig) -> bool:
    """Conditional disaggregation by cost: the decode worker's predicted time to first token if
    it prefills the prompt itself is no more than the hand-off's, both in prefill tokens:

        local  = queued(decode) + missing(decode)
        remote = queued(prefill) + missing(prefill) + transfer_weight · missing(decode)
                 + handoff_tokens
    """
    local = decode.worker.load.pending_prefill_tokens + decode.missing_tokens
    remote = (
        prefill.worker.load.pending_prefill_tokens + prefill.missing_tokens
        + pd.transfer_weight * decode.missing_tokens + pd.handoff_tokens
    )  # fmt: skip
    return local <= remote


@dataclass(frozen=True, slots=True)
class PoolTrace:
    """What one pool saw of a request in `Placement.explain`."""

    pool: str
    role: Role
    strategy: str
    block_size: int
    keys: Sequence[int]
    held: dict[str, WorkerMatch]
    """Every member's match, available or not, in the pool's order."""
    pick: str | None = None
    """The pool strategy's pick (None: the pool was not asked, or had no available worker)."""
    scores: dict[str, Score] = dataclasses.field(default_factory=dict)
    """The candidates' scores behind the pick (`Strategy.explain`; empty if it explains none)."""


@dataclass(frozen=True, slots=True)
class Explanation:
    """`Placement.explain`: where a prompt would go, and why."""

    decision: Decision | None
    unavailable: str
    """Why no worker would take it ("" when `decision` is set)."""
    pools: list[PoolTrace]


@dataclass(frozen=True, slots=True)
class _Pool:
    name: str
    block_size: int
    members: Pool
    """The workers' pool (its member list changes as workers join and leave)."""
    strategy: Strategy
    local_prefill: bool
    """Its workers can prefill a prompt themselves (`PoolConfig.local_prefill`)."""

    @property
    def workers(self) -> list[Worker]:
        return self.members.workers


class _GiveUp(Exception):
    """An early choice gives up: some worker's match reaches the end of the leading part."""


class Placement:
    """Chooses a worker (or a prefill / decode pair) per request among the available workers."""

    def __init__(
        self,
        config: RouterConfig,
        index: PrefixIndex,
        workers: Workers,
        strategies: Mapping[str, Strategy] | None = None,
        ranker: Strategy | None = None,
        health: IndexHealth | None = None,
        ledger: LoadLedger | None = None,
    ) -> None:
        """`strategies`: pool name → the strategy instance to use instead of one built from the
        config (the trace replayer passes its own, baselines included); `ranker`: the one that
        compares the pools' picks instead of the router's `strategy`; `health`: how far each
        worker's matches are trusted (None: fully); `ledger`: where the candidates' loads are
        read (default: this router's own bookings)."""
        self.model = config.model
        self.index = index
        self.health = health
        self.workers = workers
        self.ledger = ledger or LocalLedger()
        self.pd = config.pd
        self._ranker = ranker or make_strategy(config.strategy)
        """The router's strategy compares the pools' picks (`Strategy.prefer`)."""
        self._answer: list[_Pool] = []
        self._prefill: list[_Pool] = []
        for pool in workers.pools:
            strategy = (strategies or {}).get(pool.config.name)
            if strategy is None:
                strategy = make_strategy(pool.config.strategy or config.strategy)
            cfg = pool.config
            entry = _Pool(cfg.name, cfg.block_size, pool, strategy, cfg.local_prefill)
            (self._prefill if pool.role == "prefill" else self._answer).append(entry)
        self._chains: OrderedDict[tuple[int, int, str], list[int]] = OrderedDict()
        """(prompt ident, block size, namespace) -> its key chain (`Lineage`)."""
        self._chain_keys = 0

    def keys(
        self, tokens: Sequence[int], block_size: int, namespace: str, lineage: Lineage | None
    ) -> list[int]:
        """The prompt's key chain: the earlier prompt's chain extended over the tokens past
        what they share, when it is still kept; else hashed from the start."""
        base = None
        if lineage is not None and lineage.base:
            base = self._chains.get((lineage.base, block_size, namespace))
        if base is None:
            keys = prefix_keys(tokens, block_size, self.model, namespace)
        else:
            n = min(len(base), lineage.shared // block_size) if lineage else 0
            keys = self._extended(base[:n], tokens, block_size, namespace)
        if lineage is not None:
            self._keep((lineage.ident, block_size, namespace), keys)
        return keys

    def whole(self, tokens: Sequence[int], namespace: str, lineage: Lineage | None) -> None:
        """An early-placed prompt's whole `tokens`: the chains kept for its leading part are
        extended over them (a new list: decisions hold the old one)."""
        if lineage is None:
            return
        for block_size in {pool.block_size for pool in (*self._answer, *self._prefill)}:
            slot = (lineage.ident, block_size, namespace)
            keys = self._chains.get(slot)
            if keys is None or len(keys) >= len(tokens) // block_size:
                continue
            self._keep(slot, self._extended(keys, tokens, block_size, namespace))

    def _extended(
        self, head: list[int], tokens: Sequence[int], block_size: int, namespace: str
    ) -> list[int]:
        """`head`, the chain of `tokens`' first blocks, extended over the rest of them (a new
        list)."""
        seed = head[-1] if head else root_seed(self.model, namespace)
        return head + chain_keys(tokens[len(head) * block_size :], block_size, seed)

    def _keep(self, slot: tuple[int, int, str], keys: list[int]) -> None:
        """Keep `keys` as the chain of `slot`, the least recently kept dropped past the cap."""
        chains = self._chains
        old = chains.pop(slot, None)
        self._chain_keys += len(keys) - (len(old) if old is not None else 0)
        chains[slot] = keys
        while self._chain_keys > CHAIN_KEYS:
            self._chain_keys -= len(chains.popitem(last=False)[1])

    def forget(self, worker: str) -> None:
        """`worker` left: every strategy drops what it kept for it (`Strategy.forget`)."""
        for pool in (*self._answer, *self._prefill):
            pool.strategy.forget(worker)
        self._ranker.forget(worker)

    def strategy_state(self) -> dict[str, StrategyState]:
        """Per pool, what its strategy measures of itself (for metrics)."""
        return {
            pool.name: StrategyState(pool.strategy.gauges(), pool.strategy.worker_gauges())
            for pool in (*self._answer, *self._prefill)
        }

    async def choose(
        self,
        tokens: Sequence[int],
        namespace: str = "",
        prefix_reuse: bool = True,
        exclude: Collection[str] = (),
        lineage: Lineage | None = None,
        prompt_tokens: int | None = None,
    ) -> Decision:
        """The placement for a prompt; raises `NoCandidate` when no worker may take it.
        `prompt_tokens`: its length, when `tokens` are not the whole prompt (none of it for a
        prompt the router cannot tokenize the engine's way, one with images: placed by length
        and load alone)."""
        whole = len(tokens) if prompt_tokens is None else prompt_tokens
        decision = await self._choose(
            tokens, whole, namespace, prefix_reuse, exclude, False, lineage
        )
        assert decision is not None  # only early choices give up
        return decision

    async def choose_early(
        self,
        tokens: Sequence[int],
        prompt_tokens: int,
        namespace: str = "",
        prefix_reuse: bool = True,
        exclude: Collection[str] = (),
        lineage: Lineage | None = None,
    ) -> Decision | None:
        """The placement for a prompt of `prompt_tokens` tokens from its leading `tokens` alone;
        None when some worker holds every full block of them (the rest could extend its match,
        so the caller must tokenize the whole prompt and `choose`). Key chains are prefix
        hashes: once every worker's match has ended inside `tokens`, no later token changes it.
        """
        return await self._choose(
            tokens, prompt_tokens, namespace, prefix_reuse, exclude, True, lineage
        )

    async def explain(
        self, tokens: Sequence[int], namespace: str = "", prefix_reuse: bool = True
    ) -> Explanation:
        """The placement `choose` would make for a prompt now, with every pool's holdings and
        its strategy's scores; changes no state (the strategies only preview their pick)."""
        picks: dict[str, tuple[str, dict[str, Score]]] = {}
        try:
            decision = await self._choose(
                tokens, len(tokens), namespace, prefix_reuse, (), False, None, picks
            )
            unavailable = ""
        except NoCandidate as exc:
            decision, unavailable = None, str(exc)
        # block size -> the prompt's key chain: the decision's legs' own, else hashed once here
        chains: dict[int, Sequence[int]] = {}
        if decision is not None:
            for leg in (decision, decision.prefill):
                if leg is not None:
                    chains[leg.worker.pool.block_size] = leg.keys
        pools = []
        for pool in (*self._answer, *self._prefill):
            keys = chains.get(pool.block_size)
            if keys is None:
                keys = chains[pool.block_size] = prefix_keys(
                    tokens, pool.block_size, self.model, namespace
                )
            found = await self.index.match(keys, [w.name for w in pool.workers])
            held = {w.name: found.get(w.name, NO_MATCH) for w in pool.workers}
            pick, scores = picks.get(pool.name, (None, {}))
            pools.append(
                PoolTrace(
                    pool.name, pool.members.role, pool.strategy.name, pool.block_size, keys,
                    held, pick, scores,
                )  # fmt: skip
            )
        return Explanation(decision, unavailable, pools)

    async def _choose(
        self,
        tokens: Sequence[int],
        prompt_tokens: int,
        namespace: str,
        prefix_reuse: bool,
        exclude: Collection[str],
        early: bool,
        lineage: Lineage | None,
        previews: dict[str, tuple[str, dict[str, Score]]] | None = None,
    ) -> Decision | None:
        """`lineage`: the earlier prompt this one extends (its key chain is extended);
        `previews`: given, strategies only preview their picks, which land there by pool."""
        args = (tokens, prompt_tokens, namespace, prefix_reuse, exclude, early, lineage, previews)
        answer = self._answer
        if not any(w.available and w.name not in exclude for p in self._prefill for w in p.workers):
            answer = [pool for pool in answer if pool.local_prefill]
        elif self.pd.prefill_answers:
            answer = [self._with_prefill(pool) for pool in answer]
        try:
            best = await self._best(answer, *args)
            if best is None:
                dropped = [p for p in self._answer if p not in answer]
                if any(w.available and w.name not in exclude for p in dropped for w in p.workers):
                    raise NoCandidate(
                        "no prefill worker is available, and the decode workers cannot prefill "
                        "alone (SGLang disaggregation mode)"
                    )
                raise NoCandidate("no healthy worker is available")
            if best.worker.role != "decode":
                return best
            local = best.worker.pool.local_prefill
            if local and best.missing_tokens < self.pd.local_prefill_tokens:
                return best.local("below_threshold")
            if local and self.pd.local_prefill_by == "cost":
                # the prefill pool's pick previewed (no state changes) unless it goes remote
                shown = {} if previews is None else previews
                leg = await self._best(self._prefill, *args[:-1], shown)
                if leg is not None and local_cheaper(best, leg, self.pd):
                    return best.local("cheaper_local")
            leg = await self._best(self._prefill, *args)
        except _GiveUp:
            return None
        if leg is None:
            return best.local("no_prefill_worker")
        return dataclasses.replace(best, prefill=leg)

    def _with_prefill(self, pool: _Pool) -> _Pool:
        """`pd.prefill_answers`: a decode pool whose candidates include the prefill workers of
        its block size, so its strategy chooses where the request runs whole among them all, as
        among aggregated workers; the other pools as they are. (The config allows the setting
        only on vLLM pools, whose prefill workers decode and decode workers prefill.)"""
        if pool.members.role != "decode":
            return pool
        extra = [w for p in self._prefill if p.block_size == pool.block_size for w in p.workers]
        members = Pool(pool.members.config, pool.workers + extra)
        return dataclasses.replace(pool, members=members)

    async def _best(
        self,
        pools: list[_Pool],
        tokens: Sequence[int],
        prompt_tokens: int,
        namespace: str,
        prefix_reuse: bool,
        exclude: Collection[str],
        early: bool,
        lineage: Lineage | None,
        previews: dict[str, tuple[str, dict[str, Score]]] | None,
    ) -> Decision | None:
        """Each pool's pick; the router's strategy prefers one (`Strategy.prefer`).
        None: no available worker. Raises `_GiveUp` when an early choice must see the whole
        prompt."""
        picks: list[
            tuple[
                _Pool,
                Sequence[int],
                dict[str, WorkerMatch],
                list[Worker],
                Sequence[WorkerLoad],
                dict[str, WorkerMatch],
            ]
        ] = []
        for pool in pools:
            candidates = [w for w in pool.workers if w.available and w.name not in exclude]
            if not candidates:
                continue
            keys = self.keys(tokens, pool.block_size, namespace, lineage)
            matches, loads = await self._read(keys, candidates)
            indexed = matches
            if self.health is not None:
                matches = self.health.trim(matches)
            if early and any(m.blocks >= len(keys) for m in matches.values()):
                raise _GiveUp
            picks.append((pool, keys, matches, candidates, loads, indexed))
        options: list[tuple[Decision, Pick]] = []
        for pool, chain, matches, candidates, loads, indexed in picks:
            bs = pool.block_size
            view = RequestView(chain, prompt_tokens, bs, namespace, prefix_reuse)
            if previews is None:
                name = pool.strategy.choose(view, loads, matches)
            else:
                name, scores = pool.strategy.preview(view, loads, matches)
                previews[pool.name] = (name, scores)
            i = next(i for i, w in enumerate(candidates) if w.name == name)
            worker = candidates[i]
            match = matches.get(name, NO_MATCH)
            predicted = predicted_cached(match.blocks, prompt_tokens, bs)
            held = predicted_cached(indexed.get(name, NO_MATCH).blocks, prompt_tokens, bs)
            decision = Decision(
                worker, chain, match.blocks, predicted, held, prompt_tokens, namespace
            )
            options.append((decision, Pick(view, loads[i], match, predicted)))
        if len(options) <= 1:
            return options[0][0] if options else None
        winner = self._ranker.prefer([pick for _, pick in options])
        return next(decision for decision, pick in options if pick is winner)

    async def _read(
        self, keys: Sequence[int], candidates: list[Worker]
    ) -> tuple[dict[str, WorkerMatch], Sequence[WorkerLoad]]:
        """The candidates' index matches and loads; a shared ledger's read overlaps the match."""
        match = self.index.match(keys, [w.name for w in candidates])
        local = [w.load for w in candidates]
        if not self.ledger.shared:
            return await match, local
        return await asyncio.gather(match, self.ledger.loads(local))
