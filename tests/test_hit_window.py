"""The hit window's running sums equal sums over the samples it holds."""

from __future__ import annotations

import random

from router.metrics import HitWindow, Sample


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def test_running_sums_follow_the_window() -> None:
    rng = random.Random(7)
    window = HitWindow(16)
    held: list[Sample] = []
    for _ in range(2000):
        prompt = rng.randrange(0, 500)
        sample = window.add(prompt, rng.randrange(0, prompt + 1))
        held = (held + [sample])[-16:]
        if rng.random() < 0.7:  # engine numbers arrive late, sometimes for evicted samples
            late = rng.choice(held + [sample])
            window.set_engine(late, rng.randrange(0, late.prompt + 1))
        done = [s for s in held if s.engine is not None]
        assert window.predicted() == _ratio(
            sum(s.predicted for s in held), sum(s.prompt for s in held)
        )
        assert window.engine() == _ratio(
            sum(s.engine or 0 for s in done), sum(s.prompt for s in done)
        )


def test_a_sample_reported_after_it_left_changes_nothing() -> None:
    window = HitWindow(2)
    first = window.add(100, 50)
    window.add(100, 0)
    window.add(100, 0)  # `first` left the window
    window.set_engine(first, 100)
    assert window.engine() is None
    assert window.predicted() == 0.0
