"""argparse value types shared by Warply's commands and engine flags: one-line errors, no
tracebacks, for numbers out of range."""

from __future__ import annotations

import argparse
from collections.abc import Callable
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
    return _at_least(kind, 0, strict=True)


def non_negative(kind: type[N]) -> Callable[[str], N]:
    """Parser of a number >= 0 of type `kind` (int or float), e.g. a count where 0 means none."""
    return _at_least(kind, 0, strict=False)


def _at_least(kind: type[N], bound: N, strict: bool) -> Callable[[str], N]:
    def parse(text: str) -> N:
        value = _number(kind, text)
        if value < bound or (strict and value == bound):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>' if strict else '>='} {bound}")
        return value

    return parse


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _number(float, text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not in [0, 1]")
    return value
