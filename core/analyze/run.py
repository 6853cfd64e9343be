"""The ``dpro analyze`` pipeline: load -> align -> graph -> replay -> what the user asks about.

One function per question, each over plain data:
``predicted_step_us`` (how long is a step), ``breakdown`` (where does the time go),
``critical_ops`` (what is on the critical path), ``stragglers`` (who makes the others wait).
``analyze_run`` runs them all on a run directory and returns an ``Analysis``.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpro.dag.align import Alignment, align
from dpro.dag.graph import Graph
from dpro.dag.step_model import StepModel, model_steps, wired_step_model
from dpro.dag.wiring import graph_of_wired
from dpro.engines import get_engine, load_prepared
from dpro.errors import GraphError
from dpro.io.load import Run, recording_cost
from dpro.io.pool import collector_paused
from dpro.sim.interference import fit_interference
from dpro.sim.replay import Schedule, critical_path, plan_levels, predicted_step_us, replay
from dpro.sim.steps import replay_recorded_run

__all__ = [
    "Analysis",
    "AnalyzedRun",
    "DEFAULT_ITERATIONS",
    "analyze_dir",
    "analyze_path",
    "analyze_run",
    "breakdown",
    "critical_ops",
    "error_pct",
    "overlap_length",
    "predicted_step_us",
    "stragglers",
    "time_by_category",
    "total_length",
    "union_intervals",
]


DEFAULT_ITERATIONS = 4


@dataclass
class Analysis:
    """What ``dpro analyze`` reports (times in ms)."""

    source: str
    measured_step_ms: float
    predicted_step_ms: float
    error_pct: float
    breakdown: dict[str, float]
    critical_path: list[dict[str, Any]]
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    alignment: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    graph_nodes: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def error_pct(predicted: float, measured: float) -> float:
    """Signed prediction error in percent of the measured value."""
    return 100.0 * (predicted - measured) / measured if measured else float("nan")


def union_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        elif e > s:
            merged.append((s, e))
    return merged


def total_length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _xfer_members(g: Graph) -> dict[int, list[int]]:
    """Transfer node -> ranks taking part (from its arrival predecessors)."""
    out: dict[int, list[int]] = {}
    for node, cat in enumerate(g.category):
        if cat == "XFER":
            out[node] = sorted({int(g.rank[p]) for p in g.preds(node) if g.category[p] == "COMM"})
    return out


def _nodes_by_rank(g: Graph, it: int, members: dict[int, list[int]]) -> dict[int, list[int]]:
    """The nodes of iterations ``it - 1`` and ``it`` each rank takes part in: its own, and the transfers it is a
    member of; one pass over the nodes, so a per-rank figure costs its own nodes, not the whole graph's."""
    out: dict[int, list[int]] = defaultdict(list)
    for node in np.flatnonzero((g.iteration == it) | (g.iteration == it - 1)).tolist():
        if g.category[node] == "XFER":
            for rank in members.get(node, ()):
                out[rank].append(node)
        else:
            out[int(g.rank[node])].append(node)
    return out


def breakdown(g: Graph, sched: Schedule) -> dict[int, dict[str, float]]:
    """Per rank, over the last replayed iteration: compute, communication, overlapped communication
    (communication hidden under compute) and idle time, in µs."""
    last = max(it for _, it in g.step_end)
    nodes_of = _nodes_by_rank(g, last, _xfer_members(g))
    out = {}
    for (rank, it), end_node in g.step_end.items():
        if it != last or (rank, it - 1) not in g.step_end:
            continue
        t0, t1 = sched.end[g.step_end[(rank, it - 1)]], sched.end[end_node]
        compute, comm = [], []
        for node in nodes_of.get(rank, ()):
            s, e = max(sched.start[node], t0), min(sched.end[node], t1)
            if e <= s:
                continue
            cat = g.category[node]
            if cat == "XFER":
                comm.append((s, e))
            elif cat == "COMM" and g.duration[node] > 0:
                comm.append((s, e))
            elif cat in ("FW", "BW", "UPDATE", "RECOMPUTE", "COMPUTE"):
                compute.append((s, e))
        cu, mu = union_intervals(compute), union_intervals(comm)
        overlap = overlap_length(cu, mu)
        busy = total_length(union_intervals(cu + mu))
        out[rank] = {"step": t1 - t0, "compute": total_length(cu), "communication": total_length(mu),
                     "overlapped_communication": overlap, "idle": max(0.0, (t1 - t0) - busy)}
    return out


