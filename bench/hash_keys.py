"""Canonical block-key throughput on one core (target: >= 20 M tokens/s at block size 16).

Prints tokens/s for `warply.protocol.prefix_keys` at several block sizes and, as a same-process
baseline, a plain per-token implementation of the same definition.

    python bench/hash_keys.py [--tokens N] [--repeat R]
"""

from __future__ import annotations

import argparse
import struct
import time

import numpy as np
import xxhash

from warply.common.argtypes import positive
from warply.protocol import prefix_keys, root_seed


def _plain(tokens: list[int], block_size: int, seed: int) -> list[int]:
    out, key = [], seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = b"".join(struct.pack("<I", t) for t in tokens[start : start + block_size])
        key = xxhash.xxh3_64_intdigest(block, seed=key)
        out.append(key)
    return out


def _best_rate(fn, n_tokens: int, repeat: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n_tokens / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=positive(int), default=4_000_000, help="tokens per run")
    ap.add_argument("--repeat", type=positive(int), default=5, help="runs per case (best is kept)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128_000, size=args.tokens, dtype=np.int64)
    as_list = tokens.tolist()
    sample = as_list[:200_000]
    base = _best_rate(lambda: _plain(sample, 16, root_seed("m")), len(sample), 2)
    print(f"baseline (per-token struct.pack loop), block 16: {base / 1e6:7.2f} M tokens/s")
    for bs in (16, 64, 128):
        n, r = len(tokens), args.repeat
        arr_rate = _best_rate(lambda bs=bs: prefix_keys(tokens, bs, "m"), n, r)
        list_rate = _best_rate(lambda bs=bs: prefix_keys(as_list, bs, "m"), n, r)
        print(
            f"prefix_keys block {bs:4d}: numpy input {arr_rate / 1e6:7.2f} M tokens/s "
            f"({arr_rate / base:5.1f}x baseline), list input {list_rate / 1e6:7.2f} M tokens/s"
        )
    target = _best_rate(lambda: prefix_keys(tokens, 16, "m"), len(tokens), args.repeat)
    verdict = "meets" if target >= 20e6 else "MISSES"
    print(f"target >= 20 M tokens/s at block 16: {target / 1e6:.2f} M tokens/s ({verdict})")


if __name__ == "__main__":
    main()
