"""Stage 4, replay: simulate the DAG and predict when every op starts and ends.

Queue order is part of the graph (each op waits for the previous op on its queue), so the replay is
the earliest-start schedule of a DAG: ``start = max(end of predecessors) + gap``, ``end = start +
duration``. It runs level by level on numpy arrays (all nodes of one topological level at once), so
its cost grows linearly with the number of nodes and edges.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpro.dag.graph import Graph
from dpro.dag.levels import LevelPlan, plan_levels
from dpro.sim.links import replay_shared

__all__ = [
    "predicted_step_us",
    "LevelPlan",
    "Schedule",
    "critical_path",
    "plan_levels",
    "replay",
]



@dataclass
class Schedule:
    """Replayed start and end of every node (µs from the replay's time zero)."""

    start: np.ndarray
    end: np.ndarray
    # per node: how crowded the link it takes a share of was while it ran (``dpro.sim.links``); None without links
    crowding: np.ndarray | None = None


def replay(g: Graph, plan: LevelPlan | None = None) -> Schedule:
    """Earliest-start schedule of ``g`` (see module docstring); a graph whose transfers share links
    (``g.flows``) event by event (``dpro.sim.links.replay_shared``)."""
    if g.flows is not None and g.flows.size:
        start, end, crowding = replay_shared(g)
        return Schedule(start, end, crowding)
    plan = plan or plan_levels(g)
    start = np.zeros(g.size)
    end = np.zeros(g.size)
    for nodes, flat, seg, mask in zip(plan.nodes, plan.flat_preds, plan.seg_start, plan.has_preds, strict=True):
        ready = np.zeros(nodes.size)
        if flat.size:
            ready[mask] = np.maximum.reduceat(end[flat], seg)
        s = ready + g.gap[nodes]
        start[nodes] = s
        end[nodes] = s + g.duration[nodes]
    return Schedule(start, end)


def critical_path(g: Graph, sched: Schedule, last: int | None = None) -> list[int]:
    """Nodes on the longest chain ending at ``last`` (default: the node that ends last), first to last.

    At each step the binding predecessor is the one that ended last.
    """
    node = int(np.argmax(sched.end)) if last is None else last
    path = [node]
    while True:
        preds = g.preds(node)
        if preds.size == 0:
            break
        node = int(preds[np.argmax(sched.end[preds])])
        path.append(node)
    path.reverse()
    return path


def predicted_step_us(g: Graph, sched: Schedule) -> dict[int, float]:
    """Per rank: the replayed duration of the last iteration (steady state, after the first ones)."""
    last = max(it for _, it in g.step_end)
    out = {}
    for (rank, it), node in g.step_end.items():
        if it == last and (rank, it - 1) in g.step_end:
            out[rank] = float(sched.end[node] - sched.end[g.step_end[(rank, it - 1)]])
    return out
