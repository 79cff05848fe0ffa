"""Global prefix index: which worker holds which canonical block, on which tier."""

from router.index.memory import IndexStats, MemoryIndex, PrefixIndex, WorkerMatch

__all__ = ["IndexStats", "MemoryIndex", "PrefixIndex", "WorkerMatch"]
