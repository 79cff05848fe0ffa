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

__all__ = [
    "CacheRouting", "CacheStatsView", "DisaggEngine", "Engine", "ExportError", "KVTier", "Pool",
    "SpecError", "UpError", "__version__", "export_yaml", "load_spec",
]  # fmt: skip

_HOMES = {
    "CacheStatsView": "warply.stats",
    "UpError": "warply.lifecycle",
    "ExportError": "warply.export",
    "export_yaml": "warply.export",
}
"""The modules of the public names that are not specs; the specs come from `warply.spec`, which
says where each is defined."""

if TYPE_CHECKING:
    from warply.export import ExportError, export_yaml
    from warply.lifecycle import UpError
    from warply.spec import CacheRouting, DisaggEngine, Engine, KVTier, Pool, SpecError, load_spec
    from warply.stats import CacheStatsView


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'warply' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES.get(name, "warply.spec")), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
