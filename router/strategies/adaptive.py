"""`adaptive`, the default strategy: one cost per candidate that prices waiting, prefill and
recomputing a prefix another worker holds, with the price of recomputing adapted from the
measured eviction loss and queueing.

Per request of P prompt tokens (B tokens per block) and per candidate worker w, in tokens:

    u(w)  = P − B · credit(w)          uncached tokens: the prefill this request does on w
    u*    = min over candidates of u(w) the prefill it must do wherever it goes
    q(w)  = pending prefill tokens(w)  uncached prefill routed to w that has no first token yet
    ū     = mean u of recent placements (decayed), the fleet's typical prefill per request
    n(w)  = min(queue_cap, q(w) / ū)   w's queue, in requests of typical size
    s(w)  = N · (decayed mean of (1 − c) · u + c · ū routed to w per placement): ū when w got
            its fair share; c = `count_weight` counts each placement as ū as well as by its u
    n*    = min of n(w) over the workers holding the longest prefix (u(w) = u*)

    cost(w) = q(w) + u* + a(w) · (u(w) − u*)   this request's time to first token on w
            + X(w) · (u(w) − u*)               the price of recomputing what another worker holds
            + balance · s(w)                   the load w's conversations will keep bringing
    X(w)    = n(w) + (duplicate_floor + eviction_gain · π) / h
    a(w)    = h ^ (−amortize · min(1, max(0, n* − n(w))))   the share of its recompute charged

The lowest cost wins; ties go to the smaller s(w), then in turn.

The terms, and why:
  q + u     (a = 1) what the request itself waits for and computes on w: with nothing else in
            play the request goes where its first token comes soonest, so one hot worker only
            loses the requests for which another worker is faster, instead of a fleet-wide load
            guard turning affinity off for everyone.
  a · (u − u*)  the recompute is this request's own prefill, all of it (a = 1) for a private
            prefix (h = 1) or where w is as queued as a holder. Where the holders are queued
            and w is not, a copy of a hot prefix on w also serves the requests after it, which
            would otherwise queue behind the holders: this request is charged h^−α of it
            (α = `amortize`), the whole discount from one typical request's difference in queue
            (n* − n(w) ≥ 1). Without it the requests for one hot RAG document stayed queued on
            its one worker while the others had room (the replayer's RAG workload, 4 workers at
            2× its rate: mean TTFT 86 ms against 70 ms with it).
  X · (u − u*)  recomputing a prefix held elsewhere costs more than this request's own time:
            it delays everything queued behind it on w (n(w): free on an idle worker, dear on a
            busy one), and it leaves two copies of the prefix where one would do, which costs
            future hits when caches are full. That second part is `duplicate_floor` plus
            `eviction_gain` · π, divided by the prefix's heat h.
  π         the measured eviction loss: of the prefix blocks that earlier requests brought (one
            checkpoint every `checkpoint_tokens`), the fraction that no worker still held when a
            later request came back for them (decayed over recent placements; 0..1). High π
            means caches are full and duplicates push out prefixes that will be needed again,
            so affinity is worth more; π ≈ 0 means there is room and spreading is cheap.
  h         the heat of the longest cached prefix: max(1, earlier requests whose longest cached
            prefix ended at the same block, decayed). A shared document or system prompt
            (h ≫ 1) is cheap to replicate: its copy on another worker serves many later
            requests. A private conversation (h = 1) pays the full duplication price.
  s(w)      new conversations (u(w) = u* everywhere) go where little work was routed lately, so
            the workers' future load and cache churn stay even; a worker that keeps receiving
            more than its share also loses the marginal continuations first. A share c of it
            (half by default) counts placements rather than their tokens: a conversation's
            later turns bring load and cache in proportion to their number, not to its first
            prompt's length, so an even split of tokens alone (13 conversations on one worker,
            19 on the other) still left one worker's cache fuller.

Adaptation is bounded: 0 ≤ π ≤ 1, 0 ≤ n(w) ≤ queue_cap, so duplicate_floor ≤ X(w) · h ≤
queue_cap · h + duplicate_floor + eviction_gain, and h^−α ≤ a ≤ 1. The measured state (π, ū,
the queue depth, the routed shares, spills) is exposed by `gauges()` and `worker_gauges()` for
metrics.

Defaults were chosen on the replayer's conversation, GSP, agent and RAG workloads at several
fleet sizes and rates and checked on other seeds and windows (docs/replay.md, the matrix);
`duplicate_floor` 8 rather than 3 on two real vLLM engines, where the lower floor moved short
turns that cost hits and saved no time; `count_weight` 0.5 on both, where 0 left conversations
split unevenly and 1 lost hits on long, uneven conversations (docs/router.md); `amortize` 0.5 on
the matrix, where 0.5 and 1 held the same cells and 0.5 kept the lower TTFT p99 on RAG.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, Field

from router.index import WorkerMatch
from router.strategies.base import (
    NO_MATCH,
    Knobs,
    RequestView,
    Score,
    Strategy,
    TierWeights,
    WorkerLoad,
)


class AdaptiveKnobs(Knobs):
    tier_weights: TierWeights = TierWeights()
    duplicate_floor: float = Field(8.0, ge=0)
    """Extra cost per token of recomputing a private prefix that another worker holds, when
    caches have room (π = 0)."""
    eviction_gain: float = Field(32.0, ge=0)
    """Added to that per unit of measured eviction loss π (0..1)."""
    balance: float = Field(3.0, ge=0)
    """Weight of s(w), the work routed to w lately (ū when it had its fair share)."""
    queue_cap: float = Field(16.0, ge=0)
    """Upper bound of n(w), the queue depth in requests that prices recomputing on w."""
    count_weight: float = Field(0.5, ge=0, le=1)
    """Fraction of s(w) that counts placements (each as ū) rather than their uncached tokens:
    a conversation's later turns bring load in proportion to their count, not its first
    prompt's length."""
    horizon: float = Field(16.0, gt=0)
    """Placements per worker over which ū, s(w) and π decay (1/e)."""
    heat_horizon: float = Field(256.0, gt=0)
    """Placements per worker over which a prefix's heat decays (1/e)."""
    checkpoint_tokens: int = Field(512, gt=0)
    """Spacing of the prefix checkpoints that measure the eviction loss π."""
    memory: int = Field(1 << 16, gt=0)
    """Checkpoints, and separately prefix heats, remembered (least recent dropped first)."""
    amortize: float = Field(0.5, ge=0)
    """α: on a worker queued less than the longest prefix's holders (by a typical request or
    more), this request is charged h^−α of recomputing a prefix of heat h, as the copy serves
    the requests after it; 0: all of it."""
    adapt: bool = True
    """False: fixed knobs, X(w) = duplicate_floor / h and a = 1 (π and n(w) taken as 0); for
    comparison."""


