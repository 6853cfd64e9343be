"""What recording cost, as a window's gaps measured it, is taken out of the what-if model."""

import json

import pytest
from run_builder import make_run

from dpro.io.load import load_run, recording_cost
from dpro.sim.whatif import context, predict


def _with_overhead(root, pct, spread, baseline="gaps", steps=(6, 4)):
    run = make_run(root)
    for rank in (0, 1):
        path = run / f"rank-{rank}.json"
        doc = json.loads(path.read_text())
        doc["recording_overhead"] = {"wall_pct": pct, "thread_cpu_pct": pct, "unrecorded_steps": steps[0],
                                     "recorded_steps": steps[1], "baseline": baseline, "wall_spread_pct": spread}
        path.write_text(json.dumps(doc))
    return run


def test_a_cost_beyond_the_gaps_noise_is_taken_out_of_the_baseline(tmp_path):
    plain = context(load_run(make_run(tmp_path / "plain")))
    ctx = context(load_run(_with_overhead(tmp_path / "run", 20.0, 2.0)))
    assert ctx.recording is not None and ctx.recording.beyond_noise
    assert ctx.as_recorded_ms == pytest.approx(predict(plain, {}).predicted_step_ms, rel=1e-6)
    assert predict(ctx, {}).predicted_step_ms == pytest.approx(ctx.as_recorded_ms / 1.2, rel=0.01)
    # compute shrank, not the recorded measurement
    assert ctx.base.measured_step_us == plain.base.measured_step_us


@pytest.mark.parametrize(("pct", "spread", "baseline"),
                         [(3.0, 5.0, "gaps"), (20.0, 2.0, "before"), (-8.0, 1.0, "gaps")])
def test_a_cost_within_noise_or_not_measured_against_gaps_is_kept(tmp_path, pct, spread, baseline):
    plain = context(load_run(make_run(tmp_path / "plain")))
    run = load_run(_with_overhead(tmp_path / "run", pct, spread, baseline))
    ctx = context(run)
    assert ctx.as_recorded_ms is None
    assert predict(ctx, {}).predicted_step_ms == pytest.approx(predict(plain, {}).predicted_step_ms, rel=1e-9)
    assert (recording_cost(run) is None) == (baseline == "before")


def test_the_bar_is_the_costs_standard_error_so_more_steps_tell_a_smaller_cost_from_chance(tmp_path):
    """+6% against steps that each vary by +/-10%: within chance over 10 steps, beyond it over 400."""
    few = recording_cost(load_run(_with_overhead(tmp_path / "few", 6.0, 10.0)))
    many = recording_cost(load_run(_with_overhead(tmp_path / "many", 6.0, 10.0, steps=(200, 200))))
    assert few.stderr_pct > many.stderr_pct > 0
    assert not few.beyond_noise and many.beyond_noise
    assert context(load_run(_with_overhead(tmp_path / "m2", 6.0, 10.0, steps=(200, 200)))).as_recorded_ms is not None
