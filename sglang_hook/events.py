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
    engine_block_id,
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


def _storage_seed(salt: str) -> str | None:
    """The seed of a salted storage chain (no `extra_key`: not a LoRA adapter's)."""
    from sglang.srt.mem_cache.utils import storage_namespace_seed

    seed: str | None = storage_namespace_seed(None, salt)
    return seed


def _medium(medium: Any) -> Any:
    return getattr(medium, "value", medium)  # a `StorageMedium` member or its string


class PageBook:
    """Bounded map page hash → (parent hash, page tokens, namespace), fed by device stores.

    An L3 backend only sees page-hash strings; the router needs the tokens to rebuild canonical
    keys, so L3 stores are reported from what the device tier published for the same page.
    Unsalted pages have the same hash in both chains. A salted page does not: SGLang 0.5.23
    seeds its events' chain with sha256("sglang-cache-salt-v1\\0" + salt)
    (`compute_node_event_hash_values`) and its storage keys' chain with
    `storage_namespace_seed(extra_key, salt)` (`get_storage_hash_str`, mem_cache/utils.py), so
    the book also derives each salted page's storage hash, with those SGLang functions, from
    its tokens and its parent's storage hash, and `page_id` maps an L3 key's id back to the
    event page. Pages of a LoRA adapter (whose id joins the storage seed as `extra_key`, and is
    not in the events) are not mapped. Thread-safe: HiCache calls the backend from its own I/O
    threads.
    """

    def __init__(self, max_pages: int = 1_000_000) -> None:
        self._max = max_pages
        self._pages: OrderedDict[int, tuple[int | None, list[int], str | None, int]] = OrderedDict()
        self._storage: dict[int, tuple[str, int]] = {}
        """Salted event page id → (its storage hash, the id of that hash)."""
        self._by_storage: dict[int, int] = {}
        """Storage hash id → event page id, for salted pages."""
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
                    self._map_salted(h, parent, tokens, namespace)
                    parent = h
            while len(self._pages) > self._max:
                gone, _ = self._pages.popitem(last=False)
                storage = self._storage.pop(gone, None)
                if storage is not None:
                    self._by_storage.pop(storage[1], None)

    def _map_salted(
        self, page: int, parent: int | None, tokens: list[int], namespace: str | None
    ) -> None:
        """Derive a salted page's storage hash: from the salt's seed at a chain's root, else
        from its parent's storage hash (a parent without one is unsalted, and so is it)."""
        if parent is None:
            if not namespace or "\0" in namespace:  # unsalted, or a LoRA adapter's
                return
            prior = _storage_seed(namespace)
        else:
            known = self._storage.get(parent)
            if known is None:
                return
            prior = known[0]
        from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

        storage = get_hash_str(tokens, prior)
        assert isinstance(storage, str)
        sid = engine_block_id(hash_str_to_int64(storage))
        self._storage[page] = (storage, sid)
        self._by_storage[sid] = page

    def page_id(self, storage_id: int) -> int:
        """The event page id of the page whose L3 key has id `storage_id` (the same id unless
        the page is salted)."""
        with self._lock:
            return self._by_storage.get(storage_id, storage_id)

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
