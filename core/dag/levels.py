"""A graph cut into topological levels (Kahn's algorithm, a whole frontier at a time): the order the replay
(``dpro.sim.replay``) runs the nodes in, and the check that a graph has no cycle."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpro.dag.graph import Graph
from dpro.errors import GraphError

__all__ = ["LevelPlan", "gather_ranges", "plan_levels"]


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
        plan.flat_preds.append(gather_ranges(g.pred_ptr, g.pred_idx, with_preds))
        seg = np.zeros(with_preds.size, dtype=np.int64)
        if with_preds.size:
            np.cumsum(counts[with_preds][:-1], out=seg[1:])
        plan.seg_start.append(seg)
        succ = gather_ranges(succ_ptr, succ_idx, frontier)
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


def gather_ranges(ptr: np.ndarray, idx: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Concatenate idx[ptr[r]:ptr[r+1]] for r in rows, without a Python loop."""
    starts = ptr[rows]
    lengths = ptr[rows + 1] - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=idx.dtype)
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return idx[np.arange(total) + offsets]
