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
    seq: int = 0
    """Its place in the order of added samples (tells whether it is still in the window)."""


class HitWindow:
    """Sliding window of recent requests' prompt / predicted / engine-reported cached tokens.

    The sums are kept as samples enter and leave, so reading a ratio (every request checks the
    alert) costs O(1), not a walk over the window."""

    def __init__(self, size: int) -> None:
        self._samples: deque[Sample] = deque(maxlen=size)
        self._added = 0
        self._prompt = self._predicted = 0
        self._engine_prompt = self._engine = 0
        """Sums over the samples whose engine numbers arrived."""

    def add(self, prompt: int, predicted: int) -> Sample:
        samples = self._samples
        if len(samples) == samples.maxlen:
            self._drop(samples[0])
        self._added += 1
        sample = Sample(prompt, predicted, seq=self._added)
        samples.append(sample)
        self._prompt += prompt
        self._predicted += predicted
        return sample

    def _drop(self, old: Sample) -> None:
        self._prompt -= old.prompt
        self._predicted -= old.predicted
        if old.engine is not None:
            self._engine_prompt -= old.prompt
            self._engine -= old.engine

    def set_engine(self, sample: Sample, cached: int) -> None:
        """The engine reported `cached` prompt tokens for `sample`'s request."""
        in_window = sample.seq > self._added - len(self._samples)
        if in_window and sample.engine is not None:
            self._engine_prompt -= sample.prompt
            self._engine -= sample.engine
        sample.engine = cached
        if in_window:
            self._engine_prompt += sample.prompt
            self._engine += cached

    def __len__(self) -> int:
        return len(self._samples)

    def predicted(self) -> float | None:
        return ratio(self._predicted, self._prompt)

    def engine(self) -> float | None:
        return ratio(self._engine, self._engine_prompt)


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
        self.window.set_engine(sample, cached)
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
