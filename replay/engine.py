"""A simulated vLLM-style engine (a simulator, not an engine): block cache, scheduler, cost model.

Per scheduler pass, at time s (effects are applied at s, as in Dynamo's mocker):
  1. running requests in admission order: a decoding request takes 1 token of the
     `max_batched_tokens` budget and grows its KV by one token; a prefilling one takes the next
     chunk min(remaining, budget);
  2. waiting requests (FIFO) are admitted while budget, `max_seqs` and free blocks (above a
     `watermark` fraction) allow, each reusing its longest cached prefix — capped so that the
     last prompt block is always recomputed — and prefilling one chunk;
  3. when a block allocation fails, the newest running request is preempted (its blocks freed,
     its prefix left in the cache, its prompt + generated tokens recomputed later);
  4. the pass lasts prefill_ms(T) + host_load + decode_ms(p) (T = uncached tokens computed,
     p = blocks in use / capacity; decode only if a request was decoding at s). A request whose
     prefill completes emits its first token at s + prefill_ms(T); decoding ones at the pass end.

The cache holds full prompt blocks under their canonical keys (used directly as the engine's
block ids); blocks no running request references are evictable, least recently used first
(a freed request's tail blocks first, as vLLM frees in reverse). An optional host tier (L2)
takes GPU evictions and serves hits at `host_load_ms_per_token`. Every cache change is recorded
as a `warply.protocol` event for the router's index.

Tier directives (`apply`, from the replay's tier-policy runner) act on these two tiers: a pin is
one more reference on a GPU block (never evicted while pinned), evict drops idle blocks from a
tier, offload demotes idle GPU blocks to the host tier, prefetch promotes host blocks to the GPU
(evicting the least recent there, and costing the host load time on the engine's clock). Pins
that leave no room for the next waiting request are all released (`stats.pins_dropped`).

Passes where every running request is decoding and none waits are fast-forwarded in bulk
(numpy over passes), with the exact per-pass block growth and decode times.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from replay.costmodel import CostModel, ReferenceModel
from replay.trace import U32
from warply.protocol import (
    BlockRemoved,
    BlockStored,
    Directive,
    DirectiveAck,
    DirectiveKind,
    Event,
    Tier,
    TierMoved,
)

TokenSource = Callable[[int, int, int], U32 | list[int]]
"""(request index, first token, stop token) → token ids; used for `BlockStored.token_ids`.

