"""Canonical block keys: definition, chaining, namespaces, input validation."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import xxhash

from warply.protocol import chain_keys, prefix_keys, root_seed


def _reference(tokens: list[int], block_size: int, model: str, namespace: str) -> list[int]:
    """The key definition written out plainly, one token at a time."""
    key = xxhash.xxh3_64_intdigest(b"\0".join((b"warply/v1", model.encode(), namespace.encode())))
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = b"".join(struct.pack("<I", t) for t in tokens[start : start + block_size])
        key = xxhash.xxh3_64_intdigest(block, seed=key)
        out.append(key)
    return out


@pytest.mark.parametrize("block_size", [1, 16, 64, 128])
def test_matches_plain_definition(block_size: int) -> None:
    rng = random.Random(block_size)
    tokens = [rng.randrange(0, 2**32) for _ in range(block_size * 7 + 3)]
    assert prefix_keys(tokens, block_size, "m", "ns") == _reference(tokens, block_size, "m", "ns")


def test_partial_block_gets_no_key() -> None:
    assert len(prefix_keys(list(range(47)), 16, "m")) == 2
    assert prefix_keys(list(range(15)), 16, "m") == []


def test_chain_continues_from_any_parent() -> None:
    tokens = list(range(1000, 1000 + 16 * 10))
    keys = prefix_keys(tokens, 16, "m")
    for k in range(1, 10):
        assert chain_keys(tokens[16 * k :], 16, keys[k - 1]) == keys[k:]


def test_shared_prefix_shares_keys_then_diverges() -> None:
    a = list(range(64))
    b = list(range(48)) + [999] * 16
    ka, kb = prefix_keys(a, 16, "m"), prefix_keys(b, 16, "m")
    assert ka[:3] == kb[:3] and ka[3] != kb[3]


def test_model_and_namespace_separate_chains() -> None:
    tokens = list(range(32))
    base = prefix_keys(tokens, 16, "m")
    assert not set(base) & set(prefix_keys(tokens, 16, "m", "tenant-a"))
    assert not set(base) & set(prefix_keys(tokens, 16, "other-model"))
    assert root_seed("m", "a") != root_seed("m", "b")


def test_accepts_numpy_and_lists_alike() -> None:
    tokens = list(range(100, 164))
    assert prefix_keys(np.array(tokens, dtype=np.int64), 16, "m") == prefix_keys(tokens, 16, "m")


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16, [[1, 2]] * 16, [1.5] * 16])
def test_rejects_tokens_outside_u32(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        prefix_keys(bad, 16, "m")  # type: ignore[arg-type]


def test_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        prefix_keys([1, 2, 3], 0, "m")
