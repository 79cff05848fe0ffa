"""Directives applied to SGLang's radix cache; every call must come from the scheduler thread.

What SGLang 0.5.23 can do, through the cache's own API:

- pin / unpin: `lock(node)` / `unlock(tree_lock)` on the prefix's deepest cached node (locks the
  path to the root, so the eviction sweep skips it), optional TTL, capped by
  `max_pinned_fraction` of the KV pool.
- evict: drop the prefix's tail node when it is an unlocked device leaf. Only the Python tree
  core can tell a leaf apart; the Rust core has no node inspection and panics (poisoning the
  tree) on a non-leaf drop, so there the directive is rejected.
- prefetch (host → device, `load_back`) and offload (device → host backup, host → L3
  `write_backup_storage`) need HiCache's host tier (`cache_controller`); without it they are
  rejected with the reason.
- quota: rejected; neither the radix cache nor HiCache caps a namespace's bytes.

Prefixes are given by `token_ids` (truncated to whole pages, as SGLang caches only whole pages)
and `namespace` (the request's `cache_salt`); canonical `keys` cannot be mapped back to tokens here.
"""

from __future__ import annotations

import time
from array import array
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from warply.protocol import Directive, DirectiveAck, DirectiveKind, Tier


@dataclass
class _Pin:
    lock: Any
    tokens: int
    expires: float | None


