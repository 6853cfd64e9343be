"""Recording windows as text: START:STOP and START:STOP:BLOCK (recorded blocks alternating with gaps)."""

from __future__ import annotations

import pytest

from dpro.errors import UsageError
from dpro.record.protocol import Window, parse_window, recording_overhead, window_from_text


def test_windows_read_and_print_back():
    assert parse_window("10:20") == Window(10, 20) and parse_window("10:20").steps == list(range(10, 20))
    blocks = parse_window("10:33:5")
    assert blocks.steps == [10, 11, 12, 13, 14, 20, 21, 22, 23, 24, 30, 31, 32]
    for text in ("10:20", "10:33:5", "0:4:2"):
        assert str(parse_window(text)) == text


@pytest.mark.parametrize(("text", "message"), [
    ("ten", "expected START:STOP"), ("1:2:3:4", "START:STOP:BLOCK"), ("5:5", "STOP must be greater"),
    ("3:9:1", "BLOCK must be 2 or more"), ("-1:4", "starts at 0 or later"),
])
def test_bad_windows_are_explained(text, message):
    with pytest.raises(UsageError, match=message):
        parse_window(text)


def test_a_window_from_the_environment_never_fails():
    assert window_from_text(None) == (Window(10, 20), None)
    window, problem = window_from_text("10:x", "DPRO_PROFILE")
    assert window == Window(10, 20) and "DPRO_PROFILE=" in problem and "recording 10:20" in problem


def test_a_gapped_window_measures_its_overhead_against_its_gaps():
    """Recorded steps of 12 ms against gap steps of 10 ms: +20%, whatever the warm-up steps before the window took
    (20 ms here: against them, recording would look 40% faster)."""
    window = parse_window("10:30:5").steps
    ends, t = {}, 0.0
    for i in range(3, 30):
        t += 0.020 if i < 10 else (0.012 if i in window else 0.010)
        ends[i] = (t, t / 2)
    overhead = recording_overhead(ends, window)
    assert overhead["recorded_steps"] == len(window) - 2  # each block's first (it also starts the block) left out
    # 16..18: not 15 (just after a block: another rank may still be closing it), not 19 (its end installs the
    # next block's hooks)
    assert overhead["unrecorded_steps"] == 3
    assert overhead["wall_ms"] == pytest.approx([10.0, 12.0])
    assert overhead["wall_pct"] == pytest.approx(20.0)
