"""Loading user objects by `module:attr` path or from an entry-point group.

Strategies (`warply.strategies`), alert callbacks and the replayer's cost models are all found
this way. This module only finds and loads objects; each caller checks what it got (e.g. that a
strategy is a `router.strategies.Strategy` subclass).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points


class LoadError(LookupError):
    """A name or `module:attr` path that cannot be loaded (the message says why)."""


def entry_point_names(group: str) -> list[str]:
    """Names registered under an entry-point `group` (nothing is imported)."""
    return sorted(ep.name for ep in entry_points(group=group))


def load_entry_point(group: str, name: str) -> object | None:
    """The object registered as `name` in `group`, or None when no such entry point exists."""
    for ep in entry_points(group=group, name=name):
        try:
            found: object = ep.load()
        except Exception as exc:  # a broken plugin must name itself, not crash its host
            raise LoadError(f"entry point {group}:{name} ({ep.value}) failed: {exc}") from exc
        return found
    return None


def load_path(spec: str) -> object:
    """The object at `module:attr` (e.g. `my_pkg.policies:MyPolicy`)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise LoadError(f"{spec!r} is not a `module:attr` path")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LoadError(f"cannot import {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise LoadError(f"module {module_name!r} has no attribute {attr!r}") from None
