"""dag.graph on small hand-built runs: what the step model keeps and how the DAG is wired."""

from __future__ import annotations

from pathlib import Path

from run_builder import make_run_of, x_event

from dpro.analyze import analyze_run
from dpro.io.load import load_run

STEP_US = 9000.0


def _early_ready_events(rank: int, step: int) -> list[dict]:
    """BW.fc2 computes its weight gradient in its first 800 µs, then its input's gradient for 1200 µs; DDP
    launches the bucket of fc2's gradients as soon as they are ready, during BW.fc2."""
    t0 = 1_000_000.0 + step * 10_000 + rank * 50
    ev = [
        x_event("STEP", "STEP", t0, STEP_US, rank=rank, queue="host", step=step),
        x_event("IO.batch", "IO", t0, 100.0, rank=rank, queue="host", step=step),
        x_event("FW.fc1", "FW", t0 + 100, 1000.0, rank=rank, queue="compute", step=step, bytes=2048),
        x_event("FW.fc2", "FW", t0 + 1100, 1000.0, rank=rank, queue="compute", step=step, bytes=1024),
        x_event("BW.fc2", "BW", t0 + 2100, 2000.0, rank=rank, queue="compute", step=step,
                grads=["fc2.weight", "fc2.bias"], grads_ready_us=[t0 + 2900, t0 + 2850]),
        x_event("COMM.bucket0.allreduce", "COMM", t0 + 2910, 3000.0, rank=rank, queue="comm", step=step,
                bytes=4096, tensors=["fc2.weight", "fc2.bias"], op="allreduce", phase="allreduce"),
        x_event("BW.fc1", "BW", t0 + 4100, 2000.0, rank=rank, queue="compute", step=step,
                grads=["fc1.weight", "fc1.bias"], grads_ready_us=[t0 + 6100, t0 + 6100]),
        x_event("COMM.bucket1.allreduce", "COMM", t0 + 6110, 1500.0, rank=rank, queue="comm", step=step,
                bytes=8192, tensors=["fc1.weight", "fc1.bias"], op="allreduce", phase="allreduce"),
        x_event("UPDATE.sgd", "UPDATE", t0 + 7700, 500.0, rank=rank, queue="compute", step=step),
    ]
    return ev


def _run_with(events_of, root: Path) -> Path:
    return make_run_of(root, events_of)


def test_a_collective_starts_when_its_gradients_are_ready_not_when_their_op_ends(tmp_path: Path) -> None:
    result = analyze_run(load_run(_run_with(_early_ready_events, tmp_path / "run")))
    g, sched = result.graph, result.schedule
    assert "BW.fc2.rest" in g.names  # the op is split where its gradients are ready
    last = max(g.iteration)
    arrival = next(n for n in range(g.size) if g.names[n] == "COMM.bucket0.allreduce" and g.rank[n] == 0
                   and g.iteration[n] == last)
    bw = next(n for n in range(g.size) if g.names[n] == "BW.fc2" and g.rank[n] == 0 and g.iteration[n] == last)
    assert sched.start[arrival] < sched.start[bw] + 1000.0  # launched ~800 µs into BW.fc2, not after its 2000
    assert abs(result.analysis.error_pct) < 2.0


def test_concurrent_collectives_replay_to_the_measured_step(tmp_path: Path) -> None:
    """gloo runs a rank's allreduces concurrently: the second bucket ends before the first. The step still
    replays to its measured length (transfers calibrated from end times within the step)."""

    def concurrent(rank: int, step: int) -> list[dict]:
        ev = _early_ready_events(rank, step)
        t0 = 1_000_000.0 + step * 10_000 + rank * 50
        for e in ev:
            if e["name"] == "COMM.bucket0.allreduce":
                e["dur"] = 4500.0          # ends at t0 + 7410
            if e["name"] == "COMM.bucket1.allreduce":
                e["dur"] = 1000.0          # ends at t0 + 7110, before bucket0
            if e["name"] == "UPDATE.sgd":
                e["ts"] = t0 + 7500.0
        return ev

    a = analyze_run(load_run(_run_with(concurrent, tmp_path / "run"))).analysis
    assert abs(a.error_pct) < 2.0, a.error_pct


