"""Strategy lookup: builtin name, `warply.strategies` entry point, or `module:Class` path.

Knobs are validated against the class's own pydantic `Knobs` model; errors become
`ConfigError`s that name the field (`strategy.knobs.balance_abs: ...`).
"""

from __future__ import annotations

from pydantic import ValidationError

from router.config import ConfigError, StrategyConfig
from router.strategies import BUILTIN, Strategy
from warply_plugins.strategies import (
    StrategyLoadError,
    entry_point_names,
    load_entry_point,
    load_path,
)


def strategy_class(name: str) -> type[Strategy]:
    """The class for `name`; raises `ConfigError` saying what was tried."""
    try:
        if name in BUILTIN:
            return BUILTIN[name]
        found = load_path(name) if ":" in name else load_entry_point(name)
    except StrategyLoadError as exc:
        raise ConfigError(f"strategy.name: {exc}") from None
    if found is None:
        known = sorted(BUILTIN) + entry_point_names()
        raise ConfigError(
            f"strategy.name: unknown strategy {name!r} (known: {', '.join(known)}; "
            "or give a `module:Class` path)"
        )
    if not (isinstance(found, type) and issubclass(found, Strategy)):
        raise ConfigError(f"strategy.name: {name!r} is not a router.strategies.Strategy subclass")
    return found


def make_strategy(config: StrategyConfig) -> Strategy:
    """A fresh strategy instance with validated knobs (one per pool: some keep state)."""
    cls = strategy_class(config.name)
    try:
        knobs = cls.Knobs.model_validate(config.knobs)
    except ValidationError as err:
        details = "; ".join(
            f"strategy.knobs.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in err.errors()
        )
        raise ConfigError(f"invalid knobs for strategy {config.name!r}: {details}") from None
    return cls(knobs)
