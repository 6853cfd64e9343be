"""The probes' fits after the window: what the allreduce beside compute gives (``transfer_probe``'s fit)."""

from __future__ import annotations

import pytest

from dpro.record.protocol import _transfer_fit


def test_the_transfer_fit_reads_the_stall_and_slowdown_through_two_sizes() -> None:
    # under compute = 2000 + 1.5 * alone, with a neighbour's 10 ms run in one pair of each kind (the medians ignore it)
    small_alone = [1000.0, 1010.0, 990.0, 1005.0, 995.0, 11000.0, 1000.0]
    large_alone = [8000.0, 8050.0, 7950.0, 8020.0, 7980.0, 8000.0, 18000.0]
    small = [2000.0 + 1.5 * a for a in [1000.0, 1010.0, 990.0, 1005.0, 995.0, 1000.0, 1000.0]]
    large = [2000.0 + 1.5 * a for a in [8000.0, 8050.0, 7950.0, 8020.0, 7980.0, 8000.0, 8000.0]]
    small[2] += 10_000.0
    fit = _transfer_fit([(small_alone, small), (large_alone, large)])
    assert fit["slowdown"] == pytest.approx(0.5, abs=0.02)
    assert fit["stall_us"] == pytest.approx(2000.0, abs=100.0)
    assert fit["excess_us"] == pytest.approx(2500.0, abs=50.0)
    assert 0 <= fit["excess_stderr"] < fit["excess_us"] / 2  # evidence enough to apply


def test_compute_that_slows_nothing_fits_no_stall_nor_slowdown() -> None:
    alone = [[1000.0 + 10 * i for i in range(7)], [8000.0 + 10 * i for i in range(7)]]
    fit = _transfer_fit([(a, list(a)) for a in alone])
    assert fit["slowdown"] == pytest.approx(0.0) and fit["stall_us"] == pytest.approx(0.0)
    assert fit["excess_us"] == pytest.approx(0.0)
    assert _transfer_fit([(alone[0], alone[0])]) == {}  # one size tells no slope
