"""Replaying the graph of profiler traces (``dpro.dag.kineto``): each op at its mean over the profiled steps (the
what-ifs' baseline), or over the other steps (a held-out prediction), and the replayed and measured ProfilerStep."""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from dpro.dag.graph import Graph
from dpro.dag.kineto import KinetoGraphInfo, graph_from_kineto
from dpro.io.kineto import KinetoTrace
from dpro.sim.interference import KINETO_COMM, KINETO_COMPUTE, node_overlap
from dpro.sim.replay import Schedule, plan_levels, replay

__all__ = [
    "WARMUP_FACTOR",
    "held_out_steps",
    "host_step_us",
    "interfered_graph",
    "mean_graph",
    "mean_step_graph",
    "measured_step_ms",
    "op_keys",
    "replayed_step_ms",
    "used_iterations",
]

WARMUP_FACTOR = 1.5


# ---- prediction ------------------------------------------------------------------------------------

def host_step_us(g: Graph, sched: Schedule, info: KinetoGraphInfo, key: tuple[int, int]) -> float:
    """The replayed ProfilerStep span of (rank, iteration): its begin marker's start to its end marker's end."""
    return float(sched.end[g.step_end[key]] - sched.start[info.step_begin[key]])


def used_iterations(info: KinetoGraphInfo, notes: list[str]) -> list[int]:
    """All iterations, less a first warm-up step longer than 1.5x the median of the others."""
    its = list(range(len(info.steps)))
    per_it = [statistics.median(info.measured_host_us[(r, i)] for r in info.ranks) for i in its]
    if len(its) >= 3 and per_it[0] > WARMUP_FACTOR * statistics.median(per_it[1:]):
        notes.append(f"warm-up step ProfilerStep#{info.steps[0]} ({per_it[0] / 1000:.2f} ms, more than "
                     f"{WARMUP_FACTOR}x the median of the others) is left out of measured and predicted times")
        return its[1:]
    return its


def op_keys(g: Graph) -> list[tuple[int, int, str, int]]:
    """Each node's op across steps: (rank, queue, name, occurrence of that name on that queue in its step). A CPU
    backend's collectives are told apart by their order in the step, not by their thread: the backend hands them
    to whichever of its threads is free."""
    seen: dict[tuple[int, int, str, int], int] = defaultdict(int)
    keys = []
    for node in range(g.size):
        queue = -2 if g.category[node] == "COMM" else int(g.queue[node])
        base = (int(g.rank[node]), queue, g.names[node], int(g.iteration[node]))
        keys.append((base[0], base[1], base[2], seen[base]))
        seen[base] += 1
    return keys


def mean_graph(g: Graph, keys: list[tuple[int, int, str, int]], fit: set[int]) -> Graph:
    """``g`` with every op's duration and gap the mean of that op over the iterations in ``fit`` (an op that none
    of them ran keeps its own). Means, not medians: a step is a sum of its ops, and the medians of skewed parts
    (a gloo allreduce that takes a few ms in one step and several times that in the next) add up to no step."""
    durations: dict[tuple, list[float]] = defaultdict(list)
    gaps: dict[tuple, list[float]] = defaultdict(list)
    for node in np.flatnonzero(np.isin(g.iteration, list(fit))):
        durations[keys[node]].append(float(g.duration[node]))
        gaps[keys[node]].append(float(g.gap[node]))
    duration, gap = g.duration.copy(), g.gap.copy()
    means = {k: (statistics.fmean(v), statistics.fmean(gaps[k])) for k, v in durations.items()}
    for node, key in enumerate(keys):
        if key in means:
            duration[node], gap[node] = means[key]
    return dataclasses.replace(g, duration=duration, gap=gap)


def held_out_steps(g: Graph, info: KinetoGraphInfo, its: list[int],
                   fit_of: Callable[[int], set[int]] | None = None) -> dict[tuple[int, int], float]:
    """Per (rank, iteration) in ``its``: the host step (µs) replayed with each op's mean duration and gap over
    ``fit_of(iteration)`` (default: the other iterations, leave-one-step-out). Empty with fewer than 2 steps."""
    if len(its) < 2:
        return {}
    fit_of = fit_of or (lambda k: set(its) - {k})
    keys, plan = op_keys(g), plan_levels(g)
    out: dict[tuple[int, int], float] = {}
    for k in its:
        sched = replay(mean_graph(g, keys, fit_of(k)), plan)
        for r in info.ranks:
            out[(r, k)] = host_step_us(g, sched, info, (r, k))
    return out


def mean_step_graph(traces: list[KinetoTrace]) -> tuple[Graph, KinetoGraphInfo, list[int]]:
    """The traces' graph with every op at its mean over the profiled steps (what-if's baseline), its info and the
    iterations used (a long warm-up step left out)."""
    g, info = graph_from_kineto(traces)
    its = used_iterations(info, [])
    return mean_graph(g, op_keys(g), set(its)), info, its


def replayed_step_ms(g: Graph, info: KinetoGraphInfo, its: list[int]) -> float:
    """The median host step (ms) over the ranks and iterations ``its`` of ``g`` replayed."""
    sched = replay(g)
    return statistics.median(host_step_us(g, sched, info, (r, i)) for r in info.ranks for i in its) / 1000.0


def measured_step_ms(info: KinetoGraphInfo, its: list[int]) -> float:
    """The median measured ProfilerStep (ms) over the ranks and iterations ``its``."""
    return statistics.median(info.measured_host_us[(r, i)] for r in info.ranks for i in its) / 1000.0


INTERFERENCE_ROUNDS = 3  # replays that let the scaled durations and the overlap they cause settle


def interfered_graph(changed: Graph, recorded: Graph, slowdown: float) -> Graph:
    """``changed`` (a what-if of the traces' ``recorded`` graph) with each compute op slower by ``slowdown`` times
    how much more of it overlaps communication than in the recorded graph (faster where less): the recorded
    durations already hold the recorded overlap's slowdown (``dpro.sim.interference``). Ops are matched by
    ``op_keys``, their recorded overlap averaged over the steps."""
    seen: dict[tuple, list[float]] = defaultdict(list)
    overlap = node_overlap(recorded, replay(recorded), KINETO_COMPUTE, KINETO_COMM)
    for node, key in enumerate(op_keys(recorded)):
        if recorded.category[node] in KINETO_COMPUTE:
            seen[key].append(float(overlap[node]))
    before = {key: statistics.fmean(v) for key, v in seen.items()}
    keys, plan, base = op_keys(changed), plan_levels(changed), changed.duration.copy()
    out = changed
    for _ in range(INTERFERENCE_ROUNDS):
        now = node_overlap(out, replay(out, plan), KINETO_COMPUTE, KINETO_COMM)
        duration = base.copy()
        for node, key in enumerate(keys):
            if key in before:
                duration[node] = base[node] * (1.0 + slowdown * now[node]) / (1.0 + slowdown * before[key])
        out = dataclasses.replace(changed, duration=duration)
    return out
