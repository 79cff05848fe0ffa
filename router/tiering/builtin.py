"""Built-in tier policies, each a rule over `TierState` with its knobs.

Notation, per tracked prefix p on worker w at time now: hits(p, W) = requests in the last W
seconds that found p cached on w; idle(p) = now − last use; bytes_t(p) = blocks of p whose
fastest tier is t × bytes per block; usage(w) = the engine's KV occupancy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast

from pydantic import BaseModel, Field

from router.tiering.base import Action, Knobs, TierPolicy, next_tier, tier_above
from router.tiering.state import PrefixId, PrefixState, TierState
from warply.protocol import DirectiveKind, Tier


class LruByTierKnobs(Knobs):
    high_watermark: float = Field(0.9, ge=0, le=1)
    """usage(w) at or above which w's least recent prefixes are demoted."""
    min_idle_s: float = Field(60.0, ge=0)
    demote_to: Tier | None = Tier.CPU
    """Where demoted prefixes go; None evicts them."""
    max_per_worker: int = Field(8, gt=0)


class LruByTier(TierPolicy):
    """The default: demote least-recently-used prefixes when the device tier fills.

    For each worker with usage(w) ≥ high_watermark: its unpinned prefixes with gpu blocks and
    idle(p) ≥ min_idle_s, oldest use first, at most max_per_worker per round, are offloaded to
    `demote_to` (evicted when it is None).
    """

    name = "lru_by_tier"
    Knobs = LruByTierKnobs

    def decide(self, state: TierState) -> Sequence[Action]:
        k = cast(LruByTierKnobs, self.knobs)
        full = {w.name for w in state.workers.values() if w.kv_usage >= k.high_watermark}
        per_worker: dict[str, int] = {}
        actions: list[Action] = []
        idle = [
            p
            for p in state.prefixes
            if p.worker in full
            and not p.pinned
            and p.blocks_by_tier.get(Tier.GPU, 0)
            and state.now - p.last_use >= k.min_idle_s
        ]
        for p in sorted(idle, key=lambda p: p.last_use):
            if per_worker.get(p.worker, 0) >= k.max_per_worker:
                continue
            per_worker[p.worker] = per_worker.get(p.worker, 0) + 1
            if k.demote_to is None:
                actions.append(Action.on(DirectiveKind.EVICT, p, Tier.GPU))
            else:
                actions.append(Action.on(DirectiveKind.OFFLOAD, p, k.demote_to))
        return actions


class HotPrefixPinKnobs(Knobs):
    k: int = Field(3, gt=0)
    """Hits within window_s that make a prefix hot."""
    window_s: float = Field(300.0, gt=0)
    unpin_below: int = Field(1, ge=0)
    """A pinned prefix with fewer hits than this in the window is cold: unpinned."""
    ttl_s: float = Field(0.0, ge=0)
    """Pins expire after this (0: when unpinned)."""
    max_pins_per_worker: int = Field(32, gt=0)


class HotPrefixPin(TierPolicy):
    """Pin hot prefixes where they are fastest; let cold ones go.

    hits(p, window_s) ≥ k and p unpinned: if p's fastest tier is gpu, pin it there (ttl_s);
    otherwise prefetch it one tier up (it is pinned in a later round, once on gpu). A pinned p
    with hits(p, window_s) < unpin_below is unpinned. At most max_pins_per_worker pins per
    worker, hottest first.
    """

    name = "hot_prefix_pin"
    Knobs = HotPrefixPinKnobs

    def decide(self, state: TierState) -> Sequence[Action]:
        k = cast(HotPrefixPinKnobs, self.knobs)
        pins: dict[str, int] = {}
        for p in state.prefixes:
            pins[p.worker] = pins.get(p.worker, 0) + p.pinned
        actions: list[Action] = []
        hot: list[tuple[int, PrefixState]] = []
        for p in state.prefixes:
            hits = p.hits_within(k.window_s, state.now)
            if p.pinned and hits < k.unpin_below:
                actions.append(Action.on(DirectiveKind.UNPIN, p))
            elif not p.pinned and hits >= k.k and p.blocks:
                hot.append((hits, p))
        for _, p in sorted(hot, key=lambda hp: -hp[0]):
            tier = p.fastest_tier
            if tier is Tier.GPU:
                if pins.get(p.worker, 0) >= k.max_pins_per_worker:
                    continue
                pins[p.worker] = pins.get(p.worker, 0) + 1
                actions.append(Action.on(DirectiveKind.PIN, p, Tier.GPU, k.ttl_s))
            elif tier is not None:
                actions.append(Action.on(DirectiveKind.PREFETCH, p, tier_above(tier)))
        return actions


class TenantQuotaKnobs(Knobs):
    quotas: dict[str, dict[Tier, int]] = Field(default_factory=dict)
    """Namespace (`cache_key`) → tier → bytes it may hold there."""
    default: dict[Tier, int] = Field(default_factory=dict)
    """Bytes per tier for namespaces not in `quotas` (empty: unlimited)."""
    action: Literal["offload", "evict"] = "offload"
    send_quota: bool = True
    """Also send each `quotas` entry to the workers once (backends that enforce quotas apply
    it; the others reject it with a reason)."""