# What a rank is doing at an instant, when several ops cover it: the first of these that does (a communication
# under compute is "overlapped", not "communication"); categories not listed count as compute.
CATEGORY_PRIORITY = ("FW", "BW", "RECOMPUTE", "COMPUTE", "UPDATE", "IO", "MEMCPY")
COMM_CATEGORIES = ("COMM", "XFER", "NCCL")


def time_by_category(g: Graph, sched: Schedule) -> dict[int, dict[str, float]]:
    """Per rank, over the last replayed iteration: each instant of the step charged to one category (µs).

    An instant covered by compute-like ops goes to the first of them in ``CATEGORY_PRIORITY`` (other categories
    count after those, by name); one covered only by communication (the rank's collectives and the transfers it
    takes part in) is ``communication``; one covered by nothing is ``idle``. The parts add up to the step.
    ``overlapped_communication`` (communication under another op) is reported beside them, not in the sum.
    Markers (STEP) and host-side bookkeeping without duration are not counted.
    """
    last = max(it for _, it in g.step_end)
    nodes_of = _nodes_by_rank(g, last, _xfer_members(g))
    out: dict[int, dict[str, float]] = {}
    for (rank, it), end_node in g.step_end.items():
        if it != last or (rank, it - 1) not in g.step_end:
            continue
        t0, t1 = float(sched.end[g.step_end[(rank, it - 1)]]), float(sched.end[end_node])
        spans: list[tuple[float, float, str]] = []
        for node in nodes_of.get(rank, ()):
            s, e = max(float(sched.start[node]), t0), min(float(sched.end[node]), t1)
            cat = g.category[node]
            if e <= s or cat == "STEP":
                continue
            spans.append((s, e, "communication" if cat in COMM_CATEGORIES else cat))
        out[rank] = _charge_instants(spans, t0, t1)
    return out


def _charge_instants(spans: list[tuple[float, float, str]], t0: float, t1: float) -> dict[str, float]:
    """Sweep over the span ends: each elementary piece goes to its highest-priority covering category."""
    def rank_of(cat: str) -> tuple[int, str]:
        if cat == "communication":
            return (len(CATEGORY_PRIORITY) + 1, cat)
        return (CATEGORY_PRIORITY.index(cat), cat) if cat in CATEGORY_PRIORITY else (len(CATEGORY_PRIORITY), cat)

    points = sorted({t0, t1, *(t for s, e, _ in spans for t in (s, e))})
    # covering counts per category, updated at each point (a difference array over the sorted points)
    index = {t: i for i, t in enumerate(points)}
    changes: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for s, e, cat in spans:
        changes[index[s]][cat] += 1
        changes[index[e]][cat] -= 1
    active: dict[str, int] = defaultdict(int)
    out: dict[str, float] = defaultdict(float)
    for i, (a, b) in enumerate(zip(points, points[1:], strict=False)):
        for cat, delta in changes.get(i, {}).items():
            active[cat] += delta
        covering = [cat for cat, n in active.items() if n > 0]
        if not covering:
            out["idle"] += b - a
            continue
        top = min(covering, key=rank_of)
        out[top] += b - a
        if top != "communication" and active.get("communication", 0) > 0:
            out["overlapped_communication"] += b - a
    return dict(out)


def critical_ops(g: Graph, sched: Schedule, top: int = 10) -> list[dict[str, Any]]:
    """The ops on the critical path of the last iteration, longest first, with their share of the step."""
    last = max(it for _, it in g.step_end)
    ends = [(sched.end[n], n) for (r, it), n in g.step_end.items() if it == last]
    path = critical_path(g, sched, max(ends)[1])
    in_last = [n for n in path if g.iteration[n] == last]
    span = max(sched.end[n] for n in in_last) - min(sched.start[n] - g.gap[n] for n in in_last)
    totals: dict[tuple[str, str], float] = defaultdict(float)
    for n in in_last:
        who = "all ranks" if g.rank[n] < 0 else f"rank {g.rank[n]}"
        if g.duration[n] > 0:
            totals[(g.names[n], who)] += float(g.duration[n])
        if g.gap[n] > 0:
            totals[(f"(gap before {g.names[n]})", who)] += float(g.gap[n])
    rows = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [{"op": op, "where": who, "ms": us / 1000.0, "share_pct": 100.0 * us / span if span else 0.0}
            for (op, who), us in rows]


