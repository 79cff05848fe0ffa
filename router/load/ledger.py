"""`LoadLedger`: where placement reads each candidate's load, and where this router's bookings
go when they change.

A router books every request attempt on its worker (`router.workers.Booking`): in flight, its
tokens, its uncached prompt as pending prefill until the first token. Only the router knows
these; the engines' own snapshots lag. One router alone reads its own figures
(`LocalLedger`). Replicas of one deployment behind a load balancer each see only their own
share, so a burst of new conversations split between them lands on the workers each of them
thinks idle, the same ones (a herd): `RedisLedger` publishes each replica's figures to the
shared store and adds the others' to what placement reads.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence

from router.config import IndexConfig
from router.index import StoreOutage
from router.strategies import WorkerLoad


class LoadLedger(abc.ABC):
    """Each worker's load as placement sees it; see the module docstring."""

    shared = False
    """Reads go to a server (placement then overlaps them with the index match)."""

    @abc.abstractmethod
    async def loads(self, local: Sequence[WorkerLoad]) -> Sequence[WorkerLoad]:
        """The candidates' loads (this router's, in `local`), with what other replicas booked
        on them added: new objects where that changes them, `local`'s own elsewhere."""

    def changed(self, load: WorkerLoad) -> None:  # noqa: B027 - a local ledger has no one to tell
        """A booking on `load`'s worker began, reached its first token or ended."""

    async def flush(self) -> None:  # noqa: B027 - a local ledger writes nothing
        """Wait until the changes made so far are written (or their write failed)."""

    def start(self, every: Callable[[], Iterable[WorkerLoad]]) -> None:  # noqa: B027
        """Begin background work (in the event loop); `every` lists all workers' own loads."""

    async def close(self) -> None:  # noqa: B027 - optional: a ledger without connections
        """Stop background work and withdraw this router's figures (shutdown)."""


class LocalLedger(LoadLedger):
    """This router's own bookings only (the default: one router, or no shared store)."""

    async def loads(self, local: Sequence[WorkerLoad]) -> Sequence[WorkerLoad]:
        return local


def open_ledger(config: IndexConfig, outage: StoreOutage) -> LoadLedger:
    """The shared ledger on the index's server when the store is `redis` and `share_load` is
    on (its failures counted in `outage`, the index's); the local one otherwise."""
    if config.store != "redis" or not config.share_load:
        return LocalLedger()
    # Imported here: only a router configured for it loads the Redis client.
    from router.load.redis import RedisLedger

    assert config.url is not None  # IndexConfig requires it for this store
    return RedisLedger(config.url, config.prefix, config.load_ttl_s, config.timeout_s, outage)
