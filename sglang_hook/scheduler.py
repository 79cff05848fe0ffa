"""Scheduler-process hooks (SGLang 0.5.23 `HookRegistry` targets) and the publisher registration.

- `Scheduler.__init__` (before): hand the `--warply-*` settings carried on `ServerArgs` to the
  publisher class, ahead of `EventPublisherFactory.create` inside the constructor.
- `SchedulerKvEventsPublisher.__post_init__` (after): give the Warply publisher the radix cache
  and a load probe.
- `SchedulerKvEventsPublisher.publish_kv_events` (around): SGLang's event pump, on the scheduler
  thread between steps; directives are applied just before the cache's events are taken, so
  their effects (e.g. evictions) and acks leave in the same batch.

Each hook returns at once when the scheduler's publisher is not Warply's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.disaggregation.kv_events import EventPublisherFactory
from sglang.srt.plugins.hook_registry import HookType

from sglang_hook.publisher import WarplyEventPublisher
from sglang_hook.settings import PUBLISHER_NAME, settings_of
from warply.protocol import LoadSnapshot

_KV_PUBLISHER = (
    "sglang.srt.managers.scheduler_components.kv_events_publisher.SchedulerKvEventsPublisher"
)


def _before_scheduler_init(*args: Any, **kwargs: Any) -> None:
    # Scheduler.__init__(self, server_args, port_args) in SGLang 0.5.23.
    server_args = kwargs["server_args"] if "server_args" in kwargs else args[1]
    WarplyEventPublisher.settings = settings_of(server_args)


def _bytes_per_token(tree_cache: Any) -> int:
    """KV bytes per token on this rank's pool: SGLang 0.5.23's `get_kv_size_bytes()` (K and V
    buffers of every layer) over the buffers' rows (`size + page_size`: one padding page). 0
    for pools it cannot read (a cache without an allocator, a pool without that method)."""
    allocator = getattr(tree_cache, "token_to_kv_pool_allocator", None)
    if allocator is None:
        return 0
    pool = allocator.get_kvcache()
    try:
        k_bytes, v_bytes = pool.get_kv_size_bytes()
        rows = int(pool.size) + int(pool.page_size)
    except (AttributeError, TypeError, ValueError, AssertionError):
        return 0
    return (int(k_bytes) + int(v_bytes)) // rows if rows > 0 else 0


def _load_probe(kv: Any) -> Callable[[], LoadSnapshot]:
    page = max(1, int(kv.tree_cache.page_size))
    block_bytes = _bytes_per_token(kv.tree_cache) * page

    def probe() -> LoadSnapshot:
        stats = kv.get_stats()
        return LoadSnapshot(
            running=int(stats.num_running_reqs.total),
            waiting=int(stats.num_queue_reqs.total),
            kv_usage=float(stats.token_usage),
            kv_blocks_total=int(kv.max_total_num_tokens) // page,
            kv_bytes_per_block=block_bytes,
        )

    return probe


def _after_post_init(result: None, kv: Any) -> None:
    publisher = kv.kv_event_publisher
    if isinstance(publisher, WarplyEventPublisher):
        publisher.attach(kv.tree_cache, _load_probe(kv))


def _around_publish(original: Callable[[Any], None], kv: Any) -> None:
    publisher = kv.kv_event_publisher
    if not isinstance(publisher, WarplyEventPublisher):
        original(kv)
        return
    publisher.step()
    original(kv)
    publisher.flush()


HOOKS: tuple[tuple[str, Callable[..., Any], HookType], ...] = (
    ("sglang.srt.managers.scheduler.Scheduler.__init__", _before_scheduler_init, HookType.BEFORE),
    (f"{_KV_PUBLISHER}.__post_init__", _after_post_init, HookType.AFTER),
    (f"{_KV_PUBLISHER}.publish_kv_events", _around_publish, HookType.AROUND),
)


def register_publisher() -> None:
    """Make `{"publisher": "warply"}` valid in `--kv-events-config` (once per process)."""
    # SGLang 0.5.23's register_publisher raises KeyError on a duplicate name.
    if PUBLISHER_NAME not in EventPublisherFactory._registry:
        EventPublisherFactory.register_publisher(PUBLISHER_NAME, WarplyEventPublisher)
