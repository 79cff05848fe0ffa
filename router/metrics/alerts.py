"""The hit-rate alert: a sliding window of recent requests and `min_hit_ratio` over it.

The windowed hit rate is engine-reported when any request in the window has its engine
numbers, else predicted. Below `min_hit_ratio` (once the window holds `min_requests`), the alert
fires: a warning log line, `firing` (the registry's `warply_router_hit_ratio_alert` gauge reads
it) and the optional `module:function` callback with (hit_ratio, threshold). Crossing back up
clears it with an info line.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from router.config import AlertConfig, ConfigError
from warply.common.loading import LoadError, load_path

_log = logging.getLogger("warply.router")

AlertCallback = Callable[[float, float], object]


def ratio(num: int, den: int) -> float | None:
    return num / den if den else None


@dataclass(slots=True)
class Sample:
    """One request in the window: prompt, predicted cached and engine-reported cached tokens."""

    prompt: int
    predicted: int
    engine: int | None = None


class HitWindow:
    """Sliding window of recent requests' prompt / predicted / engine-reported cached tokens."""

    def __init__(self, size: int) -> None:
        self._samples: deque[Sample] = deque(maxlen=size)

    def add(self, prompt: int, predicted: int) -> Sample:
        sample = Sample(prompt, predicted)
        self._samples.append(sample)
        return sample

    def __len__(self) -> int:
        return len(self._samples)

    def predicted(self) -> float | None:
        return ratio(sum(s.predicted for s in self._samples), sum(s.prompt for s in self._samples))

    def engine(self) -> float | None:
        done = [s for s in self._samples if s.engine is not None]
        return ratio(sum(s.engine or 0 for s in done), sum(s.prompt for s in done))


def load_callback(spec: str | None) -> AlertCallback | None:
    """The `alerts.callback` function; raises `ConfigError` when it cannot be loaded."""
    if spec is None:
        return None
    try:
        fn = load_path(spec)
    except LoadError as exc:
        raise ConfigError(f"alerts.callback: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"alerts.callback: {spec!r} is not callable")
    return fn


class HitAlert:
    """`min_hit_ratio` over a `HitWindow`; checked whenever the window changes."""

    def __init__(self, config: AlertConfig) -> None:
        self.config = config
        self.window = HitWindow(config.window)
        self.firing = False
        self._callback = load_callback(config.callback)

    def add(self, prompt: int, predicted: int) -> Sample:
        """A request was placed; its engine numbers come later (`engine`)."""
        sample = self.window.add(prompt, predicted)
        self.check()
        return sample

    def engine(self, sample: Sample, cached: int) -> None:
        """The engine reported `cached` prompt tokens for `sample`'s request."""
        sample.engine = cached
        self.check()

    def check(self) -> None:
        engine, predicted = self.window.engine(), self.window.predicted()
        threshold = self.config.min_hit_ratio
        hit = engine if engine is not None else predicted
        if threshold <= 0 or hit is None or len(self.window) < self.config.min_requests:
            return
        firing = hit < threshold
        if firing == self.firing:
            return
        self.firing = firing
        if not firing:
            _log.info("hit-rate alert cleared: windowed hit rate %.3f >= %.3f", hit, threshold)
            return
        _log.warning(
            "hit-rate alert: windowed hit rate %.3f < min_hit_ratio %.3f (last %d requests)",
            hit, threshold, len(self.window),
        )
        if self._callback is not None:
            try:
                self._callback(hit, threshold)
            except Exception:  # a user callback must not take a request down
                _log.exception("hit-rate alert callback %s failed", self.config.callback)
