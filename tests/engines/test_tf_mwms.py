"""The tf-mwms engine on a small hand-built run: the gradients' all-reduce after the whole backward, then the
reductions of the step's outputs (loss), chained one after another as TensorFlow launches them."""

from __future__ import annotations

import json
from pathlib import Path

from run_builder import make_run_of, write_json, x_event

from dpro.dag.wiring import graph_from_steps
from dpro.io.load import load_run
from dpro.sim.replay import replay
from dpro.sim.whatif import context, predict, transformed_model

STEP_US = 9000.0
GRADS = [("fc1.kernel", 400_000), ("fc2.kernel", 400_000)]  # model variable order


def _mwms_step(rank: int, step: int) -> list[dict]:
    t0 = 1_000_000.0 + step * 10_000 + rank * 50
    return [
        x_event("STEP", "STEP", t0, STEP_US, rank=rank, queue="host", step=step),
        x_event("FW.fc1", "FW", t0 + 100, 1000.0, rank=rank, queue="compute", step=step),
        x_event("FW.fc2", "FW", t0 + 1100, 1000.0, rank=rank, queue="compute", step=step),
        x_event("BW.fc2", "BW", t0 + 2100, 1000.0, rank=rank, queue="compute", step=step,
                grads=["fc2.kernel"], grads_ready_us=[t0 + 3100]),
        x_event("BW.fc1", "BW", t0 + 3100, 2000.0, rank=rank, queue="compute", step=step,
                grads=["fc1.kernel"], grads_ready_us=[t0 + 5100]),
        x_event("COMM.pack0.allreduce", "COMM", t0 + 5150, 2000.0, rank=rank, queue="comm", step=step,
                bytes=800_000, tensors=["fc2.kernel", "fc1.kernel"], op="allreduce", phase="allreduce"),
        x_event("UPDATE.optimizer", "UPDATE", t0 + 7200, 300.0, rank=rank, queue="compute", step=step),
        x_event("COMM.loss.allreduce", "COMM", t0 + 7200, 1500.0, rank=rank, queue="comm", step=step,
                bytes=4, tensors=[], op="allreduce", phase="allreduce"),
    ]


def _mwms_run(root: Path) -> Path:
    make_run_of(root, _mwms_step)
    meta = json.loads((root / "run.json").read_text())
    meta.update(framework="tf", engine="tf-mwms", knobs={"tf.mwms.bytes_per_pack": 0})
    write_json(root / "run.json", meta)
    model = json.loads((root / "model.json").read_text())
    model["gradients"] = [{"name": n, "bytes": b, "module": n.split(".")[0], "computed_by": n.split(".")[0],
                           "shape": [b // 4], "dtype": "float32"} for n, b in GRADS]
    model["buckets"] = [{"index": 0, "bytes": 800_000, "tensors": ["fc2.kernel", "fc1.kernel"]}]
    write_json(root / "model.json", model)
    return root


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
