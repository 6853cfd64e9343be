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
from dpro.errors import GraphError

__all__ = [
    "predicted_step_us",
    "LevelPlan",
    "Schedule",
    "critical_path",
    "plan_levels",
    "replay",
]



@dataclass
class LevelPlan:
    """The graph cut into topological levels, with each level's predecessors laid out flat."""

    nodes: list[np.ndarray]         # node ids per level
    flat_preds: list[np.ndarray]    # predecessors of the level's nodes that have any, concatenated
    seg_start: list[np.ndarray]     # reduceat offsets into flat_preds, one per node with predecessors
    has_preds: list[np.ndarray]     # bool mask over the level's nodes


def plan_levels(g: Graph) -> LevelPlan:
    """Kahn's algorithm, one whole frontier at a time.

    Raises:
        GraphError: the graph has a cycle (names one node on it).
    """
    n = g.size
    counts = np.diff(g.pred_ptr)
    indegree = counts.copy()
    # successors in CSR form, from the predecessor CSR
    src = g.pred_idx
    dst = np.repeat(np.arange(n, dtype=np.int64), counts)
    order = np.argsort(src, kind="stable")
    succ_idx = dst[order]
    succ_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=succ_ptr[1:])
    plan = LevelPlan([], [], [], [])
    frontier = np.flatnonzero(indegree == 0)
    seen = 0
    while frontier.size:
        seen += frontier.size
        plan.nodes.append(frontier)
        c = counts[frontier]
        mask = c > 0
        plan.has_preds.append(mask)
        with_preds = frontier[mask]
        plan.flat_preds.append(_gather_ranges(g.pred_ptr, g.pred_idx, with_preds))
        seg = np.zeros(with_preds.size, dtype=np.int64)
        if with_preds.size:
            np.cumsum(counts[with_preds][:-1], out=seg[1:])
        plan.seg_start.append(seg)
        succ = _gather_ranges(succ_ptr, succ_idx, frontier)
        if succ.size:
            np.subtract.at(indegree, succ, 1)
            cand = np.unique(succ)
            frontier = cand[indegree[cand] == 0]
        else:
            frontier = succ
    if seen != n:
        stuck = int(np.flatnonzero(indegree > 0)[0])
        raise GraphError(f"the graph has a cycle through node {stuck} ({g.names[stuck]})")
    return plan


def _gather_ranges(ptr: np.ndarray, idx: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Concatenate idx[ptr[r]:ptr[r+1]] for r in rows, without a Python loop."""
    starts = ptr[rows]
    lengths = ptr[rows + 1] - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=idx.dtype)
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return idx[np.arange(total) + offsets]


@dataclass
class Schedule:
    """Replayed start and end of every node (µs from the replay's time zero)."""

    start: np.ndarray
    end: np.ndarray


def replay(g: Graph, plan: LevelPlan | None = None) -> Schedule:
    """Earliest-start schedule of ``g`` (see module docstring); a graph whose transfers share links
    (``g.flows``) event by event (``dpro.sim.links.replay_shared``)."""
    if g.flows is not None and g.flows.size:
        from dpro.sim.links import replay_shared

        return Schedule(*replay_shared(g))
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
