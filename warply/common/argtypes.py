"""argparse value types shared by Warply's commands, engine flags and bench programs: one-line
errors, no tracebacks, for numbers out of range (alone or in comma-separated lists), unknown
names and files that could not be written."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

N = TypeVar("N", int, float)


def _number(kind: type[N], text: str) -> N:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive(kind: type[N]) -> Callable[[str], N]:
    """Parser of a number > 0 of type `kind` (int or float)."""
    return _signed(kind, zero=False)


def non_negative(kind: type[N]) -> Callable[[str], N]:
    """Parser of a number >= 0 of type `kind` (int or float), e.g. a count where 0 means none."""
    return _signed(kind, zero=True)


def _signed(kind: type[N], zero: bool) -> Callable[[str], N]:
    """Parser of a number > 0, or >= 0 when `zero`."""

    def parse(text: str) -> N:
        value = _number(kind, text)
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>=' if zero else '>'} 0")
        return value

    return parse


def number_list(kind: type[N], zero: bool = False) -> Callable[[str], list[N]]:
    """Parser of comma-separated numbers of type `kind`, e.g. "4,8,32": each > 0, or >= 0 when
    `zero`."""
    one = _signed(kind, zero)

    def parse(text: str) -> list[N]:
        return [one(part) for part in text.split(",")]

    return parse


def choice_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """Parser of comma-separated names out of `choices`, e.g. "gsp,rag", in the order given."""
    known = tuple(choices)

    def parse(text: str) -> list[str]:
        names = text.split(",")
        unknown = ", ".join(repr(name) for name in names if name not in known)
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown} (known: {', '.join(known)})")
        return names

    return parse


def output_file(text: str) -> Path:
    """A file a command writes, checked when parsed so that a long run never ends unable to save
    its result: not a folder, in a folder that exists and may be written."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: there is no folder {str(folder)!r}")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: folder {str(folder)!r} is not writable")
    return path


def output_folder(text: str) -> Path:
    """A folder a command writes into (made later, with its parents, when missing), checked
    when parsed as `output_file` is: a folder or nothing at that path, under a folder that may
    be written."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    parent = path.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: folder {str(parent)!r} is not writable")
    return path


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _number(float, text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not in [0, 1]")
    return value
