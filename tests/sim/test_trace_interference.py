"""Interference on profiler traces: fitted from runs of one operator inside one step, applied to trace what-ifs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpro.dag.graph import GraphBuilder
from dpro.io.kineto import KinetoTrace, StepWindow
from dpro.sim.interference import fit_trace_interference
from dpro.sim.kineto import interfered_graph
from dpro.sim.replay import replay

K = 0.25


def _kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"grid": [4, 1, 1], "block": [128, 1, 1], "stream": 7, "device": 0}}


def _gpu_trace(steps: int, step_scale: list[float]) -> KinetoTrace:
    """Each step: four runs of one GEMM (1 ms alone), the last two overlapped by an NCCL allreduce and so
    ``1 + K`` slower; step ``i`` runs all its kernels ``step_scale[i]`` times slower (a confound: a step slowed
    for another reason)."""
    windows, gpu = [], []
    for i in range(steps):
        t0, s = i * 100_000.0, step_scale[i]
        windows.append(StepWindow(i, t0, 90_000.0))
        at = t0 + 1000.0
        for k in range(4):
            dur = 1000.0 * s * (1.0 + K if k >= 2 else 1.0)
            gpu.append(_kernel("sm80_gemm", at, dur))
            at += dur + 10.0
        gpu.append(_kernel("ncclKernel_AllReduce_RING", t0 + 1000.0 + 2 * 1010.0 * s, 4000.0 * s))
    return KinetoTrace(path=Path("t.json"), rank=0, world_size=2, backend="nccl", base_time_ns=0, steps=windows,
                       main_tid=1, cpu_ops=[], annotations=[], runtime=[], gpu_ops=gpu, gpu_annotations=[])


def test_runs_of_one_kernel_inside_a_step_give_the_slowdown_whatever_slows_whole_steps():
    fitted = fit_trace_interference([_gpu_trace(6, [1.0, 1.0, 2.0, 1.0, 1.6, 1.0])])
    assert fitted.slowdown == pytest.approx(K / (1.0 + K / 2.0), rel=0.05)  # d / mean d - 1 against f - mean f
    assert fitted.applies and "inside one step" in fitted.describe()


def test_a_trace_without_such_runs_tells_nothing():
    trace = _gpu_trace(3, [1.0, 1.0, 1.0])
    trace.gpu_ops = [e for e in trace.gpu_ops if "nccl" in e["name"]]
    assert not fit_trace_interference([trace]).applies


def test_a_what_if_that_overlaps_more_slows_the_overlapped_compute():
    def graph(overlapped: bool):
        b = GraphBuilder()
        a = b.add("gemm", "KERNEL", 0, 0, "r0/gpu0/stream7", 1000.0)
        # the allreduce waits for the first GEMM (recorded) or starts with it (the what-if)
        comm = b.add("ncclKernel", "NCCL", 0, 0, "r0/gpu0/stream9", 800.0, preds=[] if overlapped else [a])
        b.add("gemm", "KERNEL", 0, 0, "r0/gpu0/stream7", 1000.0, preds=[comm] if not overlapped else [])
        return b.build()

    recorded, changed = graph(False), graph(True)
    slowed = interfered_graph(changed, recorded, 0.5)
    sched = replay(slowed)
    # the first GEMM now runs alongside the 800 µs allreduce for 0.8 (then 800 / 1000 x 1.x) of its time
    assert slowed.duration[0] > 1000.0 and slowed.duration[2] == pytest.approx(1000.0)
    assert sched.end[0] == pytest.approx(slowed.duration[0])
    assert interfered_graph(recorded, recorded, 0.5).duration.tolist() == recorded.duration.tolist()


def test_on_a_cpu_trace_the_innermost_host_operators_are_compared():
    """A CPU backend's collectives run on threads of their own; the host's innermost operators are the compute
    (a parent operator holds its children's time and overlap)."""
    windows, ops, comms = [], [], []
    for i in range(4):
        t0 = i * 100_000.0
        windows.append(StepWindow(i, t0, 90_000.0))
        at = t0 + 1000.0
        for k in range(4):
            dur = 1000.0 * (1.0 + K if k >= 2 else 1.0)
            ops.append({"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: MmBackward0",
                        "tid": 1, "ts": at - 5.0, "dur": dur + 10.0, "args": {}})
            ops.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": at, "dur": dur,
                        "args": {"Input Dims": [[64, 64], [64, 64]]}})
            at += dur + 20.0
        comms.append({"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "tid": 9,
                      "ts": t0 + 1000.0 + 2 * 1030.0, "dur": 4000.0, "args": {}})
    trace = KinetoTrace(path=Path("c.json"), rank=0, world_size=2, backend="gloo", base_time_ns=0, steps=windows,
                        main_tid=1, cpu_ops=ops, annotations=[], runtime=[], gpu_ops=[], gpu_annotations=[],
                        cpu_comms=comms)
    fitted = fit_trace_interference([trace])
    assert fitted.slowdown == pytest.approx(K / (1.0 + K / 2.0), rel=0.1) and fitted.applies
