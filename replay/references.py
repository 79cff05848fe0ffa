"""Reference points for prefix reuse on a trace, independent of placement and timing.

Both process requests at arrival, instantly, with the same reuse rule as the simulated engine
(the leading cached blocks of a prompt, the last prompt block always recomputed):

- `infinite_reuse`: one cache that never evicts. A true upper bound: a block can only be reused
  after an earlier request computed it, and this cache still holds every such block.
- `lru_reuse`: one LRU cache of `capacity` blocks, e.g. the workers' pooled capacity. A
  reference, not a bound: LRU is not the best eviction order, and placements that keep prefixes
  apart can beat it (modelled routers exceed it by up to 1% on the conversation trace). A
  capacity-aware true bound would need the offline-optimal eviction for leading-run reuse, which
  Belady's rule (farthest next use) does not give for prefix chains, so none is reported.
"""

from __future__ import annotations

from collections import OrderedDict

from replay.trace import ExpandedTrace

INFINITE = "infinite cache (bound)"
"""Report label of `infinite_reuse`."""


def pooled_lru_label(workers: int) -> str:
    """Report label of `lru_reuse` over `workers` workers' pooled capacity."""
    return f"pooled LRU N={workers} (reference)"


def _reusable(trace: ExpandedTrace, index: int) -> int:
    """Blocks of request `index` that may be reused: its full blocks, less the last token's."""
    return min(len(trace.keys[index]), (trace.requests[index].input_length - 1) // trace.block_size)


def infinite_reuse(trace: ExpandedTrace) -> float:
    """Reused tokens / prompt tokens with one infinite cache: an LRU that holds every distinct
    block of the trace never evicts."""
    return lru_reuse(trace, max(1, len({key for keys in trace.keys for key in keys})))


def lru_reuse(trace: ExpandedTrace, capacity: int) -> float:
    """Reused tokens / prompt tokens with one LRU cache of `capacity` blocks.

    A prompt's blocks are touched tail first, so its head is the most recent and an eviction
    takes tails before heads (as vLLM frees a finished request's blocks in reverse).
    """
    if capacity <= 0:
        raise ValueError("capacity must be positive")
    cache: OrderedDict[int, None] = OrderedDict()
    reused = total = 0
    for i, req in enumerate(trace.requests):
        keys, cap, hit = trace.keys[i], _reusable(trace, i), 0
        while hit < cap and keys[hit] in cache:
            hit += 1
        reused += hit * trace.block_size
        total += req.input_length
        for key in reversed(keys):
            cache[key] = None
            cache.move_to_end(key)
        for _ in range(len(cache) - capacity):
            cache.popitem(last=False)
    return reused / total
