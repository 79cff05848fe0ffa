"""Global prefix index: which worker holds which canonical block, on which tier.

- `contract`: the store contract (`IndexStore`, documented method by method) and its types.
- `ingest`: engine events → canonical key chains → store calls (shared by every store).
- `memory`: `MemoryStore`, the in-process store (the default).
- `prefix`: `PrefixIndex`, ingestion in front of a store (what the router and replayer use).
"""

from router.index.contract import IndexStats, IndexStore, WorkerMatch
from router.index.ingest import Ingest
from router.index.memory import MemoryStore, completed
from router.index.prefix import PrefixIndex

__all__ = [
    "IndexStats",
    "IndexStore",
    "Ingest",
    "MemoryStore",
    "PrefixIndex",
    "WorkerMatch",
    "completed",
]
