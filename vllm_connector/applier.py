"""Directives on vLLM: a control socket (its own thread) and their application (scheduler thread).

The control thread only decodes and queues; `DirectiveApplier.drain()` runs from a scheduler-side
connector hook, so the block pool is only ever touched by the scheduler's thread. What vLLM 0.32
can really do on its device tier:

- evict: drop the prefix's cached blocks that no request holds (`BlockPool.evict_blocks`);
  blocks in use or pinned are kept and counted in the reason.
- pin / unpin: hold / release one reference per block (`BlockPool.touch` / `free_blocks`), so
  the LRU never reuses them; capped by `max_pinned_fraction`, optional TTL.
- prefetch / offload, or any tier other than the device: rejected; vLLM has no API to move a
  cached block between tiers, and connectors expose none either.
- quota: rejected; the block pool has no per-namespace quota.
- with an LMCache MP server behind the delegate (`lmcache_url`), through its HTTP API
  (`vllm_connector.lmcache`): evict on the cpu, ssd or object_store tier drops the prefix's
  whole chunks from LMCache's L1 or from the L2 adapter holding that tier; prefetch to the cpu
  tier loads them from L2 into L1; offload to the ssd or object_store tier is applied when that
  adapter's own listing already holds every whole chunk (LMCache's store policy writes them
  there; it has no L1 -> L2 push); other kinds are rejected with what LMCache 0.5.6 lacks.
- with a Mooncake store behind the delegate (`mooncake_url`, `vllm_connector.mooncake`), on the
  cpu tier: evict removes the prefix's objects (leased ones are kept and counted), pin / unpin
  set or clear their soft pin; prefetch, offload are rejected (no tier below the store's memory).

Every directive gets a `DirectiveAck`, as the reply on the control socket and on the state stream.
"""

from __future__ import annotations

import functools
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    hash_block_tokens,
    maybe_convert_block_hash,
)

from vllm_connector.export import StateExporter, engine_hash
from vllm_connector.lmcache import LMCacheError, LMCacheServer
from vllm_connector.mooncake import MooncakeError, MooncakeStore
from warply.protocol import Directive, DirectiveAck, DirectiveKind, Tier
from warply.protocol.control import ControlServer

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock

_LMCACHE_TIERS = (Tier.CPU, Tier.SSD, Tier.OBJECT_STORE)
"""Tiers an LMCache MP server holds (L1, and its L2 adapters)."""


def find_engine_wakeup() -> Callable[[], None] | None:
    """A callable that wakes an idle EngineCore busy loop, or None if it cannot be found.

    vLLM 0.32's EngineCoreProc blocks on its private `input_queue` while idle and steps only
    when a message arrives; the connector is constructed inside `EngineCoreProc.__init__` after
    that queue exists, so it is found on the call stack. A WAKEUP there is a no-op message that
    makes the loop re-check `has_work()`, which includes `has_pending_push_work()`.
    """
    from vllm.v1.engine import EngineCoreRequestType

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        input_queue = getattr(owner, "input_queue", None)
        if isinstance(input_queue, queue.Queue):
            return functools.partial(input_queue.put_nowait, (EngineCoreRequestType.WAKEUP, None))
        frame = frame.f_back  # type: ignore[assignment]
    return None


@dataclass
class _Pin:
    block: KVCacheBlock
    refs: int
    expires: float | None


