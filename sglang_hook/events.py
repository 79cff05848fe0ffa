"""SGLang radix-cache events → Warply state events, and the page book L3 stores are reported from.

SGLang 0.5.23 records `BlockStored` / `BlockRemoved` / `AllBlocksCleared`
(`sglang.srt.disaggregation.kv_events`) with signed 64-bit page hashes, `medium` "GPU" for the
device tree and "CPU_PINNED" for the HiCache host tier, and `cache_salt` on a chain's root.
Hashes are folded to u64 here, as `warply.protocol.StreamDecoder` does for engine streams, so one
page has one id on every path.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from warply.protocol import AllCleared, BlockRemoved, BlockStored, Event, Tier, tier_for_medium

_U64 = (1 << 64) - 1


def engine_hash(value: int) -> int:
    """SGLang's signed int64 page hash as the u64 id Warply streams carry."""
    return value & _U64


def _tier(medium: Any) -> Tier:
    name = getattr(medium, "value", medium)
    tier = tier_for_medium(name)
    if tier is None:
        raise ValueError(f"SGLang medium {name!r} has no Warply tier")
    return tier


def to_warply(events: Iterable[Any]) -> list[Event]:
    """Convert one batch of SGLang KV events, in order."""
    from sglang.srt.disaggregation.kv_events import (
        AllBlocksCleared as SgCleared,
    )
    from sglang.srt.disaggregation.kv_events import (
        BlockRemoved as SgRemoved,
    )
    from sglang.srt.disaggregation.kv_events import (
        BlockStored as SgStored,
    )

    out: list[Event] = []
    for ev in events:
        if isinstance(ev, SgStored):
            parent = None if ev.parent_block_hash is None else engine_hash(ev.parent_block_hash)
            out.append(
                BlockStored(
                    block_hashes=[engine_hash(h) for h in ev.block_hashes],
                    parent_hash=parent,
                    token_ids=list(ev.token_ids),
                    block_size=ev.block_size,
                    tier=_tier(ev.medium),
                    namespace=(ev.cache_salt or "") if parent is None else None,
                    lora=ev.lora_name,
                )
            )
        elif isinstance(ev, SgRemoved):
            out.append(
                BlockRemoved([engine_hash(h) for h in ev.block_hashes], tier=_tier(ev.medium))
            )
        elif isinstance(ev, SgCleared):
            # The radix cache clears the device tree (and the host tier with it) on reset.
            out.append(AllCleared(Tier.GPU))
            out.append(AllCleared(Tier.CPU))
    return out


class PageBook:
    """Bounded map page hash → (parent hash, page tokens, namespace), fed by device stores.

    An L3 backend only sees page-hash strings; the router needs the tokens to rebuild canonical
    keys, so L3 stores are reported from what the device tier published for the same page.
    Thread-safe: HiCache calls the backend from its own I/O threads.
    """

    def __init__(self, max_pages: int = 1_000_000) -> None:
        self._max = max_pages
        self._pages: OrderedDict[int, tuple[int | None, list[int], str | None, int]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, events: Iterable[Event]) -> None:
        """Remember every page of the `BlockStored` events in `events`."""
        with self._lock:
            for ev in events:
                if not isinstance(ev, BlockStored):
                    continue
                parent = ev.parent_hash
                size = ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    tokens = ev.token_ids[i * size : (i + 1) * size]
                    namespace = ev.namespace if i == 0 else None
                    self._pages[h] = (parent, tokens, namespace, size)
                    self._pages.move_to_end(h)
                    parent = h
            while len(self._pages) > self._max:
                self._pages.popitem(last=False)

    def stored(self, hashes: list[int], tier: Tier) -> BlockStored | None:
        """A `BlockStored` on `tier` for a chain of known pages; None if the first is unknown.

        Stops at the first unknown page or chain break (the rest cannot be keyed).
        """
        with self._lock:
            first = self._pages.get(hashes[0]) if hashes else None
            if first is None:
                return None
            parent, tokens, namespace, size = first
            kept, all_tokens = [hashes[0]], list(tokens)
            for h in hashes[1:]:
                page = self._pages.get(h)
                if page is None or page[0] != kept[-1]:
                    break
                kept.append(h)
                all_tokens.extend(page[1])
        return BlockStored(kept, parent, all_tokens, size, tier, namespace)
