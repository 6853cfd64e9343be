"""Predict the step time of PyTorch profiler (Kineto) traces by replaying their DAG (``dpro analyze FILE``), and
what-ifs on them (``dpro whatif FILE``).

Prediction: the replayed span of ``ProfilerStep#N`` (begin marker to the end of the step's last host op:
the definition of the measured step) and, beside it, the time until the step's last GPU op ends.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpro.analyze.run import Analysis, critical_ops, error_pct, overlap_length, total_length, union_intervals
from dpro.dag.graph import Graph
from dpro.dag.kineto import KinetoGraphInfo, graph_from_kineto
from dpro.errors import UsageError
from dpro.io.kineto import KinetoTrace, load_traces
from dpro.sim.interference import fit_trace_interference
from dpro.sim.kineto import (
    held_out_steps,
    host_step_us,
    interfered_graph,
    mean_step_graph,
    measured_step_ms,
    replayed_step_ms,
    used_iterations,
)
from dpro.sim.replay import Schedule, plan_levels, replay

__all__ = [
    "AnalyzedTraces",
    "TRACE_WHATIF_KNOBS",
    "analyze_kineto",
    "analyze_traces",
    "replay_traces",
    "split_prediction",
    "whatif_traces",
]

def _predicted(g: Graph, sched: Schedule, info: KinetoGraphInfo) -> tuple[dict, dict]:
    """Per (rank, iteration): the replayed host span of the step, and the time to its last GPU op's end."""
    host, device = {}, {}
    for key, begin in info.step_begin.items():
        t0 = sched.start[begin]
        host[key] = host_step_us(g, sched, info, key)
        if info.step_gpu.get(key):
            device[key] = float(sched.end[info.step_gpu[key]].max() - t0)
    return host, device


def _gpu_ends(info: KinetoGraphInfo, sched: Schedule) -> tuple[dict, dict]:
    """Per (rank, iteration): when the step's last GPU op ended, measured (µs, trace clock) and replayed."""
    measured, replayed = {}, {}
    for key, dev in info.measured_device_us.items():
        measured[key] = dev + info.step_ts[key]
        replayed[key] = float(sched.end[info.step_gpu[key]].max())
    return measured, replayed


def _median_ms(values: list[float]) -> float | None:
    return statistics.median(values) / 1000.0 if values else None


def _periods(ends: dict[tuple[int, int], float], rank: int, its: list[int], steps: list[int]) -> list[float]:
    """Time between the ends of consecutive steps' last GPU ops (the device's steady-state step)."""
    return [ends[(rank, i)] - ends[(rank, i - 1)] for i in its
            if i > 0 and steps[i] == steps[i - 1] + 1 and (rank, i) in ends and (rank, i - 1) in ends]


def _breakdown(sched: Schedule, info: KinetoGraphInfo, g: Graph, rank: int, it: int) -> dict[str, float]:
    """GPU time of one replayed step window (µs): compute, memcpy, communication (NCCL kernels, and collectives on a
    CPU backend's threads), its overlap with compute, idle."""
    t0, t1 = sched.start[info.step_begin[(rank, it)]], sched.end[g.step_end[(rank, it)]]
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s_node, e_node, kind in info.gpu_spans.get(rank, []):
        s, e = max(sched.start[s_node], t0), min(sched.end[e_node], t1)
        if e > s:
            spans[kind].append((float(s), float(e)))
    if not any(info.gpu_spans.values()):  # CPU-only: compute is the operators' time on the host threads
        spans["compute"] = [(float(max(sched.start[n], t0)), float(min(sched.end[n], t1)))
                            for n in info.host_spans.get(rank, [])]
    for n in info.cpu_comm_spans.get(rank, []):
        s, e = max(sched.start[n], t0), min(sched.end[n], t1)
        if e > s:
            spans["comm"].append((float(s), float(e)))
    comp, comm, mem = (union_intervals(spans[k]) for k in ("compute", "comm", "memcpy"))
    busy = union_intervals(comp + comm + mem)
    return {"compute": total_length(comp), "memcpy": total_length(mem), "communication": total_length(comm),
            "overlapped_communication": overlap_length(comm, comp), "idle": max(0.0, (t1 - t0) - total_length(busy))}