def test_each_gradient_of_a_backward_op_launches_its_collective_when_it_is_ready(tmp_path: Path) -> None:
    """A recurrent layer's gradients are ready at different moments of its backward (per-tensor collectives, as
    Horovod launches them): each collective starts after the part of the op that made its gradient."""

    def staggered(rank: int, step: int) -> list[dict]:
        t0 = 1_000_000.0 + step * 10_000 + rank * 50
        return [
            x_event("STEP", "STEP", t0, STEP_US, rank=rank, queue="host", step=step),
            x_event("FW.rnn", "FW", t0, 1000.0, rank=rank, queue="compute", step=step, bytes=2048),
            x_event("BW.rnn", "BW", t0 + 1000, 4000.0, rank=rank, queue="compute", step=step,
                    grads=["rnn.a", "rnn.b"], grads_ready_us=[t0 + 2000, t0 + 4000]),
            x_event("COMM.rnn.a.allreduce", "COMM", t0 + 2010, 1000.0, rank=rank, queue="comm", step=step,
                    bytes=4096, tensors=["rnn.a"], op="allreduce", phase="allreduce"),
            x_event("COMM.rnn.b.allreduce", "COMM", t0 + 4010, 1000.0, rank=rank, queue="comm", step=step,
                    bytes=4096, tensors=["rnn.b"], op="allreduce", phase="allreduce"),
            x_event("UPDATE.sgd", "UPDATE", t0 + 5100, 500.0, rank=rank, queue="compute", step=step),
        ]

    result = analyze_run(load_run(_run_with(staggered, tmp_path / "run")))
    g, sched = result.graph, result.schedule
    last = max(g.iteration)

    def start(name: str) -> float:
        node = next(n for n in range(g.size) if g.names[n] == name and g.rank[n] == 0 and g.iteration[n] == last)
        return float(sched.start[node])

    assert g.names.count("BW.rnn.rest") == 2 * 2 * (last + 1)  # split twice, on 2 ranks, in every iteration
    assert start("COMM.rnn.b.allreduce") - start("COMM.rnn.a.allreduce") > 1500.0  # ~2 ms apart, as recorded
    assert abs(result.analysis.error_pct) < 2.0


def test_an_op_in_few_steps_is_left_out_of_the_median_step(tmp_path: Path) -> None:
    """A source whose ops split differently from step to step (one step in five has a second UPDATE event): the
    rare event is no node of the median step, and the step still replays to its measured length."""

    def split_update(rank: int, step: int) -> list[dict]:
        ev = _early_ready_events(rank, step)
        if step == 5:
            t0 = 1_000_000.0 + step * 10_000 + rank * 50
            update = next(e for e in ev if e["name"] == "UPDATE.sgd")
            update["dur"] = 250.0
            ev.append(x_event("UPDATE.sgd", "UPDATE", t0 + 7950, 250.0, rank=rank, queue="compute", step=step))
        return ev

    result = analyze_run(load_run(_run_with(split_update, tmp_path / "run")))
    assert "UPDATE.sgd#2" not in result.graph.names
    assert abs(result.analysis.error_pct) < 2.0, result.analysis.error_pct


def test_overlapping_means_on_a_queue_add_no_gap(tmp_path: Path) -> None:
    """FW.fc1 and FW.fc2 run in either order from step to step (an executor that picks among ready ops): in the
    mean step FW.fc2 (starts 740, ends 840) lies inside FW.fc1 (160 to 1220). The op after them measures its
    gap from the later end, so the overlap is not counted twice."""
    fc1 = {3: (100, 1000), 4: (100, 1000), 5: (200, 1100), 6: (200, 1100), 7: (200, 1100)}   # start, duration
    fc2 = {3: 1100, 4: 1100, 5: 100, 6: 100, 7: 1300}                                           # start (100 µs)

    def swapping(rank: int, step: int) -> list[dict]:
        ev = _early_ready_events(rank, step)
        t0 = 1_000_000.0 + step * 10_000 + rank * 50
        for e in ev:
            if e["name"] == "FW.fc1":
                e["ts"], e["dur"] = t0 + fc1[step][0], float(fc1[step][1])
            if e["name"] == "FW.fc2":
                e["ts"], e["dur"] = t0 + fc2[step], 100.0
        return ev

    result = analyze_run(load_run(_run_with(swapping, tmp_path / "run")))
    g = result.graph
    bw = next(n for n in range(g.size) if g.names[n] == "BW.fc2" and g.rank[n] == 0)
    assert abs(g.gap[bw] - 880.0) < 1.0, g.gap[bw]  # 2100 - 1220 (FW.fc1's end), not 2100 - 840 (FW.fc2's)


def test_the_update_does_not_wait_for_a_reduction_of_the_step_outputs(tmp_path: Path) -> None:
    """A loss all-reduce (a COMM with no tensors) launched after the gradients' collective and in flight while the
    optimizer runs: the update waits for the gradients' collective only."""

    def with_loss_reduce(rank: int, step: int) -> list[dict]:
        ev = _early_ready_events(rank, step)
        t0 = 1_000_000.0 + step * 10_000 + rank * 50
        ev.append(x_event("COMM.loss.allreduce", "COMM", t0 + 7650, 1300.0, rank=rank, queue="comm", step=step,
                          bytes=4, tensors=[], op="allreduce", phase="allreduce"))
        return ev

    result = analyze_run(load_run(_run_with(with_loss_reduce, tmp_path / "run")))
    g = result.graph
    update = next(n for n in range(g.size) if g.names[n] == "UPDATE.sgd" and g.rank[n] == 0)
    preds = {g.names[p] for p in g.preds(update)}
    assert not any(p.startswith("COMM.loss") for p in preds), preds
    assert abs(result.analysis.error_pct) < 2.0, result.analysis.error_pct


def test_steps_that_hold_only_their_step_markers_are_refused_naming_the_run(tmp_path: Path) -> None:
    import pytest

    from dpro.errors import GraphError

    root = make_run_of(tmp_path / "run", lambda rank, step: [
        x_event("STEP", "STEP", 1_000_000.0 + step * 10_000, 9000.0, rank=rank, queue="host", step=step)])
    with pytest.raises(GraphError, match=r"hold no operation besides their STEP markers") as err:
        analyze_run(load_run(root))
    assert str(root) in str(err.value)
