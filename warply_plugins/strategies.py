"""Discovery of user placement strategies: the `warply.strategies` entry-point group.

A package registers a strategy class with, in its pyproject:

    [project.entry-points."warply.strategies"]
    my_policy = "my_pkg.policies:MyPolicy"

This module only finds and loads the objects (it sits below the router and does not import it);
the router checks that each one is a `router.strategies.Strategy` subclass.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

GROUP = "warply.strategies"


class StrategyLoadError(LookupError):
    """A strategy name or `module:Class` path that cannot be loaded (the message says why)."""


def entry_point_names() -> list[str]:
    """Names registered under the `warply.strategies` group (nothing is imported)."""
    return sorted(ep.name for ep in entry_points(group=GROUP))


def load_entry_point(name: str) -> object | None:
    """The object registered as `name` in the group, or None when no such entry point exists."""
    for ep in entry_points(group=GROUP, name=name):
        try:
            found: object = ep.load()
        except Exception as exc:  # a broken plugin must name itself, not crash the router
            msg = f"entry point {GROUP}:{name} ({ep.value}) failed: {exc}"
            raise StrategyLoadError(msg) from exc
        return found
    return None


def load_path(spec: str) -> object:
    """The object at `module:attr` (e.g. `my_pkg.policies:MyPolicy`)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise StrategyLoadError(f"{spec!r} is not a `module:Class` path")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise StrategyLoadError(f"cannot import {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise StrategyLoadError(f"module {module_name!r} has no attribute {attr!r}") from None