def _stragglers(info: KinetoGraphInfo, steps: int) -> list[dict[str, Any]]:
    """Who arrives last at collectives (the shortest kernel), and how long the others wait (per step)."""
    last: Counter = Counter()
    caused: dict[int, float] = defaultdict(float)
    for durs in info.collectives:
        late = min(durs, key=lambda r: durs[r])
        last[late] += 1
        caused[late] += sum(d - durs[late] for d in durs.values())
    total = sum(caused.values()) or 1.0
    rows = [{"rank": r, "last_to_arrive": last[r], "wait_caused_ms_per_step": caused[r] / max(steps, 1) / 1000.0,
             "share_pct": 100.0 * caused[r] / total} for r in last]
    return sorted(rows, key=lambda row: -row["wait_caused_ms_per_step"])


@dataclass
class AnalyzedTraces:
    """Everything ``replay_traces`` computed: the answers and the graph, schedule and step info behind them."""

    analysis: Analysis
    graph: Graph
    schedule: Schedule
    info: KinetoGraphInfo
    traces: list[KinetoTrace]


def analyze_traces(traces: list[KinetoTrace], steps: list[int] | None = None) -> Analysis:
    """Build the DAG of the traces, replay it, and compare the replayed step with ``ProfilerStep#N``."""
    return replay_traces(traces, steps).analysis


def replay_traces(traces: list[KinetoTrace], steps: list[int] | None = None) -> AnalyzedTraces:
    """``analyze_traces`` keeping what it was computed from (``dpro report`` draws the graph's schedule)."""
    g, info = graph_from_kineto(traces, steps)
    sched = replay(g, plan_levels(g))
    host, device = _predicted(g, sched, info)
    gpu_end_measured, gpu_end_replayed = _gpu_ends(info, sched)
    notes = list(info.notes)
    its = used_iterations(info, notes)
    keys = ("compute", "memcpy", "communication", "overlapped_communication", "idle")
    per_rank, parts_all = [], []
    for r in info.ranks:
        parts = [_breakdown(sched, info, g, r, i) for i in its]
        summary = {k: _median_ms([p[k] for p in parts]) for k in keys}
        parts_all.append(summary)
        per_rank.append({
            "rank": r, "file": info.files[r],
            "measured_step_ms": _median_ms([info.measured_host_us[(r, i)] for i in its]),
            "predicted_step_ms": _median_ms([host[(r, i)] for i in its]),
            "measured_device_end_ms": _median_ms([info.measured_device_us[(r, i)] for i in its
                                                   if (r, i) in info.measured_device_us]),
            "predicted_device_end_ms": _median_ms([device[(r, i)] for i in its if (r, i) in device]),
            "measured_device_period_ms": _median_ms(_periods(gpu_end_measured, r, its, info.steps)),
            "predicted_device_period_ms": _median_ms(_periods(gpu_end_replayed, r, its, info.steps)),
            "nccl_kernels": info.nccl_kernels.get(r, 0),
            **{f"{k}_ms": summary[k] for k in keys},
        })
    measured = statistics.median(row["measured_step_ms"] for row in per_rank)
    replayed = statistics.median(row["predicted_step_ms"] for row in per_rank)
    held_out = held_out_steps(g, info, its)
    if held_out:  # the prediction: each step from the other steps' op times (the exact replay checks the wiring)
        for row in per_rank:
            row["replayed_step_ms"] = row["predicted_step_ms"]
            row["predicted_step_ms"] = _median_ms([held_out[(row["rank"], i)] for i in its])
    predicted = statistics.median(row["predicted_step_ms"] for row in per_rank)
    notes += _summary_notes(traces, info, per_rank, its)
    notes.append(_prediction_note(held_out, replayed, measured))
    analysis = Analysis(
        source=", ".join(info.files[r] for r in info.ranks), measured_step_ms=measured, predicted_step_ms=predicted,
        error_pct=error_pct(predicted, measured),
        breakdown={k: statistics.median(p[k] for p in parts_all) for k in keys},
        critical_path=critical_ops(g, sched), stragglers=_stragglers(info, len(its)), per_rank=per_rank,
        notes=notes, graph_nodes=g.size)
    return AnalyzedTraces(analysis, g, sched, info, traces)


