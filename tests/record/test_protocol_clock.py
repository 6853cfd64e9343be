"""record.protocol's clock pair: the wall clock minus the rank's clock, read so that a preempted read does not count."""

from __future__ import annotations

import time

from dpro.record.protocol import Clock, wall_minus_clock_ns


def test_the_wall_offset_follows_the_rank_clock_and_its_skew() -> None:
    plain, skewed = Clock(), Clock(skew_us=2_000_000.0)
    direct = time.time_ns() - time.monotonic_ns()
    assert abs(wall_minus_clock_ns(plain) - direct) < 1_000_000            # within 1 ms of one direct reading
    # a clock 2 s ahead moves the offset back by 2 s
    assert abs(wall_minus_clock_ns(plain) - wall_minus_clock_ns(skewed) - 2e9) < 1_000_000
