"""Every command's every flag says what it does in `--help`: the console scripts, the replayer
and its simulator, and the bench/, scripts/ and examples/ programs."""

from __future__ import annotations

import argparse
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from replay.__main__ import parser as replay_parser
from replay.serve import _parser as serve_parser
from router.__main__ import _parser as router_parser
from warply.cli import _parser as warply_parser
from warply.common.argtypes import choice_list, number_list

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = sorted(
    p.relative_to(ROOT).as_posix()
    for folder in ("bench", "scripts", "examples")
    for p in (ROOT / folder).glob("*.py")
    if "argparse" in p.read_text()
)


def _flags_without_help(parser: argparse.ArgumentParser, path: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _flags_without_help(sub, f"{path} {name}")
        elif not action.help:
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def _bare_numbers(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The visible flags whose type is a bare `int` or `float`, which take 0 and negative
    numbers alike (and fail later, with a traceback, or run nonsense)."""
    bare = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                bare += _bare_numbers(sub, f"{path} {name}")
        elif action.type in (int, float) and action.help != argparse.SUPPRESS:
            bare.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return bare


class _Parsed(Exception):
    """Raised in place of parsing, carrying the parser a program built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(program: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser `program` builds in its `__main__`, caught when it parses."""

    def caught(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    monkeypatch.setattr(sys, "argv", [program])
    monkeypatch.syspath_prepend(str(ROOT / Path(program).parent))
    with pytest.raises(_Parsed) as parsed:
        runpy.run_path(str(ROOT / program), run_name="__main__")
    return parsed.value.parser


def test_the_commands_flags_all_have_help() -> None:
    assert _flags_without_help(router_parser(), "warply-router") == []
    assert _flags_without_help(warply_parser(), "warply") == []
    assert _flags_without_help(replay_parser(), "python -m replay") == []
    assert _flags_without_help(serve_parser(), "python -m replay.serve") == []
    assert "Served model name" in router_parser().format_help()


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_programs_flags_all_have_help(program: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _flags_without_help(_parser_of(program, monkeypatch), program) == []


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_programs_numbers_are_checked_at_their_flags(
    program: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every number flag has a checked type (warply.common.argtypes: positive, non_negative,
    fraction...), none a bare `int` or `float`."""
    assert _bare_numbers(_parser_of(program, monkeypatch), program) == []


@pytest.mark.parametrize(
    ("program", "args", "error"),
    [
        ("bench/router_decision.py", ["--sizes", "-5"], "argument --sizes: '-5' must be > 0"),
        ("bench/shift_replay.py", ["--workers", "0"], "argument --workers: '0' must be > 0"),
        ("bench/shift_replay.py", ["--at", "2"], "argument --at: '2' is not in [0, 1]"),
        ("bench/replay_scale.py", ["--workers", "0"], "argument --workers: '0' must be > 0"),
        ("bench/router_throughput.py", ["--streams", "0"], "argument --streams: '0' must be > 0"),
        ("bench/pd_replay.py", ["--sweep", "a"], "argument --sweep: 'a' is not an integer"),
        ("examples/quickstart.py", ["--model", "x", "--turns", "0"],
         "argument --turns: '0' must be > 0"),
        ("bench/soak.py", ["--workdir", str(ROOT / "pyproject.toml")],
         f"argument --workdir: '{ROOT}/pyproject.toml' is a file, not a folder"),
        ("bench/placement_matrix.py", ["--out", str(ROOT / "pyproject.toml" / "x")],
         f"argument --out: '{ROOT}/pyproject.toml/x': '{ROOT}/pyproject.toml' is a file"),
        (
            "bench/placement_matrix.py",
            ["--out", "x", "--workers", "4,x"],
            "argument --workers: 'x' is not an integer",
        ),
        (
            "bench/placement_matrix.py",
            ["--out", "x", "--workloads", "nope"],
            "argument --workloads: unknown 'nope' (known: conversation, gsp, agent, rag, unique)",
        ),
        (
            "bench/router_vs_sglang.py",
            ["--vllm", "x", "--model", "x", "--sglang-tuned", "1"],
            "argument --sglang-tuned: '1' is not ABS,REL",
        ),
        *(
            (program, [*args, "fixed8"], f"argument {flag}: unknown strategy 'fixed8'")
            for program, args, flag in [
                ("bench/placement_matrix.py", ["--out", "x", "--extra"], "--extra"),
                ("bench/shift_replay.py", ["-s"], "-s/--strategy"),
                ("bench/pd_replay.py", ["-s"], "-s/--strategy"),
                ("bench/replay_calibration.py", ["--ours"], "--ours"),
                ("bench/router_vs_sglang.py", ["--vllm", "x", "--model", "x", "--strategy"],
                 "--strategy"),
            ]
        ),
    ],
)
def test_the_programs_refuse_a_bad_value_at_its_flag(
    program: str, args: list[str], error: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A number out of range, a list with a bad item, a misspelt strategy or a folder that
    cannot be one stops the program with one line naming the flag (each of these used to end in
    a traceback, some after long work: a bad strategy failed in a worker process after the
    replays before it)."""
    parser = _parser_of(program, monkeypatch)
    monkeypatch.undo()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(args)
    assert exit_.value.code == 2
    assert f"{Path(program).name}: error: {error}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("program", "args", "error"),
    [
        ("bench/shift_replay.py", ["--at", "1"], "--at 1: the shift needs requests before and"),
        ("bench/shift_replay.py", ["--at", "0.6", "--until", "0.5"], "--until 0.5 must be after"),
        ("bench/index_ingest.py", ["--workers", "2", "--replicas", "3"], "--replicas 3 exceeds"),
    ],
)
def test_the_programs_check_their_flags_together_before_any_work(
    program: str, args: list[str], error: str
) -> None:
    """The checks a program makes after parsing (a range that depends on another flag) exit as
    argparse does, before the program starts its work."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / program), *args],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert done.returncode == 2
    assert f"{Path(program).name}: error: {error}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("program", "flags"),
    [("bench/cost_replay.py", []), ("bench/pd_replay.py", []), ("bench/replay_scale.py", []),
     ("bench/replay_vs_live.py", ["--sim-only"]),
     ("scripts/demo.py", ["--vllm", "x", "--model", "x"]),
     ("bench/router_vs_sglang.py", ["--vllm", "x", "--model", "x"])],
)
def test_the_programs_name_a_trace_they_cannot_read(
    program: str, flags: list[str], tmp_path: Path
) -> None:
    """A `--trace` that is missing or not a Mooncake trace ends the program with one line
    naming it (`replay.trace.exiting_on_bad_trace`), as a bad flag does; these ended in a
    traceback."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1}\n')
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}  # their work folders
    for trace, error in [(tmp_path / "missing", "cannot read trace"),
                         (bad, f"{bad}:1: not a Mooncake trace record"),
                         (binary, f"trace {binary} is not UTF-8 text")]:
        done = subprocess.run(
            [sys.executable, str(ROOT / program), *flags, "--trace", str(trace)],
            capture_output=True, text=True, env=env, timeout=60,
        )
        assert done.returncode == 2
        assert f"{Path(program).name}: {error}" in done.stderr
        assert "Traceback" not in done.stderr


def test_the_list_types_name_the_bad_item() -> None:
    assert number_list(int)("4,8,32") == [4, 8, 32]
    assert number_list(int, zero=True)("0,512") == [0, 512]
    assert number_list(float)("1,2.5") == [1.0, 2.5]
    for kind, text, error in [
        (int, "4,x", "'x' is not an integer"),
        (int, "4,", "'' is not an integer"),
        (int, "4,0", "'0' must be > 0"),
        (float, "1,-2", "'-2' must be > 0"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=error):
            number_list(kind)(text)
    assert choice_list(["a", "b"])("b,a") == ["b", "a"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown 'c', 'd' \(known: a, b\)"):
        choice_list(["a", "b"])("a,c,d")


_STARTERS = re.compile(r"\b(EngineProcess|VllmServer|RouterServer|RedisServer|SimWorkers|"
                       r"kv_event_engines)\(")


def test_the_programs_that_start_processes_stop_them_when_terminated() -> None:
    """A program that starts engines or servers ends through its clean-up on SIGTERM and SIGHUP
    (`launch.exit_on_termination`, what it does: tests/test_launch.py); without it `timeout` or
    a cancelled job leaves them running."""
    missing = [
        program for program in PROGRAMS
        if _STARTERS.search(text := (ROOT / program).read_text())
        and "exit_on_termination()" not in text
    ]  # fmt: skip
    assert missing == []


SHELL_SCRIPTS = sorted(
    p.relative_to(ROOT).as_posix()
    for p in (ROOT / "scripts").glob("*.sh")
    if p.read_text().startswith("#!")  # not the files they source
)


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_the_shell_scripts_answer_help_and_do_nothing_else(script: str) -> None:
    """`bash scripts/test.sh --help` ran the whole suite; demo.sh's and setup_envs.sh's first
    installed the venvs (minutes on a fresh machine)."""
    out = subprocess.run(
        ["bash", script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and out.stderr == ""
    lines = out.stdout.splitlines()
    assert len(lines) >= 2 and not lines[0].startswith(("#", "!")), lines


def test_the_test_script_refuses_arguments() -> None:
    out = subprocess.run(
        ["bash", "scripts/test.sh", "--fast"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "takes no arguments (got '--fast')" in out.stderr