def split_prediction(traces: list[KinetoTrace]) -> tuple[float, float]:
    """The first half of the profiled steps predicts the second: (predicted, measured) median host step in ms over
    the second half's steps and ranks, each op at its mean duration and gap over the first half."""
    g, info = graph_from_kineto(traces)
    its = list(range(len(info.steps)))
    if len(its) < 2:
        raise UsageError("the traces hold one profiled step: nothing to predict it from")
    half = len(its) // 2
    fit, test = set(its[:half]), its[half:]
    predicted = held_out_steps(g, info, test, lambda k: fit)
    return (statistics.median(predicted.values()) / 1000.0,
            statistics.median(info.measured_host_us[(r, i)] for r in info.ranks for i in test) / 1000.0)


TRACE_WHATIF_KNOBS = ("bandwidth_scale", "world_size", "compute_scale")
COMM_NODES = ("NCCL", "XFER", "COMM")


def whatif_traces(traces: list[KinetoTrace], knobs: dict[str, Any]) -> dict[str, Any]:
    """``dpro whatif TRACE...``: the profiled steps with every op at its mean time over them (the baseline), and
    the same under ``knobs``: ``compute_scale`` multiplies the device's kernels (a CPU-only trace: the host
    operators), ``bandwidth_scale`` divides communication, ``world_size`` prices it for N ranks (a ring's
    2(N-1)/N of the bytes on each link). Other knobs need what a dpro recording has (gradients, modules).

    Raises:
        UsageError: a knob that profiler traces cannot support.
    """
    grouping = {k: v for k, v in knobs.items() if k not in TRACE_WHATIF_KNOBS}
    engine = _trace_engine(grouping)
    base, info, its = mean_step_graph(traces)
    recorded = max([t.world_size or 1 for t in traces] + [len(traces)])
    result: dict[str, Any] = {"knobs": dict(knobs), "recorded_world_size": recorded}
    changed, changed_info = base, info
    if grouping:
        changed, changed_info, regrouping = engine.trace_whatif(traces, info, base, grouping)
        result.update(regrouping)
    changed = _scaled(changed, knobs, recorded)
    interference = fit_trace_interference(traces)
    result["interference"] = interference.describe()
    if knobs and interference.applies:
        changed = interfered_graph(changed, base, interference.slowdown)
    result.update({"measured_step_ms": measured_step_ms(info, its),
                   "baseline_predicted_step_ms": replayed_step_ms(base, info, its),
                   "predicted_step_ms": replayed_step_ms(changed, changed_info, its)})
    return result


def _trace_engine(grouping: dict[str, Any]) -> Any:
    """The engine whose grouping knobs ``grouping`` sets and that regroups profiler traces (None: no grouping)."""
    if not grouping:
        return None
    from dpro.engines import REGISTRY, get_engine

    able = [get_engine(name) for name in REGISTRY if get_engine(name).trace_whatif is not None]
    for engine in able:
        if set(grouping) <= {*engine.comm_knobs, "tensor_groups"}:
            return engine
    knobs = sorted({k for e in able for k in e.comm_knobs} | {"tensor_groups"})
    raise UsageError(f"--set {next(iter(grouping))}: profiler traces carry no module tree, so on them dpro changes "
                     f"only {', '.join(TRACE_WHATIF_KNOBS)} and the grouping knobs {', '.join(knobs)}; record the job "
                     "with dpro (dpro-launch --profile) for the other knobs")