class DirectiveApplier:
    """Applies directives to one `UnifiedRadixCache` (or any cache with its API)."""

    def __init__(self, tree_cache: Any, *, max_pinned_fraction: float = 0.5) -> None:
        self._cache = tree_cache
        self._page = int(tree_cache.page_size)
        self._pool_tokens = int(tree_cache.token_to_kv_pool_allocator.size)
        self._max_pinned_fraction = max_pinned_fraction
        self._pins: dict[tuple[str, tuple[int, ...]], _Pin] = {}

    @property
    def pinned_tokens(self) -> int:
        """Tokens held by live pins (each pin counts its whole prefix)."""
        return sum(p.tokens for p in self._pins.values())

    def apply(self, d: Directive) -> DirectiveAck:
        """Apply one directive and say how it went; never raises for a bad prefix."""
        self.expire()
        if d.kind is DirectiveKind.QUOTA:
            return DirectiveAck(
                d.id,
                False,
                "quota: SGLang 0.5.23's radix cache and HiCache have no per-namespace quota",
            )
        if not d.token_ids:
            return DirectiveAck(
                d.id, False, "SGLang hook needs token_ids (keys cannot be resolved)"
            )
        tokens = tuple(d.token_ids[: len(d.token_ids) // self._page * self._page])
        if not tokens:
            return DirectiveAck(d.id, False, f"prefix shorter than one page ({self._page} tokens)")
        if d.kind in (DirectiveKind.PREFETCH, DirectiveKind.OFFLOAD):
            return self._move(d, tokens)
        if d.tier not in (None, Tier.GPU):
            return DirectiveAck(
                d.id,
                False,
                f"{d.kind.value} on tier {d.tier.value}: the radix cache holds gpu only",
            )
        cached, node = self._match(tokens, d.namespace)
        if d.kind is DirectiveKind.UNPIN:
            return self._unpin(d, tokens, cached)
        if cached == 0:
            return DirectiveAck(d.id, False, "no cached blocks for this prefix")
        if d.kind is DirectiveKind.PIN:
            return self._pin(d, tokens, cached, node)
        return self._evict(d, cached, node)

    def expire(self) -> None:
        """Release pins whose TTL ran out."""
        now = time.monotonic()
        for key in [k for k, p in self._pins.items() if p.expires is not None and p.expires <= now]:
            self._cache.unlock(self._pins.pop(key).lock)

    def release_all(self) -> None:
        """Unlock every pin (shutdown)."""
        for pin in self._pins.values():
            self._cache.unlock(pin.lock)
        self._pins.clear()

    def _match(self, tokens: tuple[int, ...], namespace: str) -> tuple[int, Any]:
        key = RadixKey(array("q", tokens), cache_salt=namespace or None)
        result = self._cache.match_prefix(MatchPrefixParams(key=key))
        return int(result.device_prefix_len), result.last_device_node

    def _pin(self, d: Directive, tokens: tuple[int, ...], cached: int, node: Any) -> DirectiveAck:
        expires = time.monotonic() + d.ttl_s if d.ttl_s > 0 else None
        existing = self._pins.get((d.namespace, tokens))
        if existing is not None and existing.tokens == cached:
            existing.expires = expires
            return DirectiveAck(
                d.id, True, "already pinned; ttl renewed", blocks=cached // self._page
            )
        limit = int(self._max_pinned_fraction * self._pool_tokens)
        if self.pinned_tokens + cached > limit:
            return DirectiveAck(
                d.id,
                False,
                f"pinning {cached} more token(s) would exceed max_pinned_fraction "
                f"({self.pinned_tokens} of {limit} already pinned)",
            )
        if existing is not None:
            self._cache.unlock(existing.lock)
        self._pins[(d.namespace, tokens)] = _Pin(self._cache.lock(node), cached, expires)
        return DirectiveAck(d.id, True, blocks=cached // self._page)

    def _unpin(self, d: Directive, tokens: tuple[int, ...], cached: int) -> DirectiveAck:
        pin = self._pins.pop((d.namespace, tokens), None)
        if pin is None:
            if cached == 0:
                return DirectiveAck(d.id, False, "no cached blocks for this prefix")
            return DirectiveAck(d.id, True, "prefix was not pinned")
        self._cache.unlock(pin.lock)
        return DirectiveAck(d.id, True, blocks=pin.tokens // self._page)

    def _evict(self, d: Directive, cached: int, node: Any) -> DirectiveAck:
        core = self._cache.tree_core
        is_leaf = getattr(core, "_is_device_leaf", None)
        if is_leaf is None:
            return DirectiveAck(
                d.id,
                False,
                f"evict needs SGLang's Python tree core; {type(core).__name__} (SGLang 0.5.23) "
                "cannot inspect nodes and panics on dropping a non-leaf",
            )
        if not is_leaf(core.node_by_id(node)):
            return DirectiveAck(
                d.id,
                False,
                "prefix is locked (in use or pinned) or has longer cached continuations; "
                "SGLang 0.5.23 drops whole unlocked leaf nodes only",
            )
        freed: defaultdict[Any, int] = defaultdict(int)
        # SGLang 0.5.23 has no public "evict this node": the write-back fallback drops one
        # unlocked device leaf, frees its KV slots and records BlockRemoved like an LRU sweep.
        if not self._cache._drop_subtree_no_host(node, freed):
            return DirectiveAck(d.id, False, "SGLang declined to drop the prefix's node")
        tokens = sum(freed.values())
        return DirectiveAck(d.id, True, blocks=tokens // self._page)

    def _move(self, d: Directive, tokens: tuple[int, ...]) -> DirectiveAck:
        if getattr(self._cache, "cache_controller", None) is None:
            return DirectiveAck(
                d.id,
                False,
                f"{d.kind.value}: HiCache's host tier is not enabled on this worker "
                "(--enable-hierarchical-cache, which needs a GPU)",
            )
        key = RadixKey(array("q", tokens), cache_salt=d.namespace or None)
        match = self._cache.match_prefix(MatchPrefixParams(key=key))
        if d.kind is DirectiveKind.PREFETCH:
            if d.tier not in (None, Tier.GPU):
                return DirectiveAck(d.id, False, "prefetch promotes host pages to gpu only")
            if int(match.host_hit_length) == 0:
                return DirectiveAck(d.id, False, "no host-tier pages to load for this prefix")
            if not self._cache.load_back(match.best_match_node):
                return DirectiveAck(d.id, False, "HiCache declined the load-back (device full)")
            return DirectiveAck(d.id, True, blocks=int(match.host_hit_length) // self._page)
        node = match.last_device_node
        if int(match.device_prefix_len) == 0:
            return DirectiveAck(d.id, False, "no cached blocks for this prefix")
        if d.tier in (Tier.SSD, Tier.OBJECT_STORE):
            if not getattr(self._cache, "enable_storage", False):
                return DirectiveAck(d.id, False, "no HiCache storage backend (L3) attached")
            self._cache.write_backup_storage(node)
        elif d.tier in (None, Tier.CPU):
            if not self._cache.backup_node_for_write_back(node):
                return DirectiveAck(d.id, False, "HiCache could not back the prefix up to host")
        else:
            return DirectiveAck(d.id, False, "offload needs a slower tier than gpu")
        return DirectiveAck(d.id, True, blocks=int(match.device_prefix_len) // self._page)