def stragglers(model: StepModel) -> list[dict[str, Any]]:
    """Who arrives last at collectives, and how long the others wait for them (measured, per step).

    A rank waits for a collective from its own arrival to the last rank's arrival. Collectives in
    flight together (buckets, per-tensor requests fused into one buffer) make such
    intervals overlap; a rank waits through the overlap once. So, per step and waiting rank, the
    union of its waiting intervals (clipped to its step) is its waiting, and each instant of it is
    charged to the last arrival of the collective that holds it longest (the interval covering it
    that ends last). Rows, per rank (means over the profiled steps):

    - ``last_to_arrive``: collectives it was last at (all steps);
    - ``wait_caused_ms_per_step``: what the other ranks wait for it, per step and per other rank (for
      two ranks, exactly the other rank's waiting);
    - ``share_pct``: its share of all waiting;
    - ``waits_ms_per_step``: its own waiting, and ``waits_pct_of_step`` that as a share of its steps.

    No figure can exceed the step: a rank's waiting in a step is at most that step, and the sum over
    ranks of ``wait_caused_ms_per_step`` times (ranks - 1) equals the sum of ``waits_ms_per_step``.
    """
    if not model.arrivals:
        return []
    ranks = sorted({r for members in model.arrivals.values() for r in members})
    if len(ranks) < 2:
        return []
    last_count: dict[int, int] = defaultdict(int)
    intervals: dict[tuple[int, int], list[tuple[float, float, int]]] = defaultdict(list)  # (rank, step) -> waits
    for (_, step), members in model.arrivals.items():
        if len(members) < 2:
            continue
        late_rank, late = max(members.items(), key=lambda kv: kv[1])
        last_count[late_rank] += 1
        for rank, t in members.items():
            if rank != late_rank and late > t:
                intervals[(rank, step)].append((t, late, late_rank))
    caused: dict[int, float] = defaultdict(float)
    waits: dict[int, float] = defaultdict(float)
    for (rank, step), items in intervals.items():
        lo, hi = model.step_spans.get((rank, step), (float("-inf"), float("inf")))
        for who, us in _charge_waiting(items, lo, hi).items():
            caused[who] += us
            waits[rank] += us
    steps = max(1, len(model.steps))
    others = len(ranks) - 1
    total = sum(caused.values()) or 1.0
    stepped: dict[int, float] = defaultdict(float)
    for (rank, _), (lo, hi) in model.step_spans.items():
        stepped[rank] += hi - lo
    rows = [{"rank": r, "last_to_arrive": last_count[r],
             "wait_caused_ms_per_step": caused[r] / steps / others / 1000.0, "share_pct": 100.0 * caused[r] / total,
             "waits_ms_per_step": waits[r] / steps / 1000.0,
             "waits_pct_of_step": 100.0 * waits[r] / stepped[r] if stepped.get(r) else float("nan")}
            for r in ranks if last_count[r] or waits[r]]
    return sorted(rows, key=lambda row: (-row["wait_caused_ms_per_step"], row["rank"]))


def _charge_waiting(items: list[tuple[float, float, int]], lo: float, hi: float) -> dict[int, float]:
    """Length of the union of the waiting intervals ``(from, to, late rank)`` within ``[lo, hi]``, each
    piece charged to the late rank of the interval covering it that ends last."""
    cuts = sorted({min(max(t, lo), hi) for a, b, _ in items for t in (a, b)})
    out: dict[int, float] = defaultdict(float)
    for a, b in zip(cuts, cuts[1:], strict=False):
        covering = [(end, who) for start, end, who in items if start <= a and end >= b]
        if covering and b > a:
            out[max(covering)[1]] += b - a
    return dict(out)


@dataclass
class AnalyzedRun:
    """Everything ``analyze_run`` computed: the answers (``analysis``) and what they were computed from."""

    analysis: Analysis
    graph: Graph
    schedule: Schedule
    alignment: Alignment
    model: StepModel
    run: Run


def analyze_run(run: Run, iterations: int = DEFAULT_ITERATIONS, *, jobs: int | None = None) -> AnalyzedRun:
    """Align, build the DAG, replay it and measure the prediction error of one run directory (``jobs``: processes
    for the recorded steps' check, ``dpro.sim.steps.replay_recorded_run``)."""
    with collector_paused():
        return _analyzed(run, iterations, jobs)


