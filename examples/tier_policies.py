"""User tier policies in under 30 lines each: keep conversations that come back on the GPU
(`KeepConversations`), promote recently used prefixes from the cpu tier (`PromoteRecent`).

Load them by path: `tiering.policy.name: examples.tier_policies:KeepConversations` (router), or
`--tier-policy examples.tier_policies:KeepConversations` (replay), from the repository root.
"""

from collections.abc import Sequence

from router.tiering import Action, Knobs, TierPolicy, TierState
from warply.protocol import DirectiveKind, Tier


class KeepConversationsKnobs(Knobs):
    hold_s: float = 60.0  # a conversation idle longer than this lets go of its pin
    per_worker: int = 16  # pins per worker at most, most recent conversations first


class KeepConversations(TierPolicy):
    """Pin the prefix of a conversation seen twice while it is active (promoting it from the
    cpu tier first if it fell there); unpin it once idle for `hold_s`."""

    name = "keep_conversations"
    Knobs = KeepConversationsKnobs

    def decide(self, state: TierState) -> Sequence[Action]:
        k = self.knobs
        assert isinstance(k, KeepConversationsKnobs)
        actions: list[Action] = []
        pins = {w: 0 for w in state.workers}
        for p in sorted(state.prefixes, key=lambda p: -p.last_use):
            active = state.now - p.last_use <= k.hold_s and p.requests >= 2
            if p.pinned and not active:
                actions.append(Action.on(DirectiveKind.UNPIN, p))
            elif p.pinned or (active and pins[p.worker] < k.per_worker):
                pins[p.worker] += 1
                if p.fastest_tier is Tier.CPU:
                    actions.append(Action.on(DirectiveKind.PREFETCH, p, Tier.GPU))
                elif not p.pinned and p.fastest_tier is Tier.GPU:
                    actions.append(Action.on(DirectiveKind.PIN, p, Tier.GPU))
        return actions


class PromoteRecentKnobs(Knobs):
    hold_s: float = 60.0  # prefixes used within this long are promoted
    min_requests: int = 2


class PromoteRecent(TierPolicy):
    """Promote to the GPU every recently used prefix that has blocks on the cpu tier."""

    name = "promote_recent"
    Knobs = PromoteRecentKnobs

    def decide(self, state: TierState) -> Sequence[Action]:
        k = self.knobs
        assert isinstance(k, PromoteRecentKnobs)
        return [
            Action.on(DirectiveKind.PREFETCH, p, Tier.GPU)
            for p in state.prefixes
            if p.requests >= k.min_requests
            and state.now - p.last_use <= k.hold_s
            and p.blocks_by_tier.get(Tier.CPU)
        ]
