"""measured_change: whether a run's steps are faster or slower than a reference run's beyond their spread."""

from __future__ import annotations

import random

import pytest

from dpro.errors import UsageError
from dpro.report.compare import measured_change


def noisy(ms: float, n: int, seed: int, spread: float = 0.05) -> list[float]:
    rng = random.Random(seed)
    return [ms * (1.0 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_a_clear_slowdown_and_a_clear_speedup():
    slower = measured_change(noisy(10.0, 12, 1), noisy(12.0, 12, 2))
    assert slower.verdict == "slower" and 1.0 < slower.low <= slower.ratio <= slower.high
    faster = measured_change(noisy(10.0, 12, 3), noisy(8.0, 12, 4))
    assert faster.verdict == "faster" and faster.high < 1.0
    assert "-" in faster.describe().split(",")[1]


def test_a_change_inside_the_spread_is_undecided():
    change = measured_change(noisy(10.0, 8, 5, spread=0.3), noisy(10.2, 8, 6, spread=0.3))
    assert change.verdict == "undecided" and change.low < 1.0 < change.high


def test_too_few_steps_are_refused():
    with pytest.raises(UsageError, match="too few recorded steps"):
        measured_change([1.0, 2.0], [1.0, 2.0, 3.0])