class TenantQuota(TierPolicy):
    """Bytes per namespace per tier, enforced from the router.

    used(n, t) = Σ bytes_t(p) over n's tracked prefixes. When used(n, t) > quota(n, t), n's
    unpinned prefixes on t, least recent first, are offloaded to the next tier down (evicted
    from t with action=evict, or under object_store) until the excess is covered. With
    send_quota, each (worker, namespace, tier) quota also goes out once as a quota directive.
    """

    name = "tenant_quota"
    Knobs = TenantQuotaKnobs

    def __init__(self, knobs: BaseModel | None = None) -> None:
        super().__init__(knobs)
        self._sent: set[tuple[str, str, Tier]] = set()

    def _limit(self, namespace: str, tier: Tier) -> int | None:
        k = cast(TenantQuotaKnobs, self.knobs)
        return k.quotas.get(namespace, k.default).get(tier)

    def decide(self, state: TierState) -> Sequence[Action]:
        k = cast(TenantQuotaKnobs, self.knobs)
        actions: list[Action] = []
        if k.send_quota:
            for namespace, caps in k.quotas.items():
                for worker in state.workers.values():
                    for tier, cap in caps.items():
                        sent = (worker.name, namespace, tier)
                        if worker.controllable and sent not in self._sent:
                            self._sent.add(sent)
                            actions.append(Action.quota(worker.name, namespace, tier, cap))
        for (namespace, tier), used in sorted(state.namespace_bytes().items()):
            limit = self._limit(namespace, tier)
            if limit is None or used <= limit:
                continue
            excess = used - limit
            held = [p for p in state.prefixes if p.namespace == namespace and not p.pinned]
            for p in sorted(held, key=lambda p: p.last_use):
                if excess <= 0:
                    break
                nbytes = p.bytes_on(tier)
                if not nbytes:
                    continue
                excess -= nbytes
                lower = next_tier(tier)
                if k.action == "offload" and lower is not None:
                    actions.append(Action.on(DirectiveKind.OFFLOAD, p, lower))
                else:
                    actions.append(Action.on(DirectiveKind.EVICT, p, tier))
        return actions


class RagWarmKnobs(Knobs):
    tier: Tier = Tier.SSD
    """Where shared prefixes are kept (ssd or object_store: they survive engine restarts)."""
    min_requests: int = Field(2, gt=0)
    """Requests that make a prefix shared."""
    namespaces: list[str] = Field(default_factory=list)
    """Namespaces holding documents (empty: all)."""
    window_s: float = Field(3600.0, gt=0)
    resend_s: float = Field(60.0, gt=0)
    """A request not answered by a change is asked again after this long."""


class RagWarm(TierPolicy):
    """Keep shared document prefixes warm on a persistent tier, across engine restarts.

    p is shared when requests(p) ≥ min_requests (in `namespaces`, if given). A shared p with no
    copy on `tier` yet and blocks on a faster tier is offloaded (copied) to `tier`. A shared p
    with no gpu blocks but a copy on `tier` (e.g. after a restart) and hits(p, window_s) > 0 is
    prefetched back to gpu. The same request for the same prefix is repeated at most once per
    resend_s.
    """

    name = "rag_warm"
    Knobs = RagWarmKnobs

    def __init__(self, knobs: BaseModel | None = None) -> None:
        super().__init__(knobs)
        self._asked: dict[tuple[PrefixId, DirectiveKind], float] = {}

    def decide(self, state: TierState) -> Sequence[Action]:
        k = cast(RagWarmKnobs, self.knobs)
        order = tuple(Tier)
        actions: list[Action] = []
        for p in state.prefixes:
            if p.requests < k.min_requests or (k.namespaces and p.namespace not in k.namespaces):
                continue
            fastest = p.fastest_tier
            copied = k.tier in p.copies or fastest is k.tier
            action: Action | None = None
            if not copied and fastest is not None and order.index(fastest) < order.index(k.tier):
                action = Action.on(DirectiveKind.OFFLOAD, p, k.tier)
            elif (
                copied
                and not p.blocks_by_tier.get(Tier.GPU)
                and p.hits_within(k.window_s, state.now) > 0
            ):
                action = Action.on(DirectiveKind.PREFETCH, p, Tier.GPU)
            if action is not None and self._due(p.id, action.kind, state.now, k.resend_s):
                actions.append(action)
        return actions

    def _due(self, pid: PrefixId, kind: DirectiveKind, now: float, resend_s: float) -> bool:
        """Whether asking `kind` for `pid` now repeats no request made in the last resend_s."""
        last = self._asked.get((pid, kind))
        if last is not None and now - last < resend_s:
            return False
        self._asked[(pid, kind)] = now
        return True


BUILTIN: dict[str, type[TierPolicy]] = {
    cls.name: cls for cls in (LruByTier, HotPrefixPin, TenantQuota, RagWarm)
}
