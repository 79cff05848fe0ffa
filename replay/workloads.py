"""Synthetic workloads in Mooncake trace format, deterministic for a seed.

    python -m replay.workloads agent  -o agent.jsonl  [--seed 0] [--requests N]
    python -m replay.workloads rag    -o rag.jsonl
    python -m replay.workloads unique -o unique.jsonl
    python -m replay.workloads shift  TRACE -o shifted.jsonl --at 0.5 --factor 4 [--until 1]

Shapes (trace block 512 tokens; replay them with `--trace-block 512`):

- `agent`: agent loops. Sessions arrive as a Poisson process; each starts with one of a few
  shared tool/system prompts and its own task, then takes 6-24 steps; each step appends the
  model's previous output and a tool observation to the prompt (append-only, up to ~64k
  tokens) and arrives after the previous step's expected generation time plus a tool delay.
- `rag`: retrieval over a few large shared documents. Every request is a shared system prompt,
  one of 8 documents (8k-24k tokens, Zipf-popular: the hottest takes ~40 % of requests), a few
  retrieved passages of its own and a question. Poisson arrivals.
- `unique`: no reuse at all: every prompt is new (lognormal lengths), Poisson arrivals.
- `shift`: an existing trace whose inter-arrival gaps from a point on (`--at`, a fraction of the
  requests) are divided by `--factor` (a sudden rise of the arrival rate mid-trace), up to
  `--until` (default: the end), after which the rate returns to the trace's own (the four
  Mooncake fields of each record are written).

Block ids are assigned so that equal ids mean equal prefixes, as in Mooncake traces: a prompt is
a list of segments (shared or private runs of tokens), and block i's id is a function of block
i−1's id and the segment pieces block i holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from replay.trace import TraceRequest, exiting_on_bad_trace, read_trace
from warply.common.argtypes import fraction, non_negative, output_file, positive

BLOCK = 512
"""Tokens per trace block (hash id) in the generated traces."""

Segment = tuple[int, int]
"""(segment id, tokens): a run of tokens; equal ids are equal contents."""


@dataclass
class _Ids:
    """Assigns chained block ids (equal prefix content ↔ equal id) and fresh segment ids."""

    table: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = field(default_factory=dict)
    next_segment: int = 0

    def segment(self, tokens: int) -> Segment:
        self.next_segment += 1
        return (self.next_segment, int(tokens))

    def blocks(self, segments: Sequence[Segment]) -> tuple[list[int], int]:
        """Hash ids of the prompt made of `segments` and its length in tokens."""
        ids: list[int] = []
        pieces: list[tuple[int, int, int]] = []
        filled, parent, total = 0, -1, 0
        for seg, length in segments:
            start = 0
            while start < length:
                take = min(length - start, BLOCK - filled)
                pieces.append((seg, start, start + take))
                start += take
                filled += take
                if filled == BLOCK:
                    parent = self._id(parent, pieces)
                    ids.append(parent)
                    pieces, filled = [], 0
            total += length
        if pieces:
            ids.append(self._id(parent, pieces))
        return ids, total

    def _id(self, parent: int, pieces: list[tuple[int, int, int]]) -> int:
        key = (parent, tuple(pieces))
        return self.table.setdefault(key, len(self.table))


def _record(t_ms: float, segments: Sequence[Segment], output: int, ids: _Ids) -> dict[str, object]:
    hash_ids, length = ids.blocks(segments)
    return {
        "timestamp": round(t_ms),
        "input_length": length,
        "output_length": int(output),
        "hash_ids": hash_ids,
    }


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))


def agent(requests: int = 3000, seed: int = 0, rate: float = 1.5) -> list[dict[str, object]]:
    """Agent loops (module docstring); `rate` sessions per second."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    systems = [ids.segment(int(rng.integers(2500, 6000))) for _ in range(3)]
    out: list[dict[str, object]] = []
    t = 0.0
    while len(out) < requests:
        t += rng.exponential(1000.0 / rate)
        system = systems[int(rng.integers(len(systems)))]
        prompt = [system, ids.segment(int(rng.integers(300, 2000)))]
        at = t
        for _ in range(int(rng.integers(6, 25))):
            length = sum(n for _, n in prompt)
            if length > 64_000 or len(out) >= requests:
                break
            output = _lognormal(rng, 150, 0.6, 16, 600)
            out.append(_record(at, prompt, output, ids))
            # next step: after the expected generation (~15 ms/token + 0.3 s) and a tool call
            at += 300 + 15 * output + rng.exponential(1500)
            observation = _lognormal(rng, 800, 1.0, 50, 8000)
            prompt = [*prompt, ids.segment(output), ids.segment(observation)]
    return out


