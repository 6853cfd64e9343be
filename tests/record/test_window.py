"""The window's shared open and close (``dpro.record.window``): the trace's header, and the note, completeness and
overhead a closed window's trace carries."""

from __future__ import annotations

import json

from dpro.record.trace import event_row
from dpro.record.window import close_window, open_trace


def _trace(tmp_path, steps, **kwargs):
    writer = open_trace(tmp_path, 0, 1, host="h", device="host")
    for step in steps:
        writer.end_step(step, [event_row("STEP", "STEP", 0, 10.0 * step, 5.0, {"step": step})])
    missing = close_window(writer, [3, 4, 5], **kwargs)
    return missing, json.loads((tmp_path / "rank-0.json").read_text())


def test_a_full_window_is_complete_and_says_whose_clock(tmp_path):
    missing, doc = _trace(tmp_path, [3, 4, 5])
    assert missing == [] and doc["complete"] is True and doc["note"] == ""
    assert doc["host"] == "h" and doc["clock"]["device"] == "host" and doc["clock"]["unit"] == "us"


def test_a_window_cut_short_says_which_steps_are_missing(tmp_path):
    missing, doc = _trace(tmp_path, [3])
    assert missing == [4, 5] and doc["complete"] is False
    assert doc["note"] == "the run ended before steps 4..5"


def test_the_error_and_the_recorders_problems_are_the_note(tmp_path):
    _, doc = _trace(tmp_path, [3], error=RuntimeError("boom"), problems=["the profile could not be read", ""])
    assert doc["note"] == "stopped by RuntimeError: boom; the profile could not be read"


def test_the_overhead_is_written_with_the_recorders_own_figures(tmp_path):
    # every unrecorded step lasted 2 s (1 s of CPU), every recorded one 3 s (1.5 s)
    ends, wall, cpu = {}, 0.0, 0.0
    for i in range(13):
        wall, cpu = wall + (3.0 if i >= 10 else 2.0), cpu + (1.5 if i >= 10 else 1.0)
        ends[i] = (wall, cpu)
    writer = open_trace(tmp_path, 0, 1, host="h", device="host")
    for step in (10, 11, 12):
        writer.end_step(step, [event_row("STEP", "STEP", 0, 10.0 * step, 5.0, {"step": step})])
    close_window(writer, [10, 11, 12], step_ends=ends, overhead_extra={"builder_cpu_ms_per_step": 1.5})
    overhead = json.loads((tmp_path / "rank-0.json").read_text())["recording_overhead"]
    assert overhead["builder_cpu_ms_per_step"] == 1.5
    assert overhead["wall_pct"] == 50.0
