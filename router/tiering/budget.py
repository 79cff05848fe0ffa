"""`PinLedger`: the pins the tier runner's directives hold, per (prefix, tier), with their bytes,
and the per-namespace pin budget (`tiering.pin_budget`) they are held to.

A namespace's pinned bytes are the sum over its pins on every tier (device pins, a Mooncake
store's soft pins, ...) and every worker. A pin is charged, when admitted, at its prefix's full
size (keys × the worker's bytes per block: it cannot hold more); once applied, at the blocks the
plugin's ack says it pinned. A pin whose size is not known (bytes per block 0, no keys) is
refused for a namespace with a budget: an unchecked pin could exceed it. A pin with no tier is
a device pin (the plugins read it so).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

from router.config import PinBudgetConfig
from router.tiering.state import PrefixId
from warply.protocol import Tier

PinKey = tuple[PrefixId, Tier]


class Refusal(StrEnum):
    """Why a pin was refused (the `reason` label of `warply_tiering_pins_refused_total`)."""

    OVER_BUDGET = "over_budget"
    """Its bytes on top of the namespace's pinned bytes exceed the budget (or the budget is 0)."""
    UNKNOWN_BYTES = "unknown_bytes"
    """The pin's size is not known (worker's bytes per block 0, or no keys) under a budget."""


@dataclass(slots=True)
class _Pin:
    nbytes: int
    until: float | None
    """When its TTL ends, on the runner's clock (None: until unpinned)."""


class PinLedger:
    """Applied and in-flight pins per (prefix, tier), checked against `tiering.pin_budget`."""

    def __init__(self, config: PinBudgetConfig) -> None:
        self.config = config
        self._held: dict[PinKey, _Pin] = {}
        self._pending: dict[PinKey, int] = {}
        """Bytes reserved by pins sent and not answered yet."""

    def __len__(self) -> int:
        return len({pid for pid, _ in self._held})

    def tiers(self, pid: PrefixId) -> frozenset[Tier]:
        """The tiers `pid` holds an applied pin on."""
        return frozenset(tier for (held, tier) in self._held if held == pid)

    def pinned_bytes(self) -> Counter[tuple[str, Tier]]:
        """Applied pinned bytes per (namespace, tier), every worker together."""
        out: Counter[tuple[str, Tier]] = Counter()
        for ((namespace, _, _), tier), pin in self._held.items():
            out[(namespace, tier)] += pin.nbytes
        return out

    def _charged(self, namespace: str) -> int:
        """Bytes `namespace` holds or has in flight, all tiers and workers."""
        held = sum(p.nbytes for ((ns, _, _), _), p in self._held.items() if ns == namespace)
        return held + sum(n for ((ns, _, _), _), n in self._pending.items() if ns == namespace)

    def reserve(self, key: PinKey, nbytes: int | None) -> Refusal | None:
        """Admit a pin of `nbytes` (None: not known) and reserve them until `settle`, or say
        why not. Re-pinning a pinned prefix on the same tier is charged the difference."""
        namespace = key[0][0]
        limit = self.config.limit(namespace)
        if limit is None:
            self._pending[key] = self._pending.get(key, 0) + (nbytes or 0)
            return None
        if nbytes is None:
            return Refusal.UNKNOWN_BYTES
        held = self._held.get(key)
        extra = nbytes - (held.nbytes if held is not None else 0)
        if limit == 0 or self._charged(namespace) + max(extra, 0) > limit:
            return Refusal.OVER_BUDGET
        self._pending[key] = self._pending.get(key, 0) + max(extra, 0)
        return None

    def settle(self, key: PinKey, nbytes: int | None, until: float | None) -> None:
        """A reserved pin's answer: applied holding `nbytes` (None: not applied)."""
        self._pending.pop(key, None)
        if nbytes is not None:
            self._held[key] = _Pin(nbytes, until)

    def release(self, pid: PrefixId, tier: Tier | None = None) -> None:
        """`pid`'s pin on `tier` is gone (None: on every tier)."""
        for key in [k for k in self._held if k[0] == pid and tier in (None, k[1])]:
            del self._held[key]

    def expire(self, now: float) -> None:
        """Drop pins whose TTL ended by `now`."""
        for key in [k for k, p in self._held.items() if p.until is not None and p.until <= now]:
            del self._held[key]
