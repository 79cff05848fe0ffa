"""Mooncake-format request traces, expanded to deterministic token ids and canonical keys.

A trace line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`
with one hash id per block of `trace_block` tokens (the last block may be partial); equal hash
ids mean equal prefixes. Tokens are a pure function of (hash id, offset in block):

    token(h, j) = splitmix64(h · 2^20 + j) mod vocab

so equal hash chains give equal token prefixes, and the canonical keys (`warply.protocol.keys`)
of equal prefixes are equal, exactly as on a real engine.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from warply.protocol import chain_keys, root_seed

U32 = npt.NDArray[np.uint32]


class TraceError(ValueError):
    """A trace file that cannot be replayed (the message names the line and the problem)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival, sizes and its chain of trace-block hash ids."""

    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finaliser (vectorised): a cheap bijective mix of 64-bit words (uint64
    arithmetic wraps mod 2^64; in place after the first step: the replay's hot path)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        return x


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        raw = json.loads(line)
        req = TraceRequest(
            float(raw["timestamp"]),
            int(raw["input_length"]),
            int(raw["output_length"]),
            tuple(int(h) for h in raw["hash_ids"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"{where}: not a Mooncake trace record ({exc!r})") from None
    if req.input_length <= 0 or req.output_length <= 0:
        raise TraceError(f"{where}: input_length and output_length must be positive")
    if not req.hash_ids or min(req.hash_ids) < 0:
        raise TraceError(f"{where}: hash_ids must be a non-empty list of non-negative ints")
    return req


@contextmanager
def exiting_on_bad_trace(prog: str) -> Iterator[None]:
    """Around a command's reading of a trace it was given: a `TraceError` (no such file, a bad
    line, named) ends the command with that one line and status 2, as a bad flag does,
    instead of a traceback."""
    try:
        yield
    except TraceError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Parse a Mooncake JSONL trace (first `limit` requests), sorted by arrival (stable)."""
    requests: list[TraceRequest] = []
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if line.strip():
                    requests.append(_parse_line(line, f"{path}:{lineno}"))
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace {path} is not UTF-8 text") from None
    if not requests:
        raise TraceError(f"{path}: no requests")
    requests.sort(key=lambda r: r.arrival_ms)
    return requests


def request_tokens(
    req: TraceRequest, trace_block: int, vocab: int, start: int = 0, stop: int | None = None
) -> U32:
    """Token ids [start, stop) of one request's prompt (module docstring: token(h, j))."""
    stop = req.input_length if stop is None else min(stop, req.input_length)
    first, last = start // trace_block, -(-stop // trace_block)
    ids = np.asarray(req.hash_ids[first:last], dtype=np.uint64)
    words = (ids[:, None] << np.uint64(20)) + np.arange(trace_block, dtype=np.uint64)[None, :]
    toks = (_splitmix64(words.ravel()) % np.uint64(vocab)).astype(np.uint32)
    base = first * trace_block
    return toks[start - base : stop - base]


class ExpandedTrace:
    """A trace with token ids and canonical block keys at the engine's block size.

    `keys[i]` are the canonical keys of request i's full engine blocks (what the router computes
    from the prompt); `tokens(i, start, stop)` regenerates any token slice on demand, so the
    expansion holds keys only (a few bytes per block), never the whole token stream.
    """

    def __init__(
        self,
        requests: list[TraceRequest],
        trace_block: int,
        block_size: int,
        model: str = "replay",
        vocab: int = 32000,
    ) -> None:
        if not 0 < trace_block <= 2**20 or block_size <= 0:
            raise TraceError("block sizes must be positive (trace block at most 2**20 tokens)")
        if not 2 <= vocab <= 2**32:
            raise TraceError("vocab must be in [2, 2**32]")
        for i, r in enumerate(requests):
            if len(r.hash_ids) != -(-r.input_length // trace_block):
                raise TraceError(
                    f"request {i}: {len(r.hash_ids)} hash_ids for {r.input_length} tokens at "
                    f"{trace_block} tokens per trace block (wrong --trace-block?)"
                )
        self.requests = requests
        self.trace_block = trace_block
        self.block_size = block_size
        self.model = model
        self.vocab = vocab
        seed = root_seed(model)
        self.keys: list[list[int]] = [
            chain_keys(self.tokens(i), block_size, seed) for i in range(len(requests))
        ]

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def tokens(self, index: int, start: int = 0, stop: int | None = None) -> U32:
        """Token ids [start, stop) of request `index` (default: the whole prompt)."""
        return request_tokens(self.requests[index], self.trace_block, self.vocab, start, stop)
