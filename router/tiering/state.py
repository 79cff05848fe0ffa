"""What a tier policy sees: a typed snapshot of the cached prefixes the router has seen used,
per (namespace, prefix head, worker), and the bounded tracker that feeds it.

A tracked *prefix* is one segment of a radix tree of the key chains the router sent to one
worker (the first `max_blocks` blocks of each): a run of blocks that the same requests used,
split where their chains part. A system prompt all requests share is one prefix; each
conversation after it is another, starting at its first own block (the *head*). The tracker
learns them from the router's own request records (placement decision: namespace, key chain,
worker, matched blocks), so it needs no engine support; the runner adds where the index holds
those blocks (tiers, bytes) and what its own directives did (pins, copies).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from warply.protocol import Tier

PrefixId = tuple[str, int, str]
"""(namespace, head key, worker)."""


@dataclass(frozen=True, slots=True)
class PrefixState:
    """One tracked prefix on one worker, as the policy sees it."""

    namespace: str
    head: int
    """Canonical key of the prefix's first block."""
    worker: str
    keys: tuple[int, ...]
    """The prefix's canonical keys, from its head on (what directives name); the prefixes it
    continues are tracked separately."""
    requests: int
    """Requests routed to the worker whose chain went through this prefix (lifetime)."""
    hit_times: tuple[float, ...]
    """When those requests found its head cached there (index view), oldest first; bounded."""
    last_use: float
    blocks_by_tier: Mapping[Tier, int]
    """Leading blocks of `keys` the index holds on the worker, under their fastest tier."""
    block_bytes: int
    """KV bytes per block on the worker (0: not known)."""
    pinned: bool = False
    """A pin the runner sent was applied and not unpinned since."""
    copies: frozenset[Tier] = frozenset()
    """Tiers an applied offload of the runner's copied it to (the index counts a block under
    its fastest tier only, so a slower copy is known from the acks)."""
    pinned_on: frozenset[Tier] = frozenset()
    """Tiers an applied pin of the runner's holds it on (`pinned`: any)."""

    @property
    def id(self) -> PrefixId:
        return (self.namespace, self.head, self.worker)

    @property
    def blocks(self) -> int:
        return sum(self.blocks_by_tier.values())

    @property
    def fastest_tier(self) -> Tier | None:
        return min(self.blocks_by_tier, key=tuple(Tier).index, default=None)

    def bytes_on(self, tier: Tier) -> int:
        return self.blocks_by_tier.get(tier, 0) * self.block_bytes

    def hits_within(self, window_s: float, now: float) -> int:
        """Hits in the last `window_s` seconds before `now`."""
        return sum(1 for t in self.hit_times if t >= now - window_s)


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One worker as tier policies see it."""

    name: str
    pool: str
    kv_usage: float
    """The engine's KV occupancy (0..1) from its last load snapshot."""
    block_bytes: int
    bytes_by_tier: Mapping[Tier, int]
    """Everything the index holds for the worker, as KV bytes per (fastest) tier."""
    controllable: bool
    """It has a plugin control endpoint (directives can reach it)."""


@dataclass(frozen=True, slots=True)
class TierState:
    """The snapshot `TierPolicy.decide` gets each round."""

    now: float
    """Wall-clock seconds (`time.time()`), the clock of `hit_times` and `last_use`."""
    prefixes: Sequence[PrefixState]
    workers: Mapping[str, WorkerState] = field(default_factory=dict)

    def namespace_bytes(self) -> Counter[tuple[str, Tier]]:
        """KV bytes of the tracked prefixes per (namespace, tier), all workers together."""
        out: Counter[tuple[str, Tier]] = Counter()
        for p in self.prefixes:
            for tier in p.blocks_by_tier:
                out[(p.namespace, tier)] += p.bytes_on(tier)
        return out


@dataclass(slots=True)
class _Tracked:
    keys: list[int]
    hit_times: deque[float]
    requests: int = 0
    last_use: float = 0.0


class PrefixTracker:
    """The prefixes requests used, per (namespace, head, worker); LRU-bounded to `max_prefixes`
    entries of at most `max_blocks` keys and `max_hits` hit times each."""

    def __init__(self, max_prefixes: int = 1024, max_blocks: int = 64, max_hits: int = 256):
        self.max_prefixes = max_prefixes
        self.max_blocks = max_blocks
        self._max_hits = max_hits
        self._entries: OrderedDict[PrefixId, _Tracked] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(
        self, namespace: str, keys: Sequence[int], worker: str, matched: int, now: float
    ) -> None:
        """One request routed to `worker` with key chain `keys`, of which it held the first
        `matched` blocks: every prefix on its path is used; a prefix it leaves part-way is split
        there (both parts keep the history)."""
        chain = list(keys[: self.max_blocks])
        pos = 0
        while pos < len(chain):
            pid = (namespace, chain[pos], worker)
            entry = self._entries.get(pid)
            if entry is None:
                entry = self._add(pid, _Tracked(chain[pos:], deque(maxlen=self._max_hits)))
                common = len(entry.keys)
            else:
                self._entries.move_to_end(pid)
                common = 1
                while common < len(entry.keys) and pos + common < len(chain):
                    if entry.keys[common] != chain[pos + common]:
                        break
                    common += 1
                if common < len(entry.keys):
                    rest = entry.keys[common:]
                    tail = _Tracked(rest, deque(entry.hit_times, maxlen=self._max_hits))
                    tail.requests, tail.last_use = entry.requests, entry.last_use
                    if (namespace, rest[0], worker) not in self._entries:
                        self._add((namespace, rest[0], worker), tail)
                    del entry.keys[common:]
            entry.requests += 1
            entry.last_use = now
            if pos < matched:
                entry.hit_times.append(now)
            pos += common

    def _add(self, pid: PrefixId, entry: _Tracked) -> _Tracked:
        self._entries[pid] = entry
        while len(self._entries) > self.max_prefixes:
            self._entries.popitem(last=False)
        return entry

    def items(self) -> list[tuple[PrefixId, _Tracked]]:
        """Every tracked prefix, least recently used first."""
        return list(self._entries.items())
