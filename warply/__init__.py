"""Warply: the control plane for KV-cache-aware serving across vLLM and SGLang.

    import warply as wp
    engine = wp.Engine(model="/models/m", pool=wp.Pool("cpu"))

`import warply` stays light (no torch, no engine, no ZMQ, no pydantic): engine plugins and the
router import `warply.protocol` cheaply. The SDK's names load on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "CacheRouting": "warply.spec.deployment",
    "DisaggEngine": "warply.spec.deployment",
    "Engine": "warply.spec.deployment",
    "Pool": "warply.spec.deployment",
    "SpecError": "warply.spec.deployment",
    "load_spec": "warply.spec.deployment",
    "KVTier": "warply.spec.tiers",
    "CacheStatsView": "warply.stats",
    "UpError": "warply.lifecycle",
    "ExportError": "warply.export",
    "export_yaml": "warply.export",
}
"""Public name → the module that defines it."""

if TYPE_CHECKING:
    from warply.export import ExportError, export_yaml
    from warply.lifecycle import UpError
    from warply.spec.deployment import (
        CacheRouting,
        DisaggEngine,
        Engine,
        Pool,
        SpecError,
        load_spec,
    )
    from warply.spec.tiers import KVTier
    from warply.stats import CacheStatsView

__all__ = [
    "CacheRouting", "CacheStatsView", "DisaggEngine", "Engine", "ExportError", "KVTier", "Pool",
    "SpecError", "UpError", "__version__", "export_yaml", "load_spec",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'warply' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
