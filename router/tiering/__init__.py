"""Tier policies: Python classes that see live cache state and return directives (pin, unpin,
prefetch, offload, evict, per-namespace quota) that the router sends to the engine plugins.

`state` (the snapshot and the prefix tracker), `base` (the contract, `Action`), `builtin`
(lru_by_tier, hot_prefix_pin, tenant_quota, rag_warm), `registry` (built-in, the
`warply.tier_policies` entry point, `module:Class`), `runner` (the router's periodic task),
`budget` (the pins it holds and the per-namespace pin budget).
"""

from router.tiering.base import Action, Knobs, TierPolicy, next_tier, tier_above
from router.tiering.builtin import BUILTIN, HotPrefixPin, LruByTier, RagWarm, TenantQuota
from router.tiering.registry import make_policy, policy_class
from router.tiering.runner import TierRunner
from router.tiering.state import PrefixState, PrefixTracker, TierState, WorkerState

__all__ = [
    "Action",
    "BUILTIN",
    "HotPrefixPin",
    "Knobs",
    "LruByTier",
    "PrefixState",
    "PrefixTracker",
    "RagWarm",
    "TenantQuota",
    "TierPolicy",
    "TierRunner",
    "TierState",
    "WorkerState",
    "make_policy",
    "next_tier",
    "policy_class",
    "tier_above",
]
