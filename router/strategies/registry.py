"""Strategy lookup, for the router and the trace replayer alike: a built-in name, a
`warply.strategies` entry point, or a `module:Class` path.

A package registers a strategy class with, in its pyproject:

    [project.entry-points."warply.strategies"]
    my_policy = "my_pkg.policies:MyPolicy"

Knobs are validated against the class's own pydantic `Knobs` model; errors become `ConfigError`s
that name the field (`strategy.knobs.balance_abs: ...`).
"""

from __future__ import annotations

from collections.abc import Mapping

from router.config import ConfigError, StrategyConfig, check_knobs
from router.strategies.base import Strategy
from router.strategies.builtin import BUILTIN
from warply.common.loading import LoadError, entry_point_names, load_class

GROUP = "warply.strategies"

Extra = Mapping[str, type[Strategy]]
"""More names the caller knows (the replayer's models of other routers)."""


def known_names(extra: Extra | None = None) -> list[str]:
    """Every name `strategy_class` resolves without a `module:Class` path."""
    return sorted({*BUILTIN, *(extra or {}), *entry_point_names(GROUP)})


def strategy_class(name: str, extra: Extra | None = None) -> type[Strategy]:
    """The class for `name`; raises `ConfigError` saying what was tried."""
    known = {**BUILTIN, **(extra or {})}
    try:
        return load_class(name, GROUP, known, Strategy, "strategy", "router.strategies.Strategy")
    except LoadError as exc:
        raise ConfigError(f"strategy.name: {exc}") from None


def make_strategy(config: StrategyConfig, extra: Extra | None = None) -> Strategy:
    """A fresh strategy instance with validated knobs (one per pool: some keep state)."""
    cls = strategy_class(config.name, extra)
    knobs = check_knobs(cls.Knobs, config.knobs, "strategy.knobs", f"strategy {config.name!r}")
    return cls(knobs)
