"""The recorded steps replayed one after another (``dpro.sim.steps``)."""

from __future__ import annotations

from run_builder import make_run_of, x_event

from dpro.analyze import analyze_path
from dpro.dag.align import align
from dpro.dag.step_model import far_out_steps, step_model
from dpro.dag.wiring import graph_from_steps
from dpro.io.load import load_run
from dpro.sim.replay import plan_levels, replay
from dpro.sim.steps import one_step_models, replay_recorded, typical_step_us

FAST_US, SLOW_US, TRANSFER_US, UPDATE_US = 2000.0, 6000.0, 1000.0, 200.0
PERIOD_US = SLOW_US + 500.0 + TRANSFER_US + UPDATE_US


def _alternating_straggler(rank: int, step: int) -> list[dict]:
    """Both ranks start each step together; rank 0 computes slowly in even steps, rank 1 in odd ones, so every
    step waits for one slow rank while each rank's median compute is between fast and slow."""
    t0 = 1_000_000.0 + step * PERIOD_US
    fw = SLOW_US if (step + rank) % 2 == 0 else FAST_US
    arrive = t0 + fw + 500.0
    done = t0 + SLOW_US + 500.0 + TRANSFER_US
    return [
        x_event("STEP", "STEP", t0, PERIOD_US, rank=rank, queue="host", step=step),
        x_event("FW.fc1", "FW", t0, fw, rank=rank, queue="compute", step=step),
        x_event("BW.fc1", "BW", t0 + fw, 500.0, rank=rank, queue="compute", step=step, grads=["fc1.weight"]),
        x_event("COMM.fc1.weight.allreduce", "COMM", arrive, done - arrive, rank=rank, queue="comm", step=step,
                bytes=7172, tensors=["fc1.weight"], op="allreduce", phase="allreduce"),
        x_event("UPDATE.sgd", "UPDATE", done, UPDATE_US, rank=rank, queue="compute", step=step),
    ]


def test_a_straggler_that_changes_from_step_to_step_is_replayed_step_by_step(tmp_path):
    run = make_run_of(tmp_path / "run", _alternating_straggler, steps=range(3, 11))
    analysis = analyze_path(run)
    assert analysis.measured_step_ms == PERIOD_US / 1000.0
    assert abs(analysis.error_pct) < 1.0, analysis
    for row in analysis.per_rank:
        assert abs(row["predicted_step_ms"] - PERIOD_US / 1000.0) < 0.05
    assert any("checks the DAG's wiring" in n and "(+0.00 %" in n for n in analysis.notes), analysis.notes


def test_each_recorded_step_replays_to_its_measured_time(tmp_path):
    root = make_run_of(tmp_path / "run", _alternating_straggler, steps=range(3, 11))
    run = load_run(root)
    alignment = align(run)
    recorded = replay_recorded(*one_step_models(run, alignment, step_model(run, alignment).steps))
    assert recorded.steps == list(range(4, 11))  # the first recorded step only starts the others
    for rank in (0, 1):
        assert recorded.measured_us[rank] == [PERIOD_US] * 7
        assert max(abs(p - PERIOD_US) for p in recorded.predicted_us[rank]) < 1.0, recorded.predicted_us


def test_typical_step_is_the_mean_of_the_middle_half():
    assert typical_step_us([10.0, 1.0, 3.0, 2.0, 100.0, 4.0, 5.0, 6.0]) == 4.5   # 3, 4, 5, 6
    assert typical_step_us([7.0]) == 7.0


def _tensorflow_like_step(rank: int, step: int) -> list[dict]:
    """A layer's backward marks its gradient ready at its end, yet Horovod launched the gradient's allreduce half-way
    through it; the optimizer applies the other variables while the second allreduce is still running."""
    t0 = 1_000_000.0 + step * 10_000.0
    return [
        x_event("STEP", "STEP", t0, 9000.0, rank=rank, queue="host", step=step),
        x_event("FW.fc1", "FW", t0, 1000.0, rank=rank, queue="compute", step=step),
        x_event("BW.fc2", "BW", t0 + 1000, 2000.0, rank=rank, queue="compute", step=step, grads=["fc2.weight"],
                grads_ready_us=[t0 + 3000]),
        x_event("COMM.fc2.weight.allreduce", "COMM", t0 + 2000, 1500.0, rank=rank, queue="comm", step=step,
                bytes=4080, tensors=["fc2.weight"], op="allreduce", phase="allreduce"),
        x_event("BW.fc1", "BW", t0 + 3000, 1000.0, rank=rank, queue="compute", step=step, grads=["fc1.weight"]),
        x_event("COMM.fc1.weight.allreduce", "COMM", t0 + 4000, 4500.0, rank=rank, queue="comm", step=step,
                bytes=7172, tensors=["fc1.weight"], op="allreduce", phase="allreduce"),
        x_event("UPDATE.optimizer", "UPDATE", t0 + 4000, 1000.0, rank=rank, queue="compute", step=step),
    ]


