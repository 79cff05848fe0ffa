"""SDK specs: what a user declares, validated with pydantic, rendered into engine and backend
configuration (`deployment`: `Engine`, `DisaggEngine`, `Pool`, `CacheRouting`; `tiers`:
`KVTier`; `backends`: the flags, JSON and command lines the tiers become)."""

from warply.spec.backends import SglangTiering, VllmTiering, render_sglang, render_vllm
from warply.spec.deployment import (
    CacheRouting,
    Deployment,
    DisaggEngine,
    Engine,
    Pool,
    SpecError,
    load_spec,
)
from warply.spec.tiers import KVTier

__all__ = [
    "CacheRouting", "Deployment", "DisaggEngine", "Engine", "KVTier", "Pool", "SglangTiering",
    "SpecError", "VllmTiering", "load_spec", "render_sglang", "render_vllm",
]  # fmt: skip
