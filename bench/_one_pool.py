"""The router side of the bench scripts that place requests in-process: one pool of `workers`
members at loopback URLs nothing listens on, all marked healthy (no health probe runs).
Not a benchmark; the scripts import it from their own folder."""

from __future__ import annotations

from router.config import RouterConfig
from router.index import PrefixIndex
from router.placement import Placement
from router.workers import Workers


def config(model: str, block_size: int, workers: int) -> RouterConfig:
    """A router config with one pool `p` of `workers` members `w0`, `w1`, ..."""
    return RouterConfig.model_validate(
        {
            "model": model,
            "tokenizer": "/unused",
            "pools": [
                {
                    "name": "p",
                    "block_size": block_size,
                    "workers": [
                        {"name": f"w{i}", "url": f"http://127.0.0.1:{9000 + i}"}
                        for i in range(workers)
                    ],
                }
            ],
        }
    )


def healthy_members(config: RouterConfig) -> Workers:
    """The config's workers, every one healthy."""
    members = Workers(config.pools)
    for w in members.values():
        w.healthy = True
    return members


def placement(config: RouterConfig, index: PrefixIndex) -> Placement:
    """Placement over `index` and the config's healthy workers, with its default strategy."""
    return Placement(config, index, healthy_members(config))