def _analyzed(run: Run, iterations: int, jobs: int | None) -> AnalyzedRun:
    alignment = align(run)
    # the recorded steps' check first, while the process holds only the run: its workers and its graph of every
    # recorded step are the biggest things analysis makes, and the mean step's model need not be alive beside them
    try:
        as_recorded = _as_recorded_note(run, alignment, model_steps(run)[0], jobs)
    except GraphError:
        wired_step_model(run, alignment)  # the mean step's model fails first where it fails (as it ran first)
        raise
    model, wired = wired_step_model(run, alignment)
    g = graph_of_wired(model, wired, iterations)
    sched = replay(g, plan_levels(g))
    predicted = predicted_step_us(g, sched)
    pred, measured = statistics.median(predicted.values()), model.measured_step_us
    parts = breakdown(g, sched)
    keys = ("compute", "communication", "overlapped_communication", "idle")
    summary = {k: statistics.median(p[k] for p in parts.values()) / 1000.0 for k in keys}
    per_rank = [{"rank": r, "measured_step_ms": model.step_us_by_rank[r] / 1000.0,
                 "predicted_step_ms": predicted.get(r, float("nan")) / 1000.0,
                 **{k + "_ms": parts[r][k] / 1000.0 for k in keys}} for r in sorted(parts)]
    notes = _left_out_note(model) + [as_recorded] + _unrecorded_note(run, pred) + \
        [fit_interference(run, model.steps).describe()]
    analysis = Analysis(
        source=str(run.path), measured_step_ms=measured / 1000.0, predicted_step_ms=pred / 1000.0,
        error_pct=error_pct(pred, measured), breakdown=summary,
        critical_path=critical_ops(g, sched), stragglers=stragglers(model), per_rank=per_rank,
        alignment={"offset_us": {str(r): o for r, o in alignment.offset_us.items()},
                   "method": {str(r): m for r, m in alignment.method.items()}},
        notes=list(run.problems) + alignment.notes + _engine_notes(run) + notes, graph_nodes=g.size,
    )
    return AnalyzedRun(analysis, g, sched, alignment, model, run)


def _unrecorded_note(run: Run, predicted_us: float) -> list[str]:
    """What recording cost the step, when the window's gaps measured it (a window in blocks): the recorded steps
    are what this replay shows; what-if and optimize take the cost out of the model where it is beyond the gaps'
    noise (``sim.whatif.without_recording_cost``)."""
    cost = recording_cost(run)
    if cost is None:
        return []
    told = "" if cost.stderr_pct is None else f" +/- {cost.stderr_pct:.1f}% (standard error)" + \
        ("" if cost.beyond_noise or cost.pct <= 1.0 else ", so within chance")
    used = ("what-if and optimize price the job without it" if cost.beyond_noise
            else "what-if and optimize keep the recorded times")
    return [f"recorded steps ran {cost.pct:+.1f}%{told} against the unrecorded steps between the window's blocks "
            f"(median over ranks): the job unrecorded would take about "
            f"{predicted_us / (1.0 + cost.pct / 100.0) / 1000.0:.2f} ms a step where this replay says what it "
            f"recorded; {used}"]


def _as_recorded_note(run: Run, alignment: Alignment, steps: list[int], jobs: int | None) -> str:
    """How the recorded steps replay as they were, each with its own times: a check of the DAG's wiring."""
    recorded = replay_recorded_run(run, alignment, steps, jobs=jobs)
    replayed, measured = recorded.predicted_step_us, recorded.measured_step_us
    return (f"the recorded steps replayed as they were, each with its own times, take {replayed / 1000.0:.2f} ms "
            f"against their measured {measured / 1000.0:.2f} ms ({error_pct(replayed, measured):+.2f} %; means of "
            "the middle half): that checks the DAG's wiring (which op waits for which), not a prediction")


def _left_out_note(model: StepModel) -> list[str]:
    if not model.left_out_steps:
        return []
    listed = ", ".join(f"{step} ({us / 1000.0:.1f} ms)" for step, us in model.left_out_steps.items())
    return [f"steps far outside the others (beyond 3 interquartile ranges; with under 8 steps, over twice the "
            f"others' median), left out of the model and of the measured step: {listed}"]


def _engine_notes(run: Run) -> list[str]:
    return get_engine((run.meta or {}).get("engine")).notes(run)


def analyze_dir(path: str | Path, iterations: int = DEFAULT_ITERATIONS, *, jobs: int | None = None) -> AnalyzedRun:
    """Load a run directory (its engine's traces merged) and analyze it; ``jobs``: how many processes read and model
    it (``dpro.io.pool.jobs_wanted``). Writes nothing: ``dpro analyze`` writes ``analysis/replay.json`` from the
    result (``dpro.report.perfetto.write_analyzed_replay``)."""
    with collector_paused():
        return analyze_run(load_prepared(path, jobs=jobs), iterations, jobs=jobs)


def analyze_path(path: str | Path, iterations: int = DEFAULT_ITERATIONS, *, jobs: int | None = None) -> Analysis:
    """The answers of ``analyze_dir``: what ``dpro analyze`` prints."""
    return analyze_dir(path, iterations, jobs=jobs).analysis