def test_collectives_launched_before_their_layer_ends_and_an_update_that_does_not_wait(tmp_path):
    run = load_run(make_run_of(tmp_path / "run", _tensorflow_like_step, steps=range(3, 9)))
    alignment = align(run)
    model = step_model(run, alignment)
    g = graph_from_steps(model, iterations=2)
    schedule = replay(g, plan_levels(g))
    node = {(g.names[i], int(g.rank[i])): i for i in range(g.size) if g.iteration[i] == 1}
    first = float(schedule.end[g.step_end[(0, 0)]])
    # the allreduce launched 1 ms into BW.fc2 arrives there, not at the layer's end
    assert abs(schedule.start[node[("COMM.fc2.weight.allreduce", 0)]] - first - 2000.0) < 1.0
    # UPDATE starts 4.5 ms before fc1's allreduce ends: it starts after BW.fc1, not after that allreduce
    assert abs(schedule.start[node[("UPDATE.optimizer", 0)]] - first - 4000.0) < 1.0
    assert abs(analyze_path(run.path).error_pct) < 1.0


def _one_stall(rank: int, step: int) -> list[dict]:
    """Steps of 7.7 ms but one (step 9), where both ranks stalled 40 ms in their forward."""
    events = _alternating_straggler(rank, step)
    if step == 9:
        for e in events:
            if e["name"] == "FW.fc1":
                e["dur"] += 40_000.0
            elif e["name"] != "STEP":
                e["ts"] += 40_000.0
            else:
                e["dur"] += 40_000.0
    return events


def test_a_step_far_outside_the_others_is_left_out_of_the_model_and_the_measured_step(tmp_path):
    root = make_run_of(tmp_path / "run", lambda rank, step: [
        {**e, "ts": e["ts"] + (40_000.0 if step > 9 else 0.0)} for e in _one_stall(rank, step)], steps=range(3, 15))
    run = load_run(root)
    assert far_out_steps(run, list(range(3, 15))) == {9: PERIOD_US + 40_000.0}
    model = step_model(run, align(run))
    assert 9 not in model.steps and model.left_out_steps == {9: PERIOD_US + 40_000.0}
    analysis = analyze_path(root)
    assert analysis.measured_step_ms == PERIOD_US / 1000.0 and abs(analysis.error_pct) < 1.0
    assert any("left out of the model and of the measured step: 9 (47.7 ms)" in n for n in analysis.notes)
    # fewer than 8 steps have no quartiles: a step over twice the others' median is far out, never half of them
    assert far_out_steps(run, list(range(5, 10))) == {9: PERIOD_US + 40_000.0}
    assert far_out_steps(run, [8, 9]) == {}


def test_a_stall_in_five_steps_is_left_out(tmp_path):
    """Five steps, one of them stalled (a profiler trace of a few steps): the prediction stays with the other four."""
    root = make_run_of(tmp_path / "run", _one_stall, steps=range(5, 10))
    analysis = analyze_path(root)
    assert analysis.measured_step_ms == PERIOD_US / 1000.0 and abs(analysis.error_pct) < 1.0
    assert any("9 (47.7 ms)" in n for n in analysis.notes)


def test_the_step_model_comes_with_its_measured_gaps_and_tails(tmp_path):
    """A what-if copies the step model and changes it: gaps and tails filled in on the changed copy would stretch
    its step back to the measured one, so the model holds them from the start."""
    run = load_run(make_run_of(tmp_path / "run", _tensorflow_like_step, steps=range(3, 9)))
    model = step_model(run, align(run))
    assert set(model.tail_us) == {0, 1}
    assert all(op.gap is not None for ops in model.ops.values() for op in ops)
