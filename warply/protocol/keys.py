"""Canonical block keys: the engine-independent identity of a cached prefix block.

key[-1] = xxh3_64("warply/v1" | model | namespace)                 (the root seed)
key[i]  = xxh3_64(le_u32(tokens[i*B:(i+1)*B]), seed=key[i-1])

Chaining through the xxh3 seed makes each key commit to the whole prefix, and lets the router
continue a chain from any parent key it already knows (a `BlockStored` with a parent) without
rehashing the prefix. Tokens are packed to little-endian u32 in C (`array.array`, or the
array's own `astype` for numpy input); the only Python-level loop is one hash call per block.
numpy is not imported here, to keep `warply.protocol` cheap to import inside engines.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import xxhash

_ROOT_DOMAIN = b"warply/v1"
_hash = xxhash.xxh3_64_intdigest
_U32 = "I" if array("I").itemsize == 4 else "L"


def root_seed(model: str, namespace: str = "") -> int:
    """Seed for the first block of a chain: ties keys to one model and one cache namespace."""
    return _hash(b"\0".join((_ROOT_DOMAIN, model.encode(), namespace.encode())))


def _pack_tokens(tokens: Sequence[int] | Any) -> bytes:
    """Little-endian u32 bytes of a flat token sequence (list, tuple, array or numpy array)."""
    if hasattr(tokens, "astype"):  # numpy array: validate and convert without a Python loop
        arr: Any = tokens
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError("token ids must be a flat sequence of integers")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
            raise ValueError("token ids must be integers in [0, 2**32)")
        return bytes(arr.astype("<u4", copy=False).tobytes())
    try:
        packed = array(_U32, tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def chain_keys(tokens: Sequence[int] | Any, block_size: int, seed: int) -> list[int]:
    """Keys of every *full* block of `tokens`, chained from `seed` (a root seed or parent key).

    A trailing partial block gets no key: engines never cache or report partial blocks.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = memoryview(_pack_tokens(tokens))  # block slices without copies
    step = block_size * 4
    end = len(data) - len(data) % step
    keys: list[int] = []
    append = keys.append
    key = seed
    for start in range(0, end, step):
        key = _hash(data[start : start + step], key)
        append(key)
    return keys


def prefix_keys(
    tokens: Sequence[int] | Any, block_size: int, model: str, namespace: str = ""
) -> list[int]:
    """Keys of a prompt's full blocks from the start of the sequence (the router's request side)."""
    return chain_keys(tokens, block_size, root_seed(model, namespace))
