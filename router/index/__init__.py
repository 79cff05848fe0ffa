"""Global prefix index: which worker holds which canonical block, on which tier.

- `contract`: the store contract (`IndexStore`, documented method by method) and its types.
- `ingest`: engine events → canonical key chains → store calls (shared by every store).
- `memory`: `MemoryStore`, the in-process store (the default).
- `redis`: `RedisStore`, a store on a Redis / Valkey server shared by router replicas.
- `factory`: `open_store`, the store the router's `index` config names.
- `outage`: `StoreOutage`, a network store's failed calls (the router serves through them).
- `prefix`: `PrefixIndex`, ingestion in front of a store (what the router and replayer use).
"""

from router.index.contract import (
    IndexStats,
    IndexStore,
    StoreUnavailable,
    WorkerMatch,
    shown_url,
)
from router.index.factory import open_store
from router.index.ingest import Ingest
from router.index.memory import MemoryStore, completed
from router.index.outage import StoreOutage
from router.index.prefix import PrefixIndex

__all__ = [
    "IndexStats",
    "IndexStore",
    "Ingest",
    "MemoryStore",
    "PrefixIndex",
    "StoreOutage",
    "StoreUnavailable",
    "WorkerMatch",
    "completed",
    "open_store",
    "shown_url",
]
