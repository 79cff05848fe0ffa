"""Cache-state export: tees vLLM's block-pool events into the Warply state stream.

vLLM 0.32's `BlockPool` records BlockStored / BlockRemoved / AllBlocksCleared in its own queue
(when `enable_kv_cache_events` is set), and the scheduler drains it once per step through
`KVCacheManager.take_events()` for the stock `--kv-events-config` publisher. The exporter wraps
that pool's `take_events` (this instance only) so every drained batch is also converted here, and
hands the engine exactly what it would have had: the stock stream keeps working beside Warply.
If the stock stream is off, the pool is switched to record events anyway and the wrapper returns
nothing to the engine (its null publisher would have dropped them).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import AllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from vllm_connector.config import WarplySettings
from vllm_connector.metrics import WarplyCounters
from warply.protocol import (
    AllCleared,
    DirectiveAck,
    Event,
    EventError,
    LoadSnapshot,
    PrefixHit,
    Tier,
    block_removed,
    block_stored,
    cache_namespace,
    chain_keys,
    engine_block_id,
    root_seed,
)
from warply.protocol.publisher import StatePublisher

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request

_log = logging.getLogger(__name__)
_LOG_FIRST = 5


def engine_hash(block_hash: bytes | int) -> int:
    """A vLLM block hash as the state stream names it (the same id the decoder gives a stock
    vLLM stream): the 64-bit tail vLLM 0.32 publishes by default, else the folded digest."""
    if isinstance(block_hash, bytes):  # a raw BlockHash (requests); events carry converted ones
        block_hash = maybe_convert_block_hash(block_hash)
    return engine_block_id(block_hash)


_TOKEN_BLOCKS = 8192
"""Device blocks whose token ids the exporter keeps (at 256 tokens, 16 MiB)."""


class StateExporter:
    """Converts and publishes the device tier's cache events; runs on the scheduler thread
    (the idle watch, `watch_idle`, only sets a flag and wakes the engine)."""

    def __init__(
        self,
        settings: WarplySettings,
        *,
        model: str,
        worker: str,
        counters: WarplyCounters,
        load: Callable[[], tuple[int, int]],
        bytes_per_block: int = 0,
        backend_bytes: Callable[[], dict[Tier, int] | None] | None = None,
    ) -> None:
        self.publisher = (
            StatePublisher(
                settings.events_endpoint,
                replay_endpoint=settings.replay_endpoint,
                topic=settings.topic,
                worker=worker,
                buffer_steps=settings.replay_buffer_steps,
                bind=settings.events_bind,
            )
            if settings.events_endpoint
            else None
        )
        self._model = model
        self._counters = counters
        self._load = load
        self._bytes_per_block = bytes_per_block
        self._backend_bytes = backend_bytes
        self._snapshot_every = settings.snapshot_interval_s
        self._last_snapshot = 0.0
        self._last_flush = time.monotonic()
        self._shown: tuple[tuple[int, int], dict[Tier, int] | None] = ((0, 0), None)
        """The load and backend bytes of the last published snapshot."""
        self.refresh_pending = False
        """Set by the idle watch: the next step publishes a snapshot whatever its timing (the
        connector's `has_pending_push_work` makes an idle engine take that step)."""
        self._watch: threading.Thread | None = None
        self._stop = threading.Event()
        self._pool: BlockPool | None = None
        self._raw: list[Any] = []
        self._out: list[Event] = []
        self._handed = 0
        self.key_to_hash: dict[int, int] = {}
        """Canonical key → engine hash of every cached full block (resolves `keys` directives)."""
        self._hash_to_key: dict[int, int] = {}
        self._blocks: OrderedDict[int, tuple[int | None, array[int]]] = OrderedDict()
        """Canonical key → (parent key, token ids) of the last `_TOKEN_BLOCKS` device blocks
        stored, kept after they leave the device: a lower tier (LMCache) keys chunks by tokens,
        so a keys-only directive for it is resolved here (`tokens_for`)."""
        self.skipped: Counter[str] = Counter()
        """Events not exported, by reason (`unknown_medium`, `bad_schema`, `clear_without_tier`);
        their sum is the `events_skipped` counter."""

    def attach(self, pool: BlockPool) -> None:
        """Tee `pool`'s event queue (idempotent: binding twice wraps once)."""
        if self._pool is pool:
            return
        self._pool = pool
        engine_wants_events = pool.enable_kv_cache_events
        pool.enable_kv_cache_events = True
        drain = pool.take_events

        def take_events() -> list[Any]:
            events = drain()
            self._raw.extend(events)
            return events if engine_wants_events else []

        # vLLM 0.32 has no observer hook on the pool's event queue; wrap this instance's drain.
        pool.take_events = take_events

    def add_delegate_events(self, events: list[Any]) -> None:
        """Queue the KV events a delegate reports for its own tiers, for the next flush.

        vLLM 0.32's `AllBlocksCleared` names no medium, so a delegate's clear cannot be placed
        on a tier: it is counted as skipped rather than exported as a clear of every tier.
        """
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self._skip("clear_without_tier", "a delegate's AllBlocksCleared names no medium")
            else:
                self._raw.append(event)

    def record_hit(self, request: Request, hit_tokens: int, block_size: int) -> None:
        """Note which cached blocks `request` reused (exported with the next flush)."""
        n_blocks = hit_tokens // block_size
        if n_blocks == 0:
            return
        self._counters.prefix_hit_blocks += n_blocks
        if self.publisher is None or self._pool is None:
            return
        if self._pool.hash_block_size != block_size:
            hashes: list[int] = []  # vLLM 0.32 hybrid block sizes: hashes are not per block
        else:
            hashes = [engine_hash(h) for h in request.block_hashes[:n_blocks]]
        self._out.append(
            PrefixHit(
                request_id=request.request_id,
                block_hashes=hashes,
                hit_tokens=hit_tokens,
                prompt_tokens=request.num_prompt_tokens,
                namespace=cache_namespace(request.cache_salt, _lora_name(request)),
            )
        )

    def ack(self, ack: DirectiveAck) -> None:
        """Put a directive's acknowledgement on the state stream (next flush)."""
        self._out.append(ack)

    def flush(self) -> None:
        """Convert what the engine drained this step, add a load snapshot if due, publish."""
        start = time.perf_counter()
        if self.publisher is not None:  # batches from earlier steps the thread has not sent
            self._counters.export_backlog = self._handed - self.publisher.published
        if self._raw:
            raw, self._raw = self._raw, []
            for event in raw:
                self._convert(event)
        now = self._last_flush = time.monotonic()
        due = self.refresh_pending or now - self._last_snapshot >= self._snapshot_every
        if self._pool is not None and due:
            self._last_snapshot = now
            self.refresh_pending = False
            running, waiting = self._load()
            backend = self._backend()
            self._shown = ((running, waiting), backend)
            self._out.append(
                LoadSnapshot(
                    running=running,
                    waiting=waiting,
                    kv_usage=self._pool.get_usage(),
                    kv_blocks_total=self._pool.num_gpu_blocks - 1,
                    kv_bytes_per_block=self._bytes_per_block,
                    backend_bytes=backend,
                )
            )
        if self._out:
            out, self._out = self._out, []
            if self.publisher is not None:
                self.publisher.publish(out)
                self._handed += 1
            self._counters.events_exported += len(out)
        self._counters.export_seconds += time.perf_counter() - start
        self._counters.export_steps += 1

    def _backend(self) -> dict[Tier, int] | None:
        """The backend's latest bytes per tier (None: no backend, or not read yet)."""
        return self._backend_bytes() if self._backend_bytes else None

    def watch_idle(self, wake: Callable[[], None]) -> None:
        """Keep the router's view of an idle engine true: the engine publishes snapshots only
        when it steps, so once it goes idle the last one can show requests that have finished,
        or backend bytes from before the backend's last write landed (LMCache stores in the
        background). A daemon thread checks every `snapshot_interval_s`; when no step came for
        that long and the last snapshot showed requests or other backend bytes than the
        backend's latest, it asks for one snapshot and wakes the engine for the step that
        publishes it (one step per change, none while nothing changes)."""
        if self.publisher is None or self._watch is not None:
            return

        def watch() -> None:
            while not self._stop.wait(self._snapshot_every):
                if self._pool is None or time.monotonic() - self._last_flush < self._snapshot_every:
                    continue  # no pool to report yet, or stepping: the steps publish snapshots
                load, backend = self._shown
                # idle means no request is left: the true load is (0, 0)
                latest = self._backend()
                if load != (0, 0) or latest != backend:
                    self.refresh_pending = True
                    wake()

        self._watch = threading.Thread(target=watch, name="warply-idle-watch", daemon=True)
        self._watch.start()

    def close(self) -> None:
        """Stop the idle watch, flush and close the sockets."""
        self._stop.set()
        self.flush()
        if self.publisher is not None:
            self.publisher.close()

    def _skip(self, reason: str, detail: str) -> None:
        """Count an event that is not exported (never raise on the scheduler thread)."""
        self._counters.events_skipped += 1
        self.skipped[reason] += 1
        if self.skipped[reason] <= _LOG_FIRST:
            _log.warning("Warply: skipped a KV event (%s: %s)", reason, detail)

    def _convert(self, event: Any) -> None:
        # vLLM 0.32 with several KV cache groups (hybrid models) reports each group's copy of a
        # block; the prefix index needs one, so only group 0 (full attention) is exported.
        if getattr(event, "group_idx", None) not in (None, 0):
            return
        try:
            if isinstance(event, VllmBlockStored):
                self._stored(event)
            elif isinstance(event, VllmBlockRemoved):
                self._removed(event)
            elif isinstance(event, AllBlocksCleared):
                self.key_to_hash.clear()
                self._hash_to_key.clear()
                self._out.append(AllCleared(Tier.GPU))
        except EventError as exc:  # unknown medium, or masked/null blocks without tokens
            self._skip(exc.reason.value, str(exc))

    def _removed(self, event: VllmBlockRemoved) -> None:
        removed = block_removed(event.block_hashes, event.medium)
        if removed.tier is Tier.GPU:  # directives resolve device blocks
            for h in removed.block_hashes:
                key = self._hash_to_key.pop(h, None)
                if key is not None:
                    self.key_to_hash.pop(key, None)
        self._counters.blocks_removed += len(removed.block_hashes)
        self._out.append(removed)

    def _stored(self, event: VllmBlockStored) -> None:
        stored = block_stored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
        )
        self._out.append(stored)
        self._counters.blocks_stored += len(stored.block_hashes)
        if stored.tier is not Tier.GPU:
            return
        seed = (
            root_seed(self._model, stored.namespace or "")
            if stored.parent_hash is None
            else self._hash_to_key.get(stored.parent_hash)
        )
        if seed is None:
            return
        keys = chain_keys(stored.token_ids, stored.block_size, seed)
        parent = None if stored.parent_hash is None else seed
        size = stored.block_size
        for i, (h, key) in enumerate(zip(stored.block_hashes, keys, strict=True)):
            self._hash_to_key[h] = key
            self.key_to_hash[key] = h
            self._blocks[key] = (parent, array("q", stored.token_ids[i * size : (i + 1) * size]))
            self._blocks.move_to_end(key)
            parent = key
        while len(self._blocks) > _TOKEN_BLOCKS:
            self._blocks.popitem(last=False)

    def tokens_for(self, keys: list[int]) -> list[int] | None:
        """The token ids of the prefix that ends with the chain `keys` (from its root: `keys`
        may start mid-chain), or None if a block of it was not stored here lately."""
        if not keys or keys[0] not in self._blocks:
            return None
        head: list[int] = []
        parent = self._blocks[keys[0]][0]
        while parent is not None:
            entry = self._blocks.get(parent)
            if entry is None:
                return None
            head.append(parent)
            parent = entry[0]
        out: list[int] = []
        for key in [*reversed(head), *keys]:
            entry = self._blocks.get(key)
            if entry is None:
                return None
            out.extend(entry[1])
        return out


def _lora_name(request: Request) -> str | None:
    lora = request.lora_request
    return lora.lora_name if lora is not None else None
