"""Tier-policy lookup: a built-in name, a `warply.tier_policies` entry point, or a
`module:Class` path (the same order as strategies, through `warply.common.loading`).

    [project.entry-points."warply.tier_policies"]
    my_policy = "my_pkg.tiers:MyPolicy"
"""

from __future__ import annotations

from router.config import ConfigError, TierPolicyConfig, check_knobs
from router.tiering.base import TierPolicy
from router.tiering.builtin import BUILTIN
from warply.common.loading import LoadError, load_class

GROUP = "warply.tier_policies"


def policy_class(name: str) -> type[TierPolicy]:
    """The class for `name`; raises `ConfigError` saying what was tried."""
    try:
        return load_class(
            name, GROUP, BUILTIN, TierPolicy, "tier policy", "router.tiering.TierPolicy"
        )
    except LoadError as exc:
        raise ConfigError(f"tiering.policy.name: {exc}") from None


def make_policy(config: TierPolicyConfig) -> TierPolicy:
    """A policy instance with validated knobs."""
    cls = policy_class(config.name)
    knobs = check_knobs(
        cls.Knobs, config.knobs, "tiering.policy.knobs", f"tier policy {config.name!r}"
    )
    return cls(knobs)
