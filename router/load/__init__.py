"""Worker load as placement reads it: the router's own bookings, and, with a shared store, the
bookings every other replica of the deployment published there.

- `ledger`: `LoadLedger` (the interface), `LocalLedger` (this process only, the default) and
  `open_ledger` (the ledger the router's `index` config names).
- `redis`: `RedisLedger`, bookings shared between replicas on the index's Redis / Valkey server.
"""

from router.load.ledger import LoadLedger, LocalLedger, open_ledger

__all__ = ["LoadLedger", "LocalLedger", "open_ledger"]
