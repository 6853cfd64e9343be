"""The tf-mwms engine on a small hand-built run: the gradients' all-reduce after the whole backward, then the
reductions of the step's outputs (loss), chained one after another as TensorFlow launches them."""

from __future__ import annotations

from pathlib import Path

from run_builder import make_mwms_run as _mwms_run

from dpro.dag.wiring import graph_from_steps
from dpro.io.load import load_run
from dpro.sim.replay import replay
from dpro.sim.whatif import context, predict, transformed_model

STEP_US = 9000.0


def test_regrouped_packs_start_after_the_whole_backward_and_output_reductions_stay(tmp_path: Path) -> None:
    ctx = context(load_run(_mwms_run(tmp_path / "run")))
    assert abs(predict(ctx, {}).predicted_step_ms - STEP_US / 1000.0) < 0.2
    g = graph_from_steps(transformed_model(ctx, {"tf.mwms.bytes_per_pack": 1000}), iterations=3)  # a pack each
    sched = replay(g)
    last = max(g.iteration)

    def node(name: str) -> int:
        return next(n for n in range(g.size) if g.names[n] == name and g.rank[n] == 0 and g.iteration[n] == last)

    # the first pack holds fc2's gradient, ready after BW.fc2, but MWMS launches it once BW.fc1 is done too
    assert sched.start[node("COMM.group0.allreduce")] >= sched.end[node("BW.fc1")]
    # the loss reduction is still there, with its measured transfer, after the gradients' packs
    loss = next(n for n in range(g.size) if g.names[n] == "COMM.loss.allreduce.transfer" and g.iteration[n] == last)
    assert abs((sched.end[loss] - sched.start[loss]) - 1500.0) < 100.0
    assert sched.start[loss] >= sched.end[next(n for n in range(g.size) if g.names[n] == "COMM.group1.allreduce"
                                               ".transfer" and g.iteration[n] == last)]
