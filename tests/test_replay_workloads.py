"""Generated workloads: deterministic per seed, Mooncake-valid, equal ids = equal prefixes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from replay.trace import ExpandedTrace, TraceRequest, read_trace
from replay.workloads import BLOCK, GENERATORS, _Ids, shift, write


def test_block_ids_are_equal_exactly_for_equal_prefixes() -> None:
    ids = _Ids()
    system, doc = ids.segment(700), ids.segment(BLOCK)
    a, n = ids.blocks([system, doc, ids.segment(10)])
    b, _ = ids.blocks([system, doc, ids.segment(10)])
    c, _ = ids.blocks([system, ids.segment(BLOCK)])
    d, _ = ids.blocks([system, doc])
    assert n == 1222 and len(a) == 3 and len(d) == 3
    assert a[0] == b[0] == c[0] == d[0]  # system[0:512]
    assert a[1] == b[1] == d[1] != c[1]  # system[512:700] + doc[0:324], or another segment
    assert len({a[2], b[2], d[2]}) == 3  # doc tail + own question, or the doc tail alone


@pytest.mark.parametrize("shape", sorted(GENERATORS))
def test_generators_are_deterministic_and_replayable(shape: str, tmp_path: Path) -> None:
    one, two = GENERATORS[shape](200, 7), GENERATORS[shape](200, 7)
    assert one == two and one != GENERATORS[shape](200, 8)
    path = tmp_path / f"{shape}.jsonl"
    write(path, one)
    trace = ExpandedTrace(read_trace(path), BLOCK, 64)  # hash-id counts match the lengths
    assert len(trace) == 200
    first = {r.hash_ids[0] for r in trace.requests}
    if shape == "unique":
        assert len(first) == 200
    else:
        assert len(first) < 20  # shared system prompts / documents


def test_agent_prompts_are_append_only_per_session() -> None:
    records = GENERATORS["agent"](40, 0)  # sessions are generated one after another
    steps = 1
    for prev, nxt in zip(records, records[1:], strict=False):
        p, q = prev["hash_ids"], nxt["hash_ids"]
        assert isinstance(p, list) and isinstance(q, list)
        full = int(prev["input_length"]) // BLOCK  # type: ignore[call-overload]
        if q[:full] != p[:full]:
            break  # the next session
        assert int(nxt["input_length"]) > int(prev["input_length"])  # type: ignore[call-overload]
        steps += 1
    assert steps >= 6


def test_shift_multiplies_the_rate_after_the_pivot() -> None:
    requests = [TraceRequest(100.0 * i, 1, 1, (i,)) for i in range(11)]
    out = shift(requests, 0.5, 4)
    assert [r.arrival_ms for r in out] == [0, 100, 200, 300, 400, 500, 525, 550, 575, 600, 625]
    burst = shift(requests, 0.2, 4, until=0.5)  # from request 2 to 5: gaps of 25
    assert [r.arrival_ms for r in burst] == [0, 100, 200, 225, 250, 275, 375, 475, 575, 675, 775]


def test_command_line_writes_a_trace(tmp_path: Path) -> None:
    out = tmp_path / "rag.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "replay.workloads", "rag", "-o", str(out), "--requests", "50"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert len(read_trace(out)) == 50
    helptext = subprocess.run(
        [sys.executable, "-m", "replay.workloads", "--help"], capture_output=True, text=True
    ).stdout
    assert "agent" in helptext and "shift" in helptext


def test_shift_refuses_fractions_that_make_no_shift() -> None:
    requests = [TraceRequest(float(i), 1, 1, (i,)) for i in range(4)]
    for at, until, error in [(0, 1, "--at 0:"), (1, 1, "--at 1:"), (0.6, 0.5, "--until 0.5")]:
        with pytest.raises(ValueError, match=error):
            shift(requests, at, 4, until)
    with pytest.raises(ValueError, match="factor must be > 0"):
        shift(requests, 0.5, 0)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["agent", "--seed", "-1"], "argument --seed: '-1' must be >= 0"),
        (["shift", "TRACE", "--at", "2"], "argument --at: '2' is not in [0, 1]"),
        (["shift", "TRACE", "--at", "0.6", "--until", "0.2"], "--until 0.2 must be after --at 0.6"),
        (["shift", "MISSING"], "shift: cannot read trace"),
        (["shift", "BAD"], "BAD:2: not a Mooncake trace record"),
    ],
)
def test_command_line_refuses_bad_input_in_one_line(
    args: list[str], error: str, tmp_path: Path
) -> None:
    """Each of these used to end in a traceback (a negative seed, a missing or malformed trace)
    or in a silent copy of the trace with no shift (`--at 2`)."""
    trace = tmp_path / "trace.jsonl"
    write(trace, GENERATORS["unique"](5, 0))
    bad = tmp_path / "BAD"
    bad.write_text(trace.read_text().splitlines()[0] + '\n{"timestamp": 1}\n')
    paths = {"TRACE": str(trace), "MISSING": str(tmp_path / "missing"), "BAD": str(bad)}
    argv = [paths.get(a, a) for a in args]
    run = subprocess.run(
        [sys.executable, "-m", "replay.workloads", *argv, "-o", str(tmp_path / "out.jsonl")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert error.replace("BAD", str(bad)) in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "out.jsonl").exists()