In process the ids may stay a numpy array: the index hashes them with `chain_keys`, which packs
numpy input without a Python loop (the replay's hottest path otherwise). Events that go on the
wire (`replay.serve`) need a list."""


class EngineConfig(BaseModel):
    """Simulated engine geometry and scheduler limits (defaults: the reference model)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    num_blocks: int = Field(16384, gt=0)
    block_size: int = Field(64, gt=0)
    max_batched_tokens: int = Field(8192, gt=0)
    max_seqs: int = Field(256, gt=0)
    watermark: float = Field(0.01, ge=0, lt=1)
    """Admission keeps this fraction of blocks free (vLLM's watermark)."""
    host_blocks: int = Field(0, ge=0)
    """Host (CPU, L2) tier capacity in blocks; 0 disables the tier."""
    host_load_ms_per_token: float = Field(0.0, ge=0)
    """Cost of bringing one cached token back from the host tier."""


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request inside the simulator, with its progress and the blocks it holds."""

    index: int
    arrival: float
    prompt: int
    output: int
    keys: list[int]
    target: int = 0
    """Tokens to compute before decoding: the prompt, plus generated tokens after preemption."""
    computed: int = 0
    generated: int = 0
    keyed: int = 0
    """Leading prompt blocks held under their keys."""
    private: int = 0
    """Other blocks held (partial prompt block, generated tokens)."""
    cached_tokens: int = -1
    """Prefix reused at first admission (GPU + host); -1 until admitted."""
    host_tokens: int = 0
    queued_prefill: int = -1
    """Prefill tokens the router expects (prompt minus its predicted prefix hit; -1: prompt)."""
    pulled: bool = False
    """The prompt's KV arrives with the request (a P/D hand-off): its first admission computes
    only the last prompt token and caches every full prompt block (a later preemption
    recomputes). Its `cached_tokens` is set by the caller: the prefill engine's reuse."""
    evict_first: bool = False
    """On release its blocks become the first to evict (a decode engine dropping the KV it
    pulled: the P/D replay's no-duplicate ideal, `PdSettings.drop_pulled`)."""
    first_token: float = -1.0
    finished: float = -1.0
    namespace: str = ""
    """Cache namespace of `keys` (salt, adapter): carried on its `BlockStored` events."""

    def __post_init__(self) -> None:
        self.target = self.prompt
        if self.queued_prefill < 0:
            self.queued_prefill = self.prompt


@dataclass(slots=True)
class EngineStats:
    """Lifetime counters of one simulated engine."""

    passes: int = 0
    prefill_tokens: int = 0
    """Tokens actually computed in prefill (uncached), the engine's prefill work."""
    evictions: int = 0
    host_evictions: int = 0
    preemptions: int = 0
    directive_blocks: Counter[str] = field(default_factory=Counter)
    """Blocks each applied directive kind acted on."""
    pins_dropped: int = 0
    """Pins released because they left no room for a waiting request."""
    busy_ms: float = 0.0
    """Time spent in scheduler passes (simulated ms): what the engine's GPU time costs."""
    finished: list[SimRequest] = field(default_factory=list)


class SimEngine:
    """One simulated worker. Drive it with `enqueue()` and `advance(horizon)`; drain `events`."""

    def __init__(
        self,
        name: str,
        tokens: TokenSource,
        config: EngineConfig | None = None,
        model: CostModel | None = None,
    ) -> None:
        self.name = name
        self.cfg = config or EngineConfig()
        self.model = model or ReferenceModel()
        self._tokens = tokens
        self.now = 0.0
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.holders: dict[int, int] = {}
        """Key → number of running requests referencing the block."""
        self.lru: OrderedDict[int, None] = OrderedDict()
        """Evictable cached keys, least recently used first (dict order)."""
        self.host: OrderedDict[int, None] = OrderedDict()
        """Host-tier keys, least recently used first."""
        self.pins: Counter[int] = Counter()
        """Key → pins on it (each also one reference in `holders`)."""
        self.private = 0
        self.events: list[Event] = []
        self.stats = EngineStats()
        self.pending_prefill = 0
        """Expected prefill tokens (`SimRequest.queued_prefill`) of requests without a first
        token yet: what a router tracks for the worker."""
        self.live_prompt = 0
        """Prompt tokens of unfinished requests."""
        self.live_generated = 0
        """Tokens generated so far by unfinished requests."""
        self._watermark = int(self.cfg.watermark * self.cfg.num_blocks)

    # ---- queries -------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        """Blocks referenced by running requests (vLLM's `kv_cache_usage` numerator)."""
        return len(self.holders) + self.private

    @property
    def free_blocks(self) -> int:
        return self.cfg.num_blocks - len(self.holders) - self.private - len(self.lru)

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prefill speed of a full pass (`max_batched_tokens` uncached tokens): what a pool's
        `prefill_tokens_per_s` states for strategies that estimate waits."""
        full = self.cfg.max_batched_tokens
        return full * 1000 / self.model.prefill_ms(full)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def cached_keys(self) -> set[int]:
        """Every key this engine would report as cached on the GPU tier."""
        return self.holders.keys() | self.lru.keys()

    def cached_prefix(self, keys: list[int], limit: int) -> int:
        """Leading blocks of `keys` (at most `limit`) cached on the GPU tier."""
        holders, lru = self.holders, self.lru
        n = 0
        while n < limit and (keys[n] in holders or keys[n] in lru):
            n += 1
        return n

    def fits(self, prompt: int, output: int) -> bool:
        """Whether a lone request of this size can ever run on this engine."""
        need = -(-(prompt + output) // self.cfg.block_size)
        return need <= self.cfg.num_blocks - self._watermark

    # ---- driving -------------------------------------------------------------------------
    def enqueue(self, req: SimRequest, at: float | None = None) -> None:
        """A request arrives at `at` (default `req.arrival`; not before the engine's current
        time: one arriving during a pass waits for the next)."""
        if not self.has_work():
            self.now = max(self.now, req.arrival if at is None else at)
        self.waiting.append(req)
        self.pending_prefill += req.queued_prefill
        self.live_prompt += req.prompt

    def advance(self, horizon: float) -> None:
        """Run every scheduler pass that starts before `horizon`."""
        while self.now < horizon and (self.running or self.waiting):
            if not self.waiting and all(r.computed >= r.target for r in self.running):
                self._fast_forward(horizon)
            else:
                self._pass()

    def abort(self, req: SimRequest) -> None:
        """Drop an unfinished request (its client went away), as an engine aborts one: its
        blocks are freed (the cached prefix stays evictable); it never reaches `finished`."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
            self._release(req)
        else:
            return
        if req.first_token < 0:
            self.pending_prefill -= req.queued_prefill
        self.live_generated -= req.generated
        self.live_prompt -= req.prompt

    # ---- tier directives -----------------------------------------------------------------
    def apply(self, directive: Directive, at: float) -> DirectiveAck:
        """Apply a tier directive at simulated time `at` (see the module docstring); rejected,
        with the reason, where these two tiers cannot do it."""
        kind, tier, keys = directive.kind, directive.tier, directive.keys or []
        reason = ""
        if not keys:
            reason = "the simulator takes canonical keys (no token_ids, no quota)"
        elif directive.ttl_s:
            reason = "the simulator pins until unpinned (ttl_s must be 0)"
        elif kind in (DirectiveKind.OFFLOAD, DirectiveKind.PREFETCH) and not self.cfg.host_blocks:
            reason = "no host tier (host_blocks is 0)"
        elif kind is DirectiveKind.OFFLOAD and tier is not Tier.CPU:
            reason = "the simulator's only lower tier is cpu"
        elif kind is DirectiveKind.PREFETCH and tier not in (Tier.GPU, None):
            reason = "prefetch promotes host blocks to gpu only"
        elif kind in (DirectiveKind.PIN, DirectiveKind.UNPIN) and tier not in (Tier.GPU, None):
            reason = "pins hold gpu blocks only"
        if reason:
            return DirectiveAck(directive.id, False, reason)
        n = self._act(kind, tier, keys, at)
        self.stats.directive_blocks[kind.value] += n
        return DirectiveAck(directive.id, True, blocks=n)

    def _act(self, kind: DirectiveKind, tier: Tier | None, keys: list[int], at: float) -> int:
        """Apply one checked directive to the blocks of `keys`; the blocks it acted on."""
        holders, lru, host = self.holders, self.lru, self.host
        if kind is DirectiveKind.PIN:
            cached = [k for k in keys if k in holders or k in lru]
            for k in cached:
                lru.pop(k, None)
                holders[k] = holders.get(k, 0) + 1
                self.pins[k] += 1
            return len(cached)
        if kind is DirectiveKind.UNPIN:
            pinned = [k for k in keys if k in self.pins]
            for k in reversed(pinned):  # the tail becomes the least recent, as in `_release`
                self.pins[k] -= 1
                if not self.pins[k]:
                    del self.pins[k]
                holders[k] -= 1
                if not holders[k]:
                    del holders[k]
                    lru[k] = None
            return len(pinned)
        if kind is DirectiveKind.EVICT:
            gone = [k for k in keys if k in lru] if tier in (Tier.GPU, None) else []
            for k in gone:
                del lru[k]
            dropped = [k for k in keys if k in host] if tier in (Tier.CPU, None) else []
            for k in dropped:
                del host[k]
            if gone:
                self.events.append(BlockRemoved(gone, Tier.GPU))
            if dropped:
                self.events.append(BlockRemoved(dropped, Tier.CPU))
            return len(gone) + len(dropped)
        if kind is DirectiveKind.OFFLOAD:
            idle = [k for k in keys if k in lru]
            for k in idle:
                del lru[k]
            self._demote(idle)
            return len(idle)
        stored: list[int] = []  # prefetch: the chain's run of host blocks after its GPU ones
        for k in keys:
            if k in host:
                stored.append(k)
            elif k not in holders and k not in lru:
                break
        stored = stored[: self.free_blocks + len(lru)]
        if not stored:
            return 0
        for k in stored:
            del host[k]
        self.events.append(TierMoved(stored, Tier.CPU, Tier.GPU))
        self._evict(len(stored) - self.free_blocks)
        for k in stored:
            lru[k] = None
        load_ms = len(stored) * self.cfg.block_size * self.cfg.host_load_ms_per_token
        self.now = max(self.now, at) + load_ms
        self.stats.busy_ms += load_ms
        return len(stored)

    def _drop_pins(self) -> None:
        """Release every pin (the blocks become evictable), counted in `stats.pins_dropped`."""
        for k, n in self.pins.items():
            left = self.holders[k] - n
            if left:
                self.holders[k] = left
            else:
                del self.holders[k]
                self.lru[k] = None
        self.stats.pins_dropped += sum(self.pins.values())
        self.pins.clear()

    # ---- cache ---------------------------------------------------------------------------
    def _evict(self, count: int) -> None:
        """Free `count` evictable blocks, least recently used first (to the host tier if any)."""
        if count <= 0:
            return
        pop = self.lru.popitem
        victims = [pop(last=False)[0] for _ in range(count)]
        self.stats.evictions += len(victims)
        if not self.cfg.host_blocks:
            self.events.append(BlockRemoved(victims))
            return
        self._demote(victims)

    def _demote(self, victims: list[int]) -> None:
        """Move GPU blocks (already out of the GPU cache) to the host tier, whose least recent
        blocks overflow."""
        if not victims:
            return
        host = self.host
        for k in victims:
            host[k] = None
            host.move_to_end(k)
        self.events.append(TierMoved(victims, Tier.GPU, Tier.CPU))
        over = len(host) - self.cfg.host_blocks
        if over > 0:
            gone = [host.popitem(last=False)[0] for _ in range(over)]
            self.stats.host_evictions += over
            self.events.append(BlockRemoved(gone, Tier.CPU))

    def _release(self, req: SimRequest) -> None:
        """Drop a request's blocks: keyed ones become evictable, tail first."""
        holders, lru, keys = self.holders, self.lru, req.keys
        for i in range(req.keyed - 1, -1, -1):
            k = keys[i]
            n = holders[k] - 1
            if n:
                holders[k] = n
            else:
                del holders[k]
                lru[k] = None
                if req.evict_first:
                    lru.move_to_end(k, last=False)
        self.private -= req.private
        req.keyed = req.private = 0

    def _extend(self, req: SimRequest, computed: int, blocks: int, reserve: int = 0) -> bool:
        """Hold `blocks` blocks for `req` with its first `computed` tokens computed.

        Newly full prompt blocks become cached under their keys (reusing an identical block
        another request stored meanwhile, promoting host-tier copies); fails, changing nothing,
        if fewer than `reserve` + the new blocks are free or evictable.
        """
        keys, holders, lru = req.keys, self.holders, self.lru
        keyed = min(computed // self.cfg.block_size, len(keys), blocks)
        private = blocks - keyed
        fresh: list[int] = []
        promoted: list[int] = []
        revived = 0
        for i in range(req.keyed, keyed):
            k = keys[i]
            if k in holders:
                continue
            if k in lru:
                revived += 1
            elif k in self.host:
                promoted.append(k)
            else:
                fresh.append(k)
        need = len(fresh) + len(promoted) + private - req.private
        shortfall = need - self.free_blocks
        if shortfall > len(self.lru) - revived - reserve:
            return False
        for i in range(req.keyed, keyed):
            k = keys[i]
            if k in holders:
                holders[k] += 1
            else:
                lru.pop(k, None)
                holders[k] = 1
        if promoted:  # before evicting: a demotion may push these very blocks off the host tier
            for k in promoted:
                del self.host[k]
            self.events.append(TierMoved(promoted, Tier.CPU, Tier.GPU))
        self._evict(shortfall)
        self.private += private - req.private
        if fresh:
            self._store(req, keyed, set(fresh))
        req.keyed, req.private, req.computed = keyed, private, computed
        return True

    def _store(self, req: SimRequest, keyed: int, fresh: set[int]) -> None:
        """Publish `BlockStored` for the fresh blocks among `req.keys[req.keyed:keyed]`."""
        bs, keys = self.cfg.block_size, req.keys
        i = req.keyed
        while i < keyed:
            if keys[i] not in fresh:
                i += 1
                continue
            j = i
            while j < keyed and keys[j] in fresh:
                j += 1
            self.events.append(
                BlockStored(
                    keys[i:j],
                    keys[i - 1] if i else None,
                    cast(list[int], self._tokens(req.index, i * bs, j * bs)),
                    bs,
                    namespace=req.namespace or None,
                )
            )
            i = j

    def _prefix_hit(self, req: SimRequest) -> tuple[int, int]:
        """Reusable leading blocks (GPU, then host), keeping the last prompt block uncached."""
        keys, host = req.keys, self.host
        cap = min(len(keys), (req.target - 1) // self.cfg.block_size)
        gpu = self.cached_prefix(keys, cap)
        end = gpu
        while end < cap and keys[end] in host:
            end += 1
        return gpu, end - gpu

    # ---- scheduling ----------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size)

    def _preempt_newest(self) -> SimRequest:
        victim = self.running.pop()
        self._release(victim)
        victim.computed = 0
        victim.target = victim.prompt + victim.generated
        self.waiting.insert(0, victim)
        self.stats.preemptions += 1
        return victim

    def _admit(self, budget: int) -> tuple[SimRequest, int, int] | None:
        """Admit the first waiting request with one chunk; (request, chunk, host tokens)."""
        req = self.waiting[0]
        gpu, host = (0, 0) if req.pulled else self._prefix_hit(req)
        bs = self.cfg.block_size
        start = req.target - 1 if req.pulled else (gpu + host) * bs
        chunk = min(req.target - start, budget)
        if not self._extend(req, start + chunk, self._blocks_for(start + chunk), self._watermark):
            return None
        del self.waiting[0]
        req.pulled = False
        if req.cached_tokens < 0:
            req.cached_tokens, req.host_tokens = start, host * bs
        self.running.append(req)
        return req, chunk, host * bs

    def _pass(self) -> None:
        """One scheduler pass at `self.now` (see the module docstring)."""
        cfg, start = self.cfg, self.now
        budget = cfg.max_batched_tokens
        decoding: list[SimRequest] = []
        chunks: list[tuple[SimRequest, int]] = []
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.computed >= req.target:
                total, blocks, chunk = req.computed, self._blocks_for(req.target + 1), 0
            else:
                chunk = min(req.target - req.computed, budget)
                total = req.computed + chunk
                blocks = self._blocks_for(total)
            while not self._extend(req, total, blocks):
                preempted = True
                if self._preempt_newest() is req:
                    break
            else:
                if chunk:
                    chunks.append((req, chunk))
                else:
                    decoding.append(req)
                    req.target += 1  # the KV of the token decoded in this pass
                    req.computed = req.target
                budget -= chunk or 1
                i += 1
        load_tokens = 0
        if not preempted:
            while self.waiting and budget > 0 and len(running) < cfg.max_seqs:
                admitted = self._admit(budget)
                if admitted is None:
                    break
                chunks.append(admitted[:2])
                load_tokens += admitted[2]
                budget -= admitted[1]
        computed = sum(c for _, c in chunks)
        prefill_end = (
            start + self.model.prefill_ms(computed) + load_tokens * cfg.host_load_ms_per_token
        )
        end = prefill_end
        if decoding:
            util = np.array([self.used_blocks / cfg.num_blocks])
            end += float(self.model.decode_ms(util)[0])
        self.stats.passes += 1
        self.stats.prefill_tokens += computed
        if end == start:
            if preempted:  # the only runnable request preempted itself: retry at once
                return
            if self.pins:  # pins left no room for the next request: they give way
                self._drop_pins()
                return
            raise RuntimeError(f"{self.name}: simulator stalled with {len(self.waiting)} waiting")
        self.stats.busy_ms += end - start
        done: list[SimRequest] = []
        for req, _ in chunks:
            if req.computed >= req.target:
                self._token(req, prefill_end)
                if req.generated >= req.output:
                    done.append(req)
        for req in decoding:
            self._token(req, end)
            if req.generated >= req.output:
                done.append(req)
        self._finish(done)
        self.now = end

    def _token(self, req: SimRequest, at: float) -> None:
        if req.first_token < 0:
            req.first_token = at
            self.pending_prefill -= req.queued_prefill
        req.generated += 1
        self.live_generated += 1
        req.finished = at

    def _finish(self, done: list[SimRequest]) -> None:
        for req in done:
            self.running.remove(req)
            self._release(req)
            self.live_generated -= req.generated
            self.live_prompt -= req.prompt
            self.stats.finished.append(req)

    def _fast_forward(self, horizon: float) -> None:
        """Run the decode-only passes that start before `horizon`, in one vectorised step.

        Pass j (1-based) of request r needs ceil((L_r + j) / B) blocks, L_r = its KV tokens;
        its duration is decode_ms((used + new blocks so far) / capacity). The step stops at
        `horizon`, at the first request to finish, or before a pass that would need a block
        that is not free or evictable (that pass then runs normally, with preemption).
        """
        cfg, running = self.cfg, self.running
        bs, cap = cfg.block_size, cfg.num_blocks
        span = min(r.output - r.generated for r in running)
        if horizon != float("inf"):  # decode_ms grows with p: no pass is shorter than the first
            first = float(self.model.decode_ms(np.array([self.used_blocks / cap]))[0])
            span = min(span, int((horizon - self.now) / first) + 1)
        lengths = np.array([r.target for r in running], dtype=np.int64)
        held = np.array([r.keyed + r.private for r in running], dtype=np.int64)
        steps = np.arange(1, span + 1, dtype=np.int64)
        need = -(-(lengths[:, None] + steps[None, :]) // bs) - held[:, None]
        grown = np.maximum(need, 0).sum(axis=0)
        room = self.free_blocks + len(self.lru)
        durations = self.model.decode_ms((self.used_blocks + grown) / cap)
        starts = self.now + np.concatenate(([0.0], np.cumsum(durations)[:-1]))
        ok = (starts < horizon) & (grown <= room)
        passes = span if ok.all() else int(np.argmin(ok))
        if passes == 0:
            self._pass()
            return
        end = float(starts[passes - 1] + durations[passes - 1])
        new_blocks = int(grown[passes - 1])
        self._evict(new_blocks - self.free_blocks)
        self.private += new_blocks
        done: list[SimRequest] = []
        for r, extra in zip(running, need[:, passes - 1].tolist(), strict=True):
            if extra > 0:
                r.private += extra
            r.target += passes
            r.computed = r.target
            r.generated += passes
            r.finished = end
            if r.generated >= r.output:
                done.append(r)
        self.live_generated += passes * len(running)
        self.stats.passes += passes
        self.stats.busy_ms += end - self.now
        self._finish(done)
        self.now = end
