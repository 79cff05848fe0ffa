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
- `pd_lru_reuse`: one LRU per role of a P/D deployment, a share of the conversations handed
  off: what pooled caches give a prefill and a decode pool (a reference, as `lru_reuse`).
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


class _Lru:
    """An LRU cache of `capacity` block keys."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()

    def hit(self, keys: list[int], cap: int) -> int:
        """Leading blocks of `keys` held (at most `cap`)."""
        n = 0
        while n < cap and keys[n] in self.cache:
            n += 1
        return n

    def touch(self, keys: list[int]) -> None:
        """Cache a prompt's blocks, tail first, so its head is the most recent and an eviction
        takes tails before heads (as vLLM frees a finished request's blocks in reverse)."""
        cache = self.cache
        for key in reversed(keys):
            cache[key] = None
            cache.move_to_end(key)
        for _ in range(len(cache) - self.capacity):
            cache.popitem(last=False)


def lru_reuse(trace: ExpandedTrace, capacity: int) -> float:
    """Reused tokens / prompt tokens with one LRU cache of `capacity` blocks."""
    lru = _Lru(capacity)
    reused = total = 0
    for i, req in enumerate(trace.requests):
        keys = trace.keys[i]
        reused += lru.hit(keys, _reusable(trace, i)) * trace.block_size
        total += req.input_length
        lru.touch(keys)
    return reused / total


def pd_lru_reuse(
    trace: ExpandedTrace,
    prefill_capacity: int,
    decode_capacity: int,
    remote_share: float,
    keep_pulled: bool = True,
    conversation_block: int = 0,
) -> float:
    """Reused tokens / prompt tokens with one pooled LRU cache per role, requests served at
    arrival: the conversations (told apart by the key of block `conversation_block`: the first
    block after a header every request shares) in a `remote_share` are handed off
    (their reuse is the prefill cache's, which then holds the prompt; the decode cache takes
    it too, as a decode engine caches the KV it pulled, unless `keep_pulled` is False), the
    others are prefilled on decode (the decode cache's reuse). `keep_pulled=False` is the
    ideal without duplicates between the pools, which engines do not offer."""
    prefill, decode = _Lru(prefill_capacity), _Lru(decode_capacity)
    reused = total = 0
    for i, req in enumerate(trace.requests):
        keys = trace.keys[i]
        key = keys[min(conversation_block, len(keys) - 1)] if keys else 0
        remote = (key * 2654435761) % 2**32 < remote_share * 2**32
        cache = prefill if remote else decode
        reused += cache.hit(keys, _reusable(trace, i)) * trace.block_size
        total += req.input_length
        cache.touch(keys)
        if remote and keep_pulled:
            decode.touch(keys)
    return reused / total
