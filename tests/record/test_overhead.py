"""A recorder's own measure of its cost: recorded steps against the unrecorded ones just before the window."""

from __future__ import annotations

import pytest

from dpro.record.protocol import BASELINE_STEPS, recording_overhead


def ends_of(durations: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """Step end times from per-iteration (wall, CPU) durations, iteration 0 ending at (0, 0)."""
    out, wall, cpu = {0: (0.0, 0.0)}, 0.0, 0.0
    for i in sorted(durations):
        wall, cpu = wall + durations[i][0], cpu + durations[i][1]
        out[i] = (wall, cpu)
    return out


def test_recorded_steps_against_the_steps_before_the_window():
    window = list(range(10, 16))
    steps = {i: (0.010, 0.008) for i in range(1, 10)}
    steps[9] = (0.050, 0.050)   # the window's clock exchange runs at the end of the step before it: left out
    steps[10] = (0.100, 0.100)  # the window's first step: left out
    steps.update({i: (0.011, 0.010) for i in range(11, 16)})
    o = recording_overhead(ends_of(steps), window)
    assert o["unrecorded_steps"] == BASELINE_STEPS and o["recorded_steps"] == 5
    assert o["wall_pct"] == pytest.approx(10.0) and o["thread_cpu_pct"] == pytest.approx(25.0)
    assert o["wall_ms"] == pytest.approx([10.0, 11.0])


def test_a_window_with_gaps_compares_against_the_unrecorded_steps_between_its_blocks():
    window = [10, 11, 12, 13, 18, 19, 20, 21]  # blocks of 4 recorded steps, 4 unrecorded between them
    steps = {i: (0.010, 0.010) for i in range(1, 22)}
    steps[9] = steps[17] = (0.050, 0.050)  # ends by installing the next block's hooks: left out
    steps.update({i: (0.020, 0.020) for i in range(14, 17)})  # the machine slowed down between the blocks
    steps.update({i: (0.021, 0.021) for i in (18, 19, 20, 21)})
    o = recording_overhead(ends_of(steps), window)
    # the gaps only, not the steps before; 14 follows a block (another rank may still be closing it), 17 installs
    # the next block's hooks: 15 and 16
    assert o["unrecorded_steps"] == 2 and o["recorded_steps"] == 6  # 18 starts a block: left out, as 10
    assert o["thread_cpu_ms"][0] == pytest.approx(20.0)


def test_no_figure_without_steps_before_the_window():
    assert recording_overhead(ends_of({i: (0.01, 0.01) for i in range(1, 6)}), [0, 1, 2, 3, 4, 5]) is None
    assert recording_overhead({}, [5, 6]) is None


@pytest.mark.parametrize("value", ["x", [1], {"wall_pct": float("nan")}, {"wall_pct": True}, None])
def test_a_malformed_overhead_in_a_trace_header_is_not_shown(tmp_path, value):
    import json

    from run_builder import make_run

    from dpro.io.load import load_run
    from dpro.report.info import format_run_summary, summarize_run

    run = make_run(tmp_path / "run")
    doc = json.loads((run / "rank-0.json").read_text())
    doc["recording_overhead"] = value
    (run / "rank-0.json").write_text(json.dumps(doc))
    summary = summarize_run(load_run(run))
    assert summary["ranks"][0]["recording_overhead"] is None
    assert "recording overhead" not in format_run_summary(summary)
