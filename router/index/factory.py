"""`open_store`: the index store a router's `index` config names (memory, or a shared server)."""

from __future__ import annotations

from router.config import ConfigError, IndexConfig
from router.index.contract import IndexStore
from router.index.memory import MemoryStore


def open_store(config: IndexConfig) -> IndexStore:
    """The configured store; a shared one is reached once first, so a wrong url or a server
    that is down fails start-up with `StoreUnavailable` instead of every later call."""
    if config.store == "memory":
        return MemoryStore(config.max_entries)
    # Imported here: only a router configured for it loads the Redis client.
    try:
        from router.index.redis import RedisStore
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"index.store: redis needs the `{exc.name}` package (pip install 'warply[redis]')"
        ) from None

    assert config.url is not None  # IndexConfig requires it for this store
    store = RedisStore(config.url, config.prefix, config.max_entries, config.timeout_s)
    store.check()
    return store