class AdaptiveAffinity(Strategy):
    """The default strategy: see the module docstring for the cost formula and its knobs."""

    name = "adaptive"
    Knobs = AdaptiveKnobs

    def __init__(self, knobs: BaseModel | None = None) -> None:
        super().__init__(knobs)
        self._routed: dict[str, float] = {}
        """Worker → decayed mean of the u routed to it per placement (s(w) / N)."""
        self._work = 0.0
        """ū, tokens (0 until the first placement)."""
        self._expected = 0.0
        self._lost = 0.0
        """Decayed sums of checkpointed prefix blocks asked for again, and of those found
        nowhere: π = lost / expected."""
        self._checkpoints: OrderedDict[int, None] = OrderedDict()
        self._heat: OrderedDict[int, tuple[float, int]] = OrderedDict()
        """Key of the last block of a longest cached prefix → (decayed count, tick)."""
        self._tick = 0
        self._depth = 0.0
        self.placements = 0
        self.spills = 0
        """Placements away from the longest cached prefix."""
        self.spill_tokens = 0.0
        """Σ u(w) − u* of the chosen workers: prefill spent to spread load."""

    # ---- observable state ----------------------------------------------------------------
    @property
    def eviction_loss(self) -> float:
        """π: measured fraction of returning prefix blocks that no worker held any more."""
        return self._lost / self._expected if self._expected > 0 else 0.0

    def duplicate_price(self) -> float:
        """X for a private prefix (h = 1) on an idle worker: the current affinity weight."""
        return self._price(self.eviction_loss)

    def _price(self, loss: float) -> float:
        k: AdaptiveKnobs = self.knobs  # type: ignore[assignment]
        return k.duplicate_floor + k.eviction_gain * loss if k.adapt else k.duplicate_floor

    def gauges(self) -> dict[str, float]:
        return {
            "eviction_loss": self.eviction_loss,
            "duplicate_price": self.duplicate_price(),
            "queue_depth": self._depth,
            "work_per_request_tokens": self._work,
            "placements": float(self.placements),
            "spills": float(self.spills),
            "spill_tokens": self.spill_tokens,
        }

    def worker_gauges(self) -> dict[str, dict[str, float]]:
        total = sum(self._routed.values())
        n = len(self._routed)
        return {
            "routed_share": {
                w: (n * v / total if total > 0 else 1.0) for w, v in self._routed.items()
            }
        }

    def forget(self, worker: str) -> None:
        self._routed.pop(worker, None)

    # ---- choice ----------------------------------------------------------------------------
    def explain(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> dict[str, Score]:
        plan = self._plan(request, candidates, matches, explain=True)
        return {
            name: Score(key, "lowest cost", plan.terms[name]) for name, key in plan.keys.items()
        }

    def choose(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
    ) -> str:
        k: AdaptiveKnobs = self.knobs  # type: ignore[assignment]
        plan = self._plan(request, candidates, matches)
        keys = plan.keys
        name = self._best(candidates, lambda w: keys[w.name])
        n, decay = len(candidates), plan.decay
        self._tick += 1
        if request.prefix_reuse:
            self._expected, self._lost = plan.loss
            stride = max(1, k.checkpoint_tokens // request.block_size)
            self._remember(request.keys, plan.seen or stride, stride, k)
            if plan.depth:
                self._warm(request.keys[plan.depth - 1], k.heat_horizon * n, k.memory)
        self._depth = plan.queue_depth
        u, least = plan.uncached[name], plan.least
        self._work = u if self.placements == 0 else decay * self._work + (1 - decay) * u
        routed = self._routed
        for w in candidates:
            routed[w.name] = decay * routed.get(w.name, 0.0)
        routed[name] += (1 - decay) * ((1 - k.count_weight) * u + k.count_weight * self._work)
        self.placements += 1
        if u > least:
            self.spills += 1
            self.spill_tokens += u - least
        return name

    def _plan(
        self,
        request: RequestView,
        candidates: Sequence[WorkerLoad],
        matches: Mapping[str, WorkerMatch],
        explain: bool = False,
    ) -> _Plan:
        """Every candidate's cost as of this request, changing no state: `choose` commits
        what it measured (π, the prefix's heat, the queue depth) after picking the lowest.
        `explain`: with the terms behind each cost (for people; `choose` needs none)."""
        k: AdaptiveKnobs = self.knobs  # type: ignore[assignment]
        bs, n = request.block_size, len(candidates)
        prompt = max(request.prompt_tokens, len(request.keys) * bs)
        reuse = request.prefix_reuse
        credit = {
            w.name: k.tier_weights.credit(matches.get(w.name, NO_MATCH)) if reuse else 0.0
            for w in candidates
        }
        uncached = {name: max(0.0, prompt - c * bs) for name, c in credit.items()}
        least = min(uncached.values())
        depth = max((matches[w.name].blocks for w in candidates if w.name in matches), default=0)
        decay = 1.0 - 1.0 / (k.horizon * n)
        loss = (self._expected, self._lost)
        heat, seen = 1.0, 0
        if reuse:
            stride = max(1, k.checkpoint_tokens // bs)
            seen = self._seen_depth(request.keys, stride)
            loss = self._loss_after(seen, depth, decay)
            if depth:
                heat = self._heat_at(request.keys[depth - 1], self._tick + 1, k.heat_horizon * n)
        dup = self._price(loss[1] / loss[0] if loss[0] > 0 else 0.0) / heat
        work = max(self._work, float(bs))
        depths = [min(k.queue_cap, w.pending_prefill_tokens / work) for w in candidates]
        queue_depth = sum(depths) / n
        if not k.adapt:
            depths = [0.0] * n
        keys: dict[str, tuple[float, float]] = {}
        terms: dict[str, dict[str, float]] = {}
        routed, balance = self._routed, k.balance
        holder_depth = min(depths[i] for i, w in enumerate(candidates) if uncached[w.name] == least)
        for i, w in enumerate(candidates):
            u = uncached[w.name]
            share = n * routed.get(w.name, 0.0)
            price = depths[i] + dup
            charged = heat ** (-k.amortize * min(1.0, max(0.0, holder_depth - depths[i])))
            cost = (
                w.pending_prefill_tokens + least + (charged + price) * (u - least)
                + balance * share
            )
            keys[w.name] = (cost, share)
            if explain:
                terms[w.name] = {
                    "queued_tokens": w.pending_prefill_tokens,
                    "uncached_tokens": u,
                    "recompute_share": charged,
                    "recompute_price": price,
                    "recomputed_tokens": u - least,
                    "routed_share": share,
                    "heat": heat,
                    "cost": cost,
                }
        return _Plan(keys, terms, uncached, least, decay, loss, depth, seen, queue_depth)

    def _seen_depth(self, keys: Sequence[int], stride: int) -> int:
        """The depth in blocks of the deepest checkpoint of `keys` seen before (0: none): what
        earlier requests brought."""
        seen = self._checkpoints
        for d in range(len(keys) // stride * stride, 0, -stride):
            if keys[d - 1] in seen:
                return d
        return 0

    def _loss_after(self, expected: int, found: int, decay: float) -> tuple[float, float]:
        """π's decayed sums (expected, lost) with this request counted: `expected` blocks were
        brought by earlier requests (`_seen_depth`), `found` of them are still held somewhere
        (the longest match)."""
        total, lost = self._expected * decay, self._lost * decay
        if expected:
            total += expected
            lost += max(0, expected - found)
        return total, lost

    def _remember(self, keys: Sequence[int], start: int, stride: int, k: AdaptiveKnobs) -> None:
        """Checkpoint `keys` every `stride` blocks from depth `start` on (least recent forgotten
        past `memory`). `start` is the deepest checkpoint seen before: the shallower ones were
        checkpointed with it, so a conversation's next turn costs its new blocks, not its
        history (they age in the LRU order from then, and a fork from deep in a long-idle
        history may find a shallower checkpoint than it would have)."""
        seen = self._checkpoints
        for d in range(start, len(keys) + 1, stride):
            key = keys[d - 1]
            if key in seen:
                seen.move_to_end(key)
            else:
                seen[key] = None
        while len(seen) > k.memory:
            seen.popitem(last=False)

    def _decayed(self, key: int, tick: int, horizon: float) -> float:
        """The decayed count of earlier requests whose longest match ended at `key`."""
        count, last = self._heat.get(key, (0.0, tick))
        return count * math.exp(-(tick - last) / horizon)

    def _heat_at(self, key: int, tick: int, horizon: float) -> float:
        """h = max(1, that count)."""
        return max(1.0, self._decayed(key, tick, horizon))

    def _warm(self, key: int, horizon: float, memory: int) -> None:
        """Count this request's longest match ending at `key` (at the current tick)."""
        count = self._decayed(key, self._tick, horizon)
        self._heat.pop(key, None)
        self._heat[key] = (count + 1.0, self._tick)
        if len(self._heat) > memory:
            self._heat.popitem(last=False)


@dataclass(frozen=True, slots=True)
class _Plan:
    """One request's costs (`AdaptiveAffinity._plan`) and what `choose` commits after."""

    keys: dict[str, tuple[float, float]]
    """Each candidate's (cost, routed share): the lowest wins."""
    terms: dict[str, dict[str, float]]
    """The named numbers behind each cost (explained plans only)."""
    uncached: dict[str, float]
    least: float
    decay: float
    loss: tuple[float, float]
    """π's decayed sums (expected, lost) with this request counted."""
    depth: int
    """The longest match, in blocks."""
    seen: int
    """The deepest checkpoint seen before, in blocks (0: none)."""
    queue_depth: float
