"""SDK specs: what a user declares, validated with pydantic, rendered into engine and backend
configuration (`tiers`: `KVTier`; `backends`: the flags, JSON and command lines it becomes)."""

from warply.spec.backends import SglangTiering, VllmTiering, render_sglang, render_vllm
from warply.spec.tiers import KVTier

__all__ = ["KVTier", "SglangTiering", "VllmTiering", "render_sglang", "render_vllm"]
