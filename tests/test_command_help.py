"""Every command's every flag says what it does in `--help`: the console scripts, the replayer
and its simulator, and the bench/ and scripts/ programs."""

from __future__ import annotations

import argparse
import runpy
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
    for folder in ("bench", "scripts")
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


@pytest.mark.parametrize(
    ("program", "args"),
    [
        ("bench/placement_matrix.py", ["--out", "x", "--extra"]),
        ("bench/shift_replay.py", ["-s"]),
        ("bench/pd_replay.py", ["-s"]),
        ("bench/replay_calibration.py", ["--ours"]),
        ("bench/router_vs_sglang.py", ["--vllm", "x", "--model", "x", "--strategy"]),
    ],
)
def test_the_programs_refuse_a_bad_strategy_at_their_flags(
    program: str, args: list[str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A misspelt strategy stops the program before any replay runs (it used to fail in a
    worker process, with a traceback, after the replays before it)."""
    parser = _parser_of(program, monkeypatch)
    monkeypatch.undo()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*args, "fixed8"])
    assert exit_.value.code == 2
    assert "unknown strategy 'fixed8'" in capsys.readouterr().err


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
