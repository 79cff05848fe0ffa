"""Routing decision latency: key chain + index match + strategy choice, with and without
tokenization, for 8 workers over an index of 1 M (block, worker) entries.

The index is filled through `MemoryIndex.apply` with chained `BlockStored` events (16-token
blocks, the GPU default and the hardest case for the key walk); each measured prompt shares a
cached prefix (half its blocks) with one worker, so `match` walks deep chains. "with
tokenization" adds what the router does first for a chat request: render the chat template and
encode with the model's tokenizer (default: the newest tiny model built by scripts/tiny_model.py).
Targets at 8k tokens: p99 <= 1 ms without tokenization, <= 5 ms with.

    .venvs/core/bin/python bench/router_decision.py [--entries 1000000] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from router.config import RouterConfig
from router.index import MemoryIndex
from router.placement import Placement
from router.tokenize import RouterTokenizer
from warply.protocol import BlockStored

BS = 16
WORKERS = 8
MODEL = "bench"
CACHE = Path.home() / ".cache" / "warply" / "models"


def _placement(index: MemoryIndex) -> Placement:
    config = RouterConfig.model_validate(
        {
            "model": MODEL,
            "tokenizer": "/unused",
            "pools": [
                {
                    "name": "p",
                    "block_size": BS,
                    "workers": [
                        {"name": f"w{i}", "url": f"http://127.0.0.1:{9000 + i}"}
                        for i in range(WORKERS)
                    ],
                }
            ],
        }
    )
    placement = Placement(config, index)
    for w in placement.workers.values():
        w.healthy = True
    return placement


def _fill(index: MemoryIndex, entries: int, rng: random.Random) -> None:
    """Chains of 64 blocks, each on one random worker, until `entries` entries exist."""
    next_hash = 1
    while index.stats().entries < entries:
        for _ in range(2000):
            tokens = [rng.randrange(8000) for _ in range(64 * BS)]
            hashes = list(range(next_hash, next_hash + 64))
            next_hash += 64
            index.apply(f"w{rng.randrange(WORKERS)}", [BlockStored(hashes, None, tokens, BS)])


def _q(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100)
    return f"p50 {q[49] * 1e3:7.3f} ms  p99 {q[98] * 1e3:7.3f} ms"


def _newest_tiny() -> Path | None:
    found = sorted(CACHE.glob("tiny-*/tokenizer.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--tokenizer", type=Path, default=_newest_tiny())
    args = ap.parse_args()
    rng = random.Random(0)
    index = MemoryIndex(MODEL, max_entries=2 * args.entries)
    t0 = time.perf_counter()
    _fill(index, args.entries, rng)
    print(f"index: {index.stats().entries} entries over {WORKERS} workers "
          f"(filled in {time.perf_counter() - t0:.1f}s); block size {BS}")
    placement = _placement(index)
    tok = RouterTokenizer(args.tokenizer) if args.tokenizer else None
    words = "the cache holds a prefix of tokens for each request and block".split()
    for n_tokens in (1024, 8192, 32768):
        prompts = []
        for i in range(args.samples):
            tokens = [rng.randrange(8000) for _ in range(n_tokens)]
            held = n_tokens // 2 // BS * BS  # half the prompt cached on one worker
            index.apply(f"w{i % WORKERS}", [BlockStored(
                list(range(10**9 + i * 10**5, 10**9 + i * 10**5 + held // BS)), None,
                tokens[:held], BS)])
            prompts.append(tokens)
        bare = []
        for tokens in prompts:
            t = time.perf_counter()
            placement.choose(tokens)
            bare.append(time.perf_counter() - t)
        line = f"{n_tokens:6d} tokens  decision {_q(bare)}"
        if tok is not None:
            text = " ".join(rng.choice(words) for _ in range(n_tokens))
            body = {"messages": [{"role": "user", "content": text}]}
            n_real = len(tok.chat_tokens(body))
            scale = n_tokens / n_real  # fit the text to ~n_tokens
            body = {"messages": [{"role": "user", "content": text[: int(len(text) * scale)]}]}
            full = []
            for _ in range(min(args.samples, 100)):
                t = time.perf_counter()
                placement.choose(tok.chat_tokens(body))
                full.append(time.perf_counter() - t)
            line += f"  |  with tokenization {_q(full)}"
        print(line)
    if tok is None:
        print("(no tokenizer found: build one with scripts/tiny_model.py or pass --tokenizer)")


if __name__ == "__main__":
    main()