class DirectiveApplier:
    """Applies queued directives to the device block pool (`drain()`: scheduler thread only)."""

    def __init__(
        self,
        server: ControlServer,
        exporter: StateExporter,
        *,
        hash_fn: Callable[[Any], bytes],
        max_pinned_fraction: float,
        delegate_name: str | None,
        on_result: Callable[[bool], None],
        on_refused: Callable[[int], None],
        lmcache: LMCacheServer | None = None,
        lmcache_identity: Callable[[], tuple[str, int]] | None = None,
        mooncake: MooncakeStore | None = None,
    ) -> None:
        self._server = server
        self._exporter = exporter
        self._hash_fn = hash_fn
        self._max_pinned_fraction = max_pinned_fraction
        self._delegate_name = delegate_name
        self._on_result = on_result
        self._on_refused = on_refused
        self._refused = 0
        """Messages the control socket refused (unsigned, bad signature, stale, replayed,
        undecodable) that `on_refused` has been told about."""
        self._lmcache = lmcache
        self._lmcache_identity = lmcache_identity
        """(model name, world size) the delegate registered with LMCache (its object keys)."""
        self._mooncake = mooncake
        self._pool: BlockPool | None = None
        self._pins: dict[int, _Pin] = {}

    def bind(self, pool: BlockPool) -> None:
        """The pool to act on (from the connector's bind hooks)."""
        self._pool = pool

    def pending(self) -> bool:
        """Whether directives wait to be applied (keeps an idle engine stepping)."""
        return not self._server.inbox.empty()

    def drain(self) -> None:
        """Count refused messages, expire pins, then apply and acknowledge every queued
        directive."""
        refused = self._server.refused
        if refused != self._refused:
            self._on_refused(refused - self._refused)
            self._refused = refused
        self._expire_pins()
        for ack in self._server.apply_pending(self._apply):
            self._on_result(ack.applied)
            self._exporter.ack(ack)

    def close(self) -> None:
        """Release every pin (the blocks go back to the LRU)."""
        if self._pool is not None and self._pins:
            self._pool.free_blocks([p.block for p in self._pins.values() for _ in range(p.refs)])
        self._pins.clear()

    def _apply(self, d: Directive) -> DirectiveAck:
        if d.kind is DirectiveKind.QUOTA:
            via = f"; delegate {self._delegate_name} exposes none" if self._delegate_name else ""
            return DirectiveAck(
                d.id,
                False,
                f"quota: vLLM 0.32's block pool has no per-namespace (cache_salt) quota{via}",
            )
        if d.tier in _LMCACHE_TIERS and self._lmcache is not None:
            return self._apply_lmcache(d)
        if self._pool is None:
            return DirectiveAck(d.id, False, "the block pool is not bound yet")
        if d.tier is Tier.CPU and self._mooncake is not None:
            return self._apply_mooncake(d)
        if d.kind in (DirectiveKind.PREFETCH, DirectiveKind.OFFLOAD):
            via = (
                f" (delegate {self._delegate_name} has no such API)" if self._delegate_name else ""
            )
            return DirectiveAck(
                d.id,
                False,
                f"{d.kind.value}: vLLM 0.32 cannot move cached blocks between tiers{via}",
            )
        if d.tier not in (None, Tier.GPU):
            return DirectiveAck(
                d.id, False, f"tier {d.tier.value}: vLLM's block pool holds only the device tier"
            )
        blocks, why = self._resolve(d)
        if not blocks:
            return DirectiveAck(d.id, False, why or "no cached blocks for this prefix")
        if d.kind is DirectiveKind.EVICT:
            return self._evict(d, blocks)
        if d.kind is DirectiveKind.PIN:
            return self._pin(d, blocks)
        return self._unpin(d, blocks)

    def _apply_lmcache(self, d: Directive) -> DirectiveAck:
        """A lower-tier directive through LMCache's HTTP API (a loopback call on this thread)."""
        assert self._lmcache is not None and self._lmcache_identity is not None
        assert d.tier is not None
        prefetch = d.kind is DirectiveKind.PREFETCH and d.tier is Tier.CPU
        copy = d.kind is DirectiveKind.OFFLOAD and d.tier is not Tier.CPU
        if d.kind is not DirectiveKind.EVICT and not prefetch and not copy:
            return DirectiveAck(
                d.id,
                False,
                f"{d.kind.value} on the {d.tier.value} tier: LMCache 0.5.6's MP server has no "
                "API for it (no pin; /cache/prefetches moves L2 -> L1 only; no L1 -> L2 push; "
                "/quota scopes L2 adapters)",
            )
        tokens = d.token_ids or self._exporter.tokens_for(d.keys or [])
        if not tokens:
            return DirectiveAck(
                d.id,
                False,
                f"{d.kind.value} on the {d.tier.value} tier needs token_ids, or keys of blocks "
                "this worker stored lately (LMCache keys chunks by tokens)",
            )
        try:
            model, world_size = self._lmcache_identity()
            if prefetch:
                chunks = self._lmcache.prefetch(tokens, d.namespace, model, world_size)
                why = "" if chunks else "no whole chunk of this prefix is on LMCache's L2"
                return DirectiveAck(d.id, chunks > 0, why, blocks=chunks)
            if copy:
                return self._copied(d, tokens, model, world_size)
            deleted, locked = self._lmcache.evict(d.tier, tokens, d.namespace, model, world_size)
        except LMCacheError as exc:
            return DirectiveAck(d.id, False, f"LMCache: {exc}")
        reason = f"kept {locked} locked chunk(s)" if locked else ""
        if not deleted and not locked:
            reason = f"no whole chunk of this prefix is in LMCache's {d.tier.value} tier"
        return DirectiveAck(d.id, deleted > 0, reason, blocks=deleted)

    def _copied(self, d: Directive, tokens: list[int], model: str, world_size: int) -> DirectiveAck:
        """An offload to an L2 tier: LMCache 0.5.6 has no L1 -> L2 push, its store policy
        writes every chunk to every adapter; the offload holds (applied) when the adapter's own
        listing has every whole chunk of the prefix."""
        assert self._lmcache is not None and d.tier is not None
        try:
            held, chunks = self._lmcache.held(d.tier, tokens, d.namespace, model, world_size)
        except LMCacheError as exc:
            why = f"offload: LMCache has no L1 -> L2 push, and no copy is confirmed: {exc}"
            return DirectiveAck(d.id, False, why)
        if chunks and held == chunks:
            return DirectiveAck(d.id, True, blocks=held)
        return DirectiveAck(
            d.id,
            False,
            f"offload: LMCache has no L1 -> L2 push; {chunks - held} of {chunks} whole chunk(s) "
            f"are not on its {d.tier.value} tier",
        )

    def _apply_mooncake(self, d: Directive) -> DirectiveAck:
        """A cpu-tier directive on the Mooncake store's objects of the prefix (loopback calls to
        its master on this thread)."""
        assert self._mooncake is not None
        if d.kind in (DirectiveKind.PREFETCH, DirectiveKind.OFFLOAD):
            return DirectiveAck(
                d.id,
                False,
                f"{d.kind.value} on the cpu tier: the Mooncake store is the only tier below the "
                "device (MooncakeStoreConnector stores every block and loads it when a request "
                "needs it; vLLM 0.32 reaches Mooncake's SSD only through an external client)",
            )
        hashes = self._prefix_hashes(d)
        if not hashes:
            return DirectiveAck(
                d.id,
                False,
                f"{d.kind.value} on the cpu tier needs token_ids, or keys of blocks this worker "
                "stored lately (Mooncake keys objects by vLLM block hashes)",
            )
        try:
            keys = self._mooncake.keys_for(hashes)
            if not keys:
                return DirectiveAck(
                    d.id, False, "no block of this prefix is in the Mooncake store", blocks=0
                )
            if d.kind is DirectiveKind.EVICT:
                gone = self._mooncake.remove(keys)
                self._export_removed(hashes, keys, gone.removed)
                kept = [f"kept {gone.leased} leased object(s)"] if gone.leased else []
                kept += [f"{gone.failed} removal(s) failed"] if gone.failed else []
                n = len(gone.removed)
                return DirectiveAck(d.id, n > 0, "; ".join(kept), blocks=n)
            pinned = self._mooncake.soft_pin(keys, d.kind is DirectiveKind.PIN, d.ttl_s)
        except MooncakeError as exc:
            return DirectiveAck(d.id, False, f"Mooncake: {exc}")
        why = "" if pinned else "the prefix's objects left the store meanwhile"
        return DirectiveAck(d.id, pinned > 0, why, blocks=pinned)

    def _export_removed(self, hashes: list[BlockHash], keys: list[str], removed: list[str]) -> None:
        """Export a cpu-tier removal of the blocks none of whose objects (one per rank / group)
        is left, as the delegate's own events are exported (MooncakeStoreConnector reports its
        stores as cpu-tier events, never a removal)."""
        left = {MooncakeStore.block_hash_hex(k) for k in set(keys) - set(removed)}
        done = {MooncakeStore.block_hash_hex(k) for k in removed} - left
        gone = [maybe_convert_block_hash(h) for h in hashes if h.hex() in done]
        if gone:
            self._exporter.add_delegate_events([VllmBlockRemoved(gone, medium="cpu")])

    def _prefix_hashes(self, d: Directive) -> list[BlockHash]:
        """vLLM block hashes of the directive's whole blocks: all of `token_ids`, or the blocks
        of its keys (hashed from the tokens of the prefix's root, as vLLM chains them)."""
        if d.token_ids:
            return self._hash_chain(d.token_ids, d.namespace)
        tokens = self._exporter.tokens_for(d.keys or [])
        if not tokens or not d.keys:
            return []
        return self._hash_chain(tokens, d.namespace)[-len(d.keys) :]

    def _hash_chain(self, tokens: list[int], namespace: str) -> list[BlockHash]:
        assert self._pool is not None
        size = self._pool.hash_block_size
        parent: BlockHash | None = None
        out: list[BlockHash] = []
        for i in range(len(tokens) // size):
            # vLLM 0.32 folds cache_salt into the first block's extra keys, tagged like this
            # (kv_cache_utils.generate_block_hash_extra_keys).
            extra = (("cache_salt", namespace),) if i == 0 and namespace else None
            parent = hash_block_tokens(
                self._hash_fn, parent, tokens[i * size : (i + 1) * size], extra
            )
            out.append(parent)
        return out

    def _evict(self, d: Directive, blocks: list[KVCacheBlock]) -> DirectiveAck:
        assert self._pool is not None
        in_use = [b for b in blocks if b.ref_cnt > 0]
        free = {b.block_id for b in blocks if b.ref_cnt == 0}
        self._pool.evict_blocks(free)
        reason = ""
        if in_use:
            pinned = sum(1 for b in in_use if b.block_id in self._pins)
            reason = f"kept {len(in_use)} block(s) in use ({pinned} pinned)"
        return DirectiveAck(d.id, bool(free), reason or "", blocks=len(free))

    def _pin(self, d: Directive, blocks: list[KVCacheBlock]) -> DirectiveAck:
        assert self._pool is not None
        new = [b for b in blocks if b.block_id not in self._pins]
        limit = int(self._max_pinned_fraction * (self._pool.num_gpu_blocks - 1))
        if len(self._pins) + len(new) > limit:
            return DirectiveAck(
                d.id,
                False,
                f"pinning {len(new)} more block(s) would exceed max_pinned_fraction "
                f"({len(self._pins)} of {limit} already pinned)",
            )
        self._pool.touch(blocks)
        expires = time.monotonic() + d.ttl_s if d.ttl_s > 0 else None
        for b in blocks:
            pin = self._pins.get(b.block_id)
            if pin is None:
                self._pins[b.block_id] = _Pin(b, 1, expires)
            else:
                pin.refs += 1
                pin.expires = (
                    None if expires is None or pin.expires is None else max(pin.expires, expires)
                )
        return DirectiveAck(d.id, True, blocks=len(blocks))

    def _unpin(self, d: Directive, blocks: list[KVCacheBlock]) -> DirectiveAck:
        assert self._pool is not None
        released = [self._pins.pop(b.block_id) for b in blocks if b.block_id in self._pins]
        self._pool.free_blocks([p.block for p in released for _ in range(p.refs)])
        reason = "" if released else "prefix was not pinned"
        return DirectiveAck(d.id, True, reason, blocks=len(released))

    def _expire_pins(self) -> None:
        if not self._pins or self._pool is None:
            return
        now = time.monotonic()
        done = [i for i, p in self._pins.items() if p.expires is not None and p.expires <= now]
        if done:
            expired = [self._pins.pop(i) for i in done]
            self._pool.free_blocks([p.block for p in expired for _ in range(p.refs)])

    def _resolve(self, d: Directive) -> tuple[list[KVCacheBlock], str]:
        """The cached device blocks of the directive's prefix, root first, up to the first miss."""
        assert self._pool is not None
        if d.token_ids:
            return self._resolve_tokens(d.token_ids, d.namespace), ""
        assert d.keys is not None
        wanted = [self._exporter.key_to_hash.get(k) for k in d.keys]
        known = [h for h in wanted if h is not None]
        if not known:
            return [], "none of the keys is cached on this worker"
        by_hash: dict[int, KVCacheBlock] = {}
        targets = set(known)
        # Keys resolve through the exported hashes; vLLM indexes blocks by full digest, so find
        # the blocks with one pass over the pool (directives are rare; O(num blocks)).
        for block in self._pool.blocks:
            key = block.block_hash
            if key is None or get_group_id(key) != 0:
                continue
            h = engine_hash(get_block_hash(key))
            if h in targets:
                by_hash[h] = block
        out: list[KVCacheBlock] = []
        for maybe in wanted:
            if maybe is None or maybe not in by_hash:
                break
            out.append(by_hash[maybe])
        return out, ""

    def _resolve_tokens(self, tokens: list[int], namespace: str) -> list[KVCacheBlock]:
        assert self._pool is not None
        out: list[KVCacheBlock] = []
        for block_hash in self._hash_chain(tokens, namespace):
            found = self._pool.get_cached_block(block_hash, [0])
            if found is None:
                break
            out.append(found[0])
        return out
