"""`StoreOutage`: a network store's failed calls, counted by operation and logged once per
outage, so the router keeps serving (without prefix matches) while the store is down."""

from __future__ import annotations

import logging
from collections import Counter

from router.index.contract import StoreUnavailable

_log = logging.getLogger("warply.router.index")


class StoreOutage:
    """Whether the store is down now, and how many calls failed since start-up, by operation."""

    def __init__(self) -> None:
        self.failures: Counter[str] = Counter()
        self.down = False

    def failed(self, op: str, exc: StoreUnavailable) -> None:
        """A call (`match`, `apply`, `drop_worker`, `stats`) failed; the first one logs."""
        self.failures[op] += 1
        if not self.down:
            self.down = True
            _log.warning("index store unreachable (%s): %s; placing without its matches", op, exc)

    def recovered(self) -> None:
        """A call succeeded: an outage in progress ends (logged)."""
        if self.down:
            self.down = False
            _log.warning(
                "index store reachable again (%d failed calls so far)", sum(self.failures.values())
            )