def rag(requests: int = 3000, seed: int = 0, rate: float = 12.0) -> list[dict[str, object]]:
    """RAG over a few large shared documents (module docstring); `rate` requests per second."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.segment(800)
    docs = [ids.segment(int(rng.integers(8_000, 24_000))) for _ in range(8)]
    weights = 1.0 / np.arange(1, len(docs) + 1) ** 1.2
    weights /= weights.sum()
    out: list[dict[str, object]] = []
    t = 0.0
    for _ in range(requests):
        t += rng.exponential(1000.0 / rate)
        doc = docs[int(rng.choice(len(docs), p=weights))]
        passages = ids.segment(int(rng.integers(500, 3000)))
        question = ids.segment(int(rng.integers(20, 300)))
        output = _lognormal(rng, 200, 0.7, 16, 1000)
        out.append(_record(t, [system, doc, passages, question], output, ids))
    return out


def unique(requests: int = 3000, seed: int = 0, rate: float = 8.0) -> list[dict[str, object]]:
    """Unique prompts, no reuse (module docstring); `rate` requests per second."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    out: list[dict[str, object]] = []
    t = 0.0
    for _ in range(requests):
        t += rng.exponential(1000.0 / rate)
        prompt = [ids.segment(_lognormal(rng, 3000, 0.8, 64, 32_000))]
        out.append(_record(t, prompt, _lognormal(rng, 250, 0.7, 16, 2000), ids))
    return out


def shift(
    requests: Sequence[TraceRequest], at: float, factor: float, until: float = 1.0
) -> list[TraceRequest]:
    """`requests` (sorted by arrival) with the gaps between the `at` and `until` fractions of
    them divided by `factor`: the arrival rate multiplies by `factor` there (until the end by
    default), then returns to what it was. Arrivals are rounded to whole milliseconds."""
    problem = shift_problem(at, until)
    if problem or factor <= 0:
        raise ValueError(problem or f"factor must be > 0, not {factor:g}")
    requests = sorted(requests, key=lambda r: r.arrival_ms)
    start, stop = int(len(requests) * at), int(len(requests) * until)
    out: list[TraceRequest] = []
    t, prev = 0.0, None
    for i, r in enumerate(requests):
        if prev is not None:
            gap = r.arrival_ms - prev
            t += gap / factor if start < i <= stop else gap
        else:
            t = r.arrival_ms
        prev = r.arrival_ms
        out.append(replace(r, arrival_ms=float(round(t))))
    return out


def as_record(request: TraceRequest) -> dict[str, object]:
    """A trace request as a Mooncake record (what `write` takes)."""
    return {
        "timestamp": round(request.arrival_ms),
        "input_length": request.input_length,
        "output_length": request.output_length,
        "hash_ids": list(request.hash_ids),
    }


def shift_problem(at: float, until: float) -> str | None:
    """What is wrong with a shift from fraction `at` of the requests to `until` (None: fine):
    it needs requests before and after its start, and an end after its start."""
    if not 0 < at < 1:
        return f"--at {at:g}: the shift needs requests before and after it (0 < --at < 1)"
    if not at < until <= 1:
        return f"--until {until:g} must be after --at {at:g} (and at most 1)"
    return None


def add_shift_flags(ap: argparse.ArgumentParser) -> None:
    """The shift's flags (`--at`, `--factor`, `--until`); `check_shift_flags` after parsing."""
    ap.add_argument(
        "--at", type=fraction, default=0.5, help="fraction of requests before the shift"
    )
    ap.add_argument(
        "--factor", type=positive(float), default=4.0, help="arrival-rate multiplier after"
    )
    ap.add_argument("--until", type=fraction, default=1.0, help="fraction where the rate returns")


def check_shift_flags(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit as argparse does when `--at` and `--until` do not make a shift."""
    problem = shift_problem(args.at, args.until)
    if problem:
        ap.error(problem)


GENERATORS: dict[str, Callable[..., list[dict[str, object]]]] = {
    "agent": agent,
    "rag": rag,
    "unique": unique,
}
"""Generated shapes by name: (requests, seed, rate) → Mooncake records."""


def write(path: str | Path, records: Sequence[dict[str, object]]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in sorted(records, key=lambda r: float(r["timestamp"])):  # type: ignore[arg-type]
            fh.write(json.dumps(r, separators=(",", ":")) + "\n")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m replay.workloads",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="shape", required=True)
    for name, fn in GENERATORS.items():
        p = sub.add_parser(name, help=(fn.__doc__ or "").splitlines()[0])
        p.add_argument(
            "-o", "--output", required=True, type=output_file, help="JSONL file to write"
        )
        p.add_argument(
            "--seed",
            type=non_negative(int),
            default=0,
            help="random seed (same seed, same trace)",
        )
        p.add_argument("--requests", type=positive(int), default=3000, help="requests to write")
        p.add_argument(
            "--rate",
            type=positive(float),
            help="sessions/s (agent, default 0.5) or requests/s (rag, unique: default 6)",
        )
    s = sub.add_parser("shift", help="raise a trace's arrival rate from a point on")
    s.add_argument("trace", help="Mooncake JSONL trace to read")
    s.add_argument("-o", "--output", required=True, type=output_file, help="JSONL file to write")
    add_shift_flags(s)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.shape == "shift":
        check_shift_flags(ap, args)
        with exiting_on_bad_trace(f"{ap.prog} shift"):
            requests = read_trace(args.trace)
        out = [as_record(r) for r in shift(requests, args.at, args.factor, args.until)]
    else:
        kwargs: dict[str, float] = {} if args.rate is None else {"rate": args.rate}
        out = GENERATORS[args.shape](args.requests, args.seed, **kwargs)
    write(args.output, out)
    print(f"{args.output}: {len(out)} requests", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
