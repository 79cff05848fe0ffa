"""Tier names and the map from engine storage media to Warply tiers."""

from __future__ import annotations

from enum import StrEnum


class Tier(StrEnum):
    """Where a KV block lives, fastest first."""

    GPU = "gpu"
    CPU = "cpu"
    SSD = "ssd"
    OBJECT_STORE = "object_store"


# Engine `medium` strings as they appear in vLLM / SGLang / LMCache KV events. vLLM 0.32 reports
# "GPU" for device blocks even on its CPU backend, so "GPU" always means "engine-resident";
# its offloading connectors report "CPU" and "STORAGE" (`vllm.distributed.kv_events.MEDIUM_*`).
_MEDIUM_TO_TIER: dict[str, Tier] = {
    "GPU": Tier.GPU,
    "DEVICE": Tier.GPU,
    "CUDA": Tier.GPU,
    "CPU": Tier.CPU,
    "CPU_PINNED": Tier.CPU,
    "CPU_TIER1": Tier.CPU,
    "HOST": Tier.CPU,
    "DISK": Tier.SSD,
    "NVME": Tier.SSD,
    "SSD": Tier.SSD,
    "CPU_TIER2": Tier.SSD,
    "STORAGE": Tier.SSD,
    "LOCAL_DISK": Tier.SSD,
    "EXTERNAL": Tier.OBJECT_STORE,
    "REMOTE": Tier.OBJECT_STORE,
    "OBJECT_STORE": Tier.OBJECT_STORE,
    "S3": Tier.OBJECT_STORE,
}


def tier_for_medium(medium: str | None) -> Tier | None:
    """Map an engine medium to a tier; `None` (engines omit it for device blocks) means GPU.

    Returns None for a medium no engine is known to send. The one policy for that case, on every
    path (decoder, vLLM and SGLang plugins, through `warply.protocol.normalize.event_tier`): the
    event is skipped and counted, never guessed onto a tier and never raised into an engine.
    """
    if medium is None or medium == "":
        return Tier.GPU
    return _MEDIUM_TO_TIER.get(medium.upper())