def _scaled(g: Graph, knobs: dict[str, Any], recorded_world: int) -> Graph:
    duration = g.duration.copy()
    category = np.array(g.category)
    comm = np.isin(category, COMM_NODES)
    world = int(knobs.get("world_size") or recorded_world)
    ring = ((world - 1) / world) / ((recorded_world - 1) / recorded_world) if recorded_world > 1 and world > 1 else 1.0
    duration[comm] *= ring / float(knobs.get("bandwidth_scale", 1.0))
    compute = category == "KERNEL" if (category == "KERNEL").any() else category == "CPU"
    duration[compute] *= float(knobs.get("compute_scale", 1.0))
    return dataclasses.replace(g, duration=duration)


def _prediction_note(held_out: dict, replayed_ms: float, measured_ms: float) -> str:
    exact = (f"each step replayed with its own measured durations and gaps gives {replayed_ms:.2f} ms "
             f"({error_pct(replayed_ms, measured_ms):+.2f} %): that checks the DAG's wiring")
    if not held_out:
        return f"one profiled step: the prediction is that step's own replay; {exact}"
    return ("predicted step = each profiled step replayed with every op's mean duration and gap over the other "
            f"steps (leave-one-step-out), median over steps and ranks; {exact}")


def _summary_notes(traces: list[KinetoTrace], info: KinetoGraphInfo, per_rank: list[dict], its: list[int]) -> list[str]:
    steps = [info.steps[i] for i in its]
    notes = [f"replayed ProfilerStep#{info.steps[0]}..#{info.steps[-1]}; times are medians over steps {steps}",
             "a step is the ProfilerStep#N span (begin to the end of the step's last host op), measured and "
             "replayed alike"]
    dev = _rank_median(per_rank, "predicted_device_end_ms"), _rank_median(per_rank, "measured_device_end_ms")
    if dev[0] is not None and dev[1] is not None:
        notes.append(f"device-end prediction (step start to its last GPU op's end): {dev[0]:.2f} ms "
                     f"(measured {dev[1]:.2f} ms, error {error_pct(*dev):+.2f} %)")
    period = _rank_median(per_rank, "predicted_device_period_ms"), _rank_median(per_rank, "measured_device_period_ms")
    if period[0] is not None and period[1] is not None:
        notes.append(f"device period (between consecutive steps' last GPU ops): {period[0]:.2f} ms "
                     f"(measured {period[1]:.2f} ms)")
    if dev[0] is None:
        notes.append("no GPU ops in the profiled steps (a CPU-only trace): host threads only; "
                     "compute = top-level CPU operator time")
    comms = sum(len(v) for v in info.cpu_comm_spans.values())
    if comms:
        names = sorted({n for t in traces for n in (str(e.get("name")) for e in t.cpu_comms)})
        notes.append(f"{comms} collectives on CPU backend threads ({', '.join(names[:4])}) are communication; "
                     "a host thread idle until one ends waits for it")
    world = max((t.world_size or 1) for t in traces)
    if world > len(traces):
        missing = sorted(set(range(world)) - set(info.ranks))
        notes.append(f"world size {world} but ranks {missing} are missing: NCCL kernels keep their measured "
                     "durations (which include waiting for the missing ranks)")
    if len(set(info.nccl_kernels.values())) > 1:
        notes.append(f"the ranks ran different numbers of NCCL kernels: {info.nccl_kernels}")
    return notes


def _rank_median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows if row[key] is not None]
    return statistics.median(values) if values else None


def analyze_kineto(paths: list[Path], steps: list[int] | None = None, *, jobs: int | None = None) -> Analysis:
    """``dpro analyze FILE...``: load one Kineto trace per rank (in ``jobs`` processes, ``load_traces``), replay,
    report (see ``analyze_traces``)."""
    return analyze_traces(load_traces(paths, jobs=jobs), steps)
