"""Percentiles for the bench scripts, one method for all. Not a benchmark; the scripts import
it from their own folder."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentiles(samples: Sequence[float]) -> list[float]:
    """The 1st to 99th percentiles (index p - 1). "inclusive" interpolates between samples;
    `statistics.quantiles`' default ("exclusive") extrapolates past the largest one when there
    are fewer than 100, so its p99 could exceed the max."""
    return statistics.quantiles(samples, n=100, method="inclusive")
