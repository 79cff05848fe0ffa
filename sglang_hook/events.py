"""SGLang radix-cache events → Warply state events, and the page book L3 stores are reported from.

SGLang 0.5.23 records `BlockStored` / `BlockRemoved` / `AllBlocksCleared`
(`sglang.srt.disaggregation.kv_events`) with signed 64-bit page hashes, `medium` "GPU" for the
device tree and "CPU_PINNED" for the HiCache host tier, `cache_salt` on a chain's root and the
adapter's `lora_name`. They are normalised by `warply.protocol.normalize`, as
`warply.protocol.StreamDecoder` normalises a stock SGLang stream, so one page has one id, tier
and namespace on every path.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

from warply.protocol import (
    AllCleared,
    BlockStored,
    Event,
    EventError,
    Tier,
    block_removed,
    block_stored,
)


def to_warply(events: Iterable[Any], skipped: Counter[str] | None = None) -> list[Event]:
    """Convert one batch of SGLang KV events, in order.

    An event that cannot be normalised (a medium with no tier) is left out and counted in
    `skipped` by reason; this runs on the scheduler thread, so it never raises.
    """
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
        try:
            if isinstance(ev, SgStored):
                out.append(
                    block_stored(
                        ev.block_hashes,
                        ev.parent_block_hash,
                        ev.token_ids,
                        ev.block_size,
                        _medium(ev.medium),
                        lora_name=ev.lora_name,
                        cache_salt=ev.cache_salt,
                    )
                )
            elif isinstance(ev, SgRemoved):
                out.append(block_removed(ev.block_hashes, _medium(ev.medium)))
            elif isinstance(ev, SgCleared):
                # The radix cache clears the device tree (and the host tier with it) on reset.
                out.append(AllCleared(Tier.GPU))
                out.append(AllCleared(Tier.CPU))
        except EventError as exc:
            if skipped is not None:
                skipped[exc.reason.value] += 1
    return out


def _medium(medium: Any) -> Any:
    return getattr(medium, "value", medium)  # a `StorageMedium` member or its string


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
