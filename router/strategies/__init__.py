"""Placement strategies: turn the index's prefix matches plus worker load into one choice.

Every strategy is a class with a `name`, a pydantic `Knobs` model (validated config with precise
errors), `choose()` and optionally `explain()`, the scores behind a choice (`base`). The router
and the trace replayer load them through the same `registry`: the built-ins (`builtin`), the
`warply.strategies` entry-point group, or a `module:Class` path.
"""

from router.strategies.adaptive import AdaptiveAffinity
from router.strategies.base import (
    NO_MATCH,
    Knobs,
    NoCandidate,
    Pick,
    RequestView,
    Score,
    Strategy,
    TierWeights,
    WorkerLoad,
    imbalanced,
)
from router.strategies.builtin import (
    BUILTIN,
    KvReuse,
    LeastLoaded,
    PrefixAffinity,
    RoundRobin,
    TenantIsolated,
)
from router.strategies.cost import CostAware
from router.strategies.registry import known_names, make_strategy, strategy_class

__all__ = [
    "AdaptiveAffinity",
    "BUILTIN",
    "CostAware",
    "NO_MATCH",
    "Knobs",
    "KvReuse",
    "LeastLoaded",
    "NoCandidate",
    "Pick",
    "PrefixAffinity",
    "RequestView",
    "RoundRobin",
    "Score",
    "Strategy",
    "TenantIsolated",
    "TierWeights",
    "WorkerLoad",
    "imbalanced",
    "known_names",
    "make_strategy",
    "strategy_class",
]
