"""Routing decision latency: key chain + index match + strategy choice, with and without
tokenization, for 8 workers over an index of 1 M (block, worker) entries.

The index (`PrefixIndex` over a `MemoryStore`) is filled through `apply` with chained
`BlockStored` events (16-token blocks, the GPU default and the hardest case for the key walk);
each measured prompt shares a cached prefix (half its blocks) with one worker, stored as an
engine stores a prefill (one event per 2,048-token step, each the child of the one before), so
`match` follows deep chains; the decision is awaited in an event loop, as in the router.
"+ tokenization" is the router's own request path up to its choice (`Proxy.prepare` +
`Proxy.place`, tokenizer thread included): render the chat template and encode with the
model's tokenizer (default: the newest tiny model built by scripts/tiny_model.py) through the
chunk cache (router/token_cache.py), as far as the placement needs (router/placement.py
`choose_early`).
"warm" is a conversation's next turn (a new 512-token user message after a history the router
tokenized and placed for the previous turn, held by one worker); "cold" is a conversation the
router has never seen. "whole" adds encoding the rest of the prompt, which the router does while the
request is on its way (the engine's own limit, --max-model-len, lets it; a prompt that may not
fit is tokenized whole before the choice).
The process runs with glibc's mmap threshold fixed at 128 KiB, as warply-router sets it (every
buffer of 128 KiB or more is mapped fresh, page faults included: a 128k-token turn's id arrays
and rendered text are such buffers); `--dynamic-malloc` keeps glibc's default instead.
Targets at 8k tokens: p99 <= 1 ms without tokenization, <= 5 ms with; a warm next turn
p99 <= 3 ms at 32k and 128k tokens (its cost should follow its new tokens, not its history).

    .venvs/core/bin/python bench/router_decision.py [--entries 1000000] [--tokenizer DIR] \
        [--sizes 1024 8192 32768 131072] [--dynamic-malloc]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from array import array
from collections.abc import Sequence
from pathlib import Path

import _one_pool
from _models import newest_tiny
from _percentiles import percentiles

from router.__main__ import collect_less, fixed_mmap_threshold
from router.config import RouterConfig
from router.index import MemoryStore, PrefixIndex
from router.metrics import RouterMetrics
from router.placement import Placement
from router.proxy import Proxy
from router.tokenize import RouterTokenizer
from router.workers import Workers
from warply.common.argtypes import non_negative, positive
from warply.protocol import BlockStored

BS = 16
WORKERS = 8
MODEL = "bench"
STEP = 2048
"""Prompt tokens an engine prefills per scheduler step: one `BlockStored` each."""
MIN_SIZE = 64
"""The shortest --sizes prompt: a conversation needs room for one line of history before its
new turn (53 tokens at least with the tiny model's tokenizer)."""


def _config() -> RouterConfig:
    return _one_pool.config(MODEL, BS, WORKERS)


def _placement(index: PrefixIndex) -> Placement:
    config = _config()
    workers = Workers(config.pools)
    for w in workers.values():
        w.healthy = True
    return Placement(config, index, workers)


async def _fill(index: PrefixIndex, entries: int, rng: random.Random) -> None:
    """Chains of 64 blocks, each on one random worker, until `entries` entries exist."""
    next_hash = 1
    while (await index.stats()).entries < entries:
        for _ in range(2000):
            tokens = [rng.randrange(8000) for _ in range(64 * BS)]
            hashes = list(range(next_hash, next_hash + 64))
            next_hash += 64
            await index.apply(f"w{rng.randrange(WORKERS)}", [BlockStored(hashes, None, tokens, BS)])


def _prefill(tokens: Sequence[int], first_hash: int) -> list[BlockStored]:
    """The events of an engine storing `tokens`' full blocks, one prefill step each."""
    events, parent = [], None
    for start in range(0, len(tokens) // BS * BS, STEP):
        part = tokens[start : min(start + STEP, len(tokens) // BS * BS)]
        hashes = list(range(first_hash + start // BS, first_hash + (start + len(part)) // BS))
        events.append(BlockStored(hashes, parent, part, BS))
        parent = hashes[-1]
    return events


def _q(samples: list[float]) -> str:
    q = percentiles(samples)
    return f"p50 {q[49] * 1e3:7.3f} ms  p99 {q[98] * 1e3:7.3f} ms  max {max(samples) * 1e3:7.3f} ms"


def _lines(rng: random.Random, n: int) -> list[str]:
    words = "the cache holds a prefix of tokens for each request and block".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(4, 24))) + ".\n"
            for _ in range(n)]


def _conversation(tok: RouterTokenizer, rng: random.Random, n_tokens: int,
                  new_turn: int) -> tuple[dict[str, object], dict[str, object]]:
    """A chat body of ~n_tokens whose last user message has ~new_turn tokens, and the same
    conversation one turn earlier (its history)."""
    messages: list[dict[str, str]] = []
    lines = _lines(rng, n_tokens // 4)
    per_line = max(1, len(tok.chat_tokens({"messages": [
        {"role": "user", "content": "".join(lines)}]})) // len(lines))
    history, turn = (n_tokens - new_turn) // per_line, new_turn // per_line
    for k in range(0, history, 40):  # 40-line messages, alternating roles
        role = "user" if len(messages) % 2 == 0 else "assistant"
        messages.append({"role": role, "content": "".join(lines[k:min(k + 40, history)])})
    if messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": "ok.\n"})
    before = {"messages": list(messages)}
    messages.append({"role": "user", "content": "".join(lines[history:history + turn])})
    return before, {"messages": messages}


async def _timed(proxy: Proxy, body: dict[str, object]) -> tuple[float, float]:
    """Seconds to the router's choice, and to the whole prompt's tokens."""
    t = time.perf_counter()
    prep = await proxy.prepare(dict(body), "chat")
    await proxy.place(prep, set())
    chosen = time.perf_counter() - t
    if prep.rest is not None:
        await prep.rest
    return chosen, time.perf_counter() - t


async def _tokenized(proxy: Proxy, tok: RouterTokenizer, index: PrefixIndex,
                     rng: random.Random, args: argparse.Namespace) -> None:
    for n_tokens in args.sizes:
        rows: dict[str, list[float]] = {"warm": [], "warm whole": [], "cold": [], "cold whole": []}
        turns = args.turn_samples or min(args.samples, 100 if n_tokens <= 32768 else 40)
        for i in range(turns):
            before, body = _conversation(tok, rng, n_tokens, min(args.new_turn, n_tokens // 2))
            prep = await proxy.prepare(dict(before), "chat")  # the earlier turn, as routed
            await proxy.place(prep, set())
            seen = list(prep.prompt.tokens if prep.rest is None else (await prep.rest).tokens)
            # Answered: the router holds nothing of a request once it ends, and the next one
            # starts in a loop callback of its own (the callback that resumed this coroutine
            # still holds the task it awaited, and with it that turn's prompt).
            del prep
            await asyncio.sleep(0)
            await index.apply(f"w{i % WORKERS}", _prefill(seen, 2 * 10**9 + i * 10**5))
            for kind, b in (("warm", body), ("cold", _conversation(tok, rng, n_tokens,
                                                                   n_tokens // 2)[1])):
                chosen, whole = await _timed(proxy, b)
                rows[kind].append(chosen)
                rows[f"{kind} whole"].append(whole)
        print(f"{n_tokens:6d} tokens ({turns} conversations)")
        for name, samples in rows.items():
            print(f"{'':6s}         + tokenization, {name:10s} {_q(samples)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--entries", type=positive(int), default=1_000_000,
                    help="blocks in the index first")
    ap.add_argument("--samples", type=positive(int), default=200, help="timed decisions per size")
    ap.add_argument("--new-turn", type=positive(int), default=512,
                    help="tokens of the new user message in the warm case (default 512)")
    ap.add_argument("--max-model-len", type=positive(int), default=262144,
                    help="the engine's context limit the router checks prompts against")
    ap.add_argument("--tokenizer", type=Path, default=newest_tiny(), help="model folder")
    ap.add_argument("--sizes", type=positive(int), nargs="+", default=[1024, 8192, 32768, 131072],
                    help="prompt lengths in tokens (40 tokenized samples above 32k)")
    ap.add_argument("--turn-samples", type=non_negative(int), default=0,
                    help="conversations per size in the tokenized rows (default: 100 up to 32k "
                         "tokens, 40 above); a p99 needs 200 or more: over 100 it is the "
                         "second-largest sample, over 40 it lies between the two largest")
    ap.add_argument("--dynamic-malloc", action="store_true",
                    help="keep glibc's dynamic mmap threshold (warply-router fixes it at 128 KiB)")
    args = ap.parse_args()
    if args.samples < 2:
        ap.error(f"--samples {args.samples}: percentiles need 2 samples or more")
    if args.turn_samples == 1:
        ap.error("--turn-samples 1: percentiles need 2 samples or more (0: the default counts)")
    if min(args.sizes) < MIN_SIZE:
        ap.error(f"--sizes {min(args.sizes)}: a conversation needs {MIN_SIZE} tokens or more")
    if not args.dynamic_malloc:
        fixed_mmap_threshold()  # as warply-router does at start (router/__main__.py)
    asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    index = PrefixIndex(MODEL, MemoryStore(max_entries=2 * args.entries))
    t0 = time.perf_counter()
    await _fill(index, args.entries, rng)
    print(f"index: {(await index.stats()).entries} entries over {WORKERS} workers "
          f"(filled in {time.perf_counter() - t0:.1f}s); block size {BS}")
    placement = _placement(index)
    collect_less()  # as warply-router does after start-up (router/__main__.py)
    for n_tokens in args.sizes:
        prompts = []
        for i in range(args.samples):
            tokens = array("I", [rng.randrange(8000) for _ in range(n_tokens)])
            held = n_tokens // 2 // BS * BS  # half the prompt cached on one worker
            await index.apply(f"w{i % WORKERS}", _prefill(tokens[:held], 10**9 + i * 10**5))
            prompts.append(tokens)
        bare = []
        for tokens in prompts:
            t = time.perf_counter()
            await placement.choose(tokens)
            bare.append(time.perf_counter() - t)
        print(f"{n_tokens:6d} tokens  decision            {_q(bare)}")
    if args.tokenizer is None:
        print("(no tokenizer found: build one with scripts/tiny_model.py or pass --tokenizer)")
        return
    tok = RouterTokenizer(args.tokenizer)
    print(f"tokenizer: {args.tokenizer} (chunk cache: {tok.cache.mode}); warm = a new "
          f"{args.new_turn}-token turn after a history the router has seen, cold = all new; "
          f"max_model_len {args.max_model_len}")
    proxy = Proxy(MODEL, tok, placement, RouterMetrics(_config(), placement.workers), 60)
    proxy.max_model_len = args.max_model_len
    await _tokenized(proxy, tok, index, rng, args)


if __name__ == "__main__":
    main()
