"""Loading user objects by `module:attr` path or from an entry-point group.

Strategies (`warply.strategies`), tier policies (`warply.tier_policies`), alert callbacks and
the replayer's cost models are all found this way. `load_class` is the one lookup order for
named classes: built-in, then entry point, then `module:Class`, checked against a base class.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TypeVar, cast

_T = TypeVar("_T")


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


def load_class(
    name: str,
    group: str,
    builtin: Mapping[str, type[_T]],
    base: type,
    what: str,
    base_name: str,
) -> type[_T]:
    """The class `name` stands for: a `builtin` name, an entry point of `group`, or a
    `module:Class` path; it must subclass `base` (which may be abstract; `base_name` in errors).
    Raises `LoadError` saying what was tried, in terms of `what` (e.g. "strategy")."""
    if name in builtin:
        return builtin[name]
    found = load_path(name) if ":" in name else load_entry_point(group, name)
    if found is None:
        known = sorted({*builtin, *entry_point_names(group)})
        raise LoadError(
            f"unknown {what} {name!r} (known: {', '.join(known)}; or give a `module:Class` path)"
        )
    if not (isinstance(found, type) and issubclass(found, base)):
        raise LoadError(f"{name!r} is not a {base_name} subclass")
    return cast("type[_T]", found)
