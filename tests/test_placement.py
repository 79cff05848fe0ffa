"""Placement across pools and the per-attempt load bookings, without HTTP (over the memory
store nothing suspends, so `completed` drives the coroutines)."""

from __future__ import annotations

from router.config import RouterConfig
from router.index import MemoryStore, PrefixIndex, completed
from router.placement import Placement
from router.workers import Workers
from warply.protocol import BlockStored

MODEL = "m"
TOKENS = list(range(100, 140))  # 40 tokens: 10 blocks of 4, 5 of 8


def _placement() -> tuple[Placement, PrefixIndex, Workers]:
    """Two pools with different block sizes, one worker each: a (4 tokens), b (8 tokens)."""
    config = RouterConfig.model_validate(
        {
            "model": MODEL,
            "tokenizer": "/unused",
            "pools": [
                {"name": "p4", "block_size": 4, "workers": [{"name": "a", "url": "http://a"}]},
                {"name": "p8", "block_size": 8, "workers": [{"name": "b", "url": "http://b"}]},
            ],
        }
    )
    index = PrefixIndex(MODEL, MemoryStore())
    workers = Workers(config.pools)
    for w in workers.values():
        w.healthy = True
    return Placement(config, index, workers), index, workers


def _hold(index: PrefixIndex, worker: str, block_size: int, blocks: int, first: int) -> None:
    hashes = list(range(first, first + blocks))
    stored = BlockStored(hashes, None, TOKENS[: blocks * block_size], block_size)
    completed(index.apply(worker, [stored]))


def test_the_pool_whose_pick_holds_most_cached_tokens_wins() -> None:
    placement, index, _ = _placement()
    _hold(index, "a", 4, 2, 1)  # 8 tokens
    _hold(index, "b", 8, 2, 100)  # 16 tokens
    d = completed(placement.choose(TOKENS))
    assert (d.worker.name, d.matched_blocks, d.predicted_cached) == ("b", 2, 16)
    _hold(index, "a", 4, 6, 1)  # now 24 tokens, in 4-token blocks
    d = completed(placement.choose(TOKENS))
    assert (d.worker.name, d.matched_blocks, d.predicted_cached) == ("a", 6, 24)
    assert len(d.keys) == 10, "the key chain is the winning pool's (block size 4)"


def test_equal_cached_tokens_go_to_the_lower_load() -> None:
    placement, index, workers = _placement()
    _hold(index, "a", 4, 4, 1)  # 16 tokens
    _hold(index, "b", 8, 2, 100)  # 16 tokens
    workers["a"].load.in_flight = 1
    assert completed(placement.choose(TOKENS)).worker.name == "b"
    workers["a"].load.in_flight = 0
    workers["b"].load.engine_waiting = 2
    assert completed(placement.choose(TOKENS)).worker.name == "a"


def test_an_unavailable_pool_is_skipped() -> None:
    placement, index, workers = _placement()
    _hold(index, "b", 8, 4, 100)
    workers["b"].enabled = False  # drained
    assert completed(placement.choose(TOKENS)).worker.name == "a"


def test_a_booking_gives_back_exactly_what_it_took() -> None:
    _, _, workers = _placement()
    a = workers["a"]
    streamed = a.book(prompt_tokens=40, prefill_tokens=24)
    whole = a.book(prompt_tokens=10, prefill_tokens=10)
    assert (a.load.in_flight, a.load.in_flight_tokens, a.load.pending_prefill_tokens) == (2, 50, 34)
    streamed.progressed(1)  # first token: its prefill is done
    streamed.progressed(1)
    assert (a.load.in_flight_tokens, a.load.pending_prefill_tokens) == (52, 10)
    streamed.release()
    streamed.release()  # a second release changes nothing
    whole.release()
    assert (a.load.in_flight, a.load.in_flight_tokens, a.load.pending_prefill_tokens) == (0, 0, 0)
