"""Interference: compute that overlaps communication runs slower.

On a CPU job the threads that drive a collective (the communication library's, a background loop's) take cores from the
backward pass; on a GPU, NCCL kernels take SMs and memory bandwidth from the compute kernels. A model that prices
overlap as free predicts too much from every change that overlaps more (smaller buckets, more buffers).

An op's duration is modelled as ``d0 * (1 + k * f)``, ``f`` the fraction of it that overlapped communication on its
rank. ``k`` is measured by the recorder's interference probe (``interference_probe`` in run.json: a fixed kernel
timed alone and while an allreduce is in flight, after the window): a controlled experiment. Without a probe, the
steps' own ``k`` is shown but not applied: regressing each op's relative duration on its overlap, step to step,
reads cause and effect both ways (a step slowed for another reason also overlaps more), so it can read many times
what the probe does.

A what-if applies it relative to the recorded configuration (whose durations already hold the recorded
slowdown): each compute node's duration is scaled by ``(1 + k * f_new) / (1 + k * f_recorded)``, ``f`` read from
the replay of each, a few times over (the scaled durations move the overlap).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from dpro.io.kineto import is_nccl
from dpro.record.trace import CATEGORIES

if TYPE_CHECKING:  # types only: this module reads traces and replays, it builds neither
    from dpro.dag.graph import Graph
    from dpro.io.kineto import KinetoTrace
    from dpro.io.load import RankTrace, Run
    from dpro.sim.replay import Schedule

__all__ = ["COMPUTE_CATEGORIES", "KINETO_COMM", "KINETO_COMPUTE", "Interference", "TransferSlowdown",
           "fit_interference", "fit_trace_interference", "node_overlap", "op_overlap", "scale_for_overlap",
           "stretch_transfers"]

COMPUTE_CATEGORIES = frozenset({"FW", "BW", "UPDATE", "RECOMPUTE"})
TRACE_COMM = frozenset({"COMM"})
GRAPH_COMM = frozenset({"COMM", "XFER"})
KINETO_COMPUTE = frozenset({"CPU", "KERNEL"})         # a profiler trace's graph (dpro.dag.kineto): its compute ...
KINETO_COMM = frozenset({"COMM", "NCCL", "XFER"})     # ... and its collectives
TRACE_COMM_PREFIXES = ("gloo:", "mpi:", "ucc:", "nccl:", "c10d::", "record_param_comms")
MIN_STEPS = 4           # steps an op needs to take part in the fit
SIGNIFICANCE = 2.0      # the fitted slowdown is applied when it is this many standard errors above zero
MAX_SLOWDOWN = 3.0      # a fit beyond this (compute 4x slower when fully overlapped) is not believed
MAX_TRANSFER_SLOWDOWN = 20.0  # a transfer probe beyond this (21x as long under compute) is not believed


@dataclass(frozen=True)
class TransferSlowdown:
    """How much longer a collective's transfer takes while its ranks compute (the recorder's transfer probe): one
    that starts under compute first waits ``stall_us`` of it (the threads that drive it wait for a core), then moves
    at ``1 / (1 + slowdown)`` of its pace alone while compute runs, and at full pace while none does."""

    stall_us: float
    slowdown: float
    stall_stderr: float
    stderr: float
    excess_us: float  # what compute added to the probe's smaller allreduce (the evidence there is any of this)
    excess_stderr: float

    @property
    def applies(self) -> bool:
        """Whether what-ifs use it: compute lengthened the probe's allreduce at all, and the fit is believable.
        The fit is used as measured even within its noise (``clear`` says whether it is beyond): on a busy host the
        probe reads a real stretch within twice its error on about a third of recordings, and pricing those
        transfers as free made the cross-check's worst what-ifs; the search weighs a change at both ends of what
        the probe cannot rule out (``plausible``)."""
        return self.excess_us > 0.0 and 0.0 <= self.slowdown <= MAX_TRANSFER_SLOWDOWN and self.stall_us >= 0.0

    @property
    def clear(self) -> bool:
        """Whether compute lengthened the probe's allreduce beyond twice that excess's error."""
        return self.excess_us > SIGNIFICANCE * self.excess_stderr

    def end(self, start: float, work: float, busy: list[tuple[float, float]], *, wakes: bool = True) -> float:
        """When a transfer that takes ``work`` µs alone ends, started at ``start`` beside the compute ``busy``
        (sorted, disjoint intervals). ``wakes``: the thread that drives it wakes for it (it waits for a core);
        False where it runs on from the transfer before it (a loop that runs several buffers per wake-up)."""
        t, left, pace = start, work, 1.0 + self.slowdown
        stall = self.stall_us if wakes else 0.0
        for a, b in busy:
            if b <= t:
                continue
            if a > t:  # no compute: full pace, and a stall no longer applies
                stall = 0.0
                if left <= a - t:
                    return t + left
                left -= a - t
                t = a
            waited = min(stall, b - t)
            t, stall = t + waited, stall - waited
            if t >= b:
                continue
            if left * pace <= b - t:
                return t + left * pace
            left -= (b - t) / pace
            t = b
        return t + left

    def plausible(self) -> tuple[TransferSlowdown, TransferSlowdown]:
        """The stretch the probe cannot rule out, as its ends (stall and slowdown ``SIGNIFICANCE`` standard errors
        below and above the fit, at least 0), each taken as exact."""
        def end(sign: float) -> TransferSlowdown:
            return replace(self, stall_us=max(0.0, self.stall_us + sign * SIGNIFICANCE * self.stall_stderr),
                           slowdown=min(MAX_TRANSFER_SLOWDOWN, max(0.0, self.slowdown + sign * SIGNIFICANCE
                                                                   * self.stderr)),
                           stall_stderr=0.0, stderr=0.0, excess_stderr=0.0)

        return end(-1.0), end(1.0)

    def describe(self) -> str:
        verdict = ("not applied (no stretch measured, or beyond belief)" if not self.applies else
                   "applied in what-ifs" if self.clear else
                   "applied in what-ifs as measured, within twice its error (the search weighs both ends)")
        return (f"a transfer under compute waits {self.stall_us / 1000.0:.1f} ms +/- {self.stall_stderr / 1000.0:.1f} "
                f"ms, then takes {1.0 + self.slowdown:.1f}x +/- {self.stderr:.1f} as long as alone (the recorder's "
                f"transfer probe: +{self.excess_us / 1000.0:.1f} ms +/- {self.excess_stderr / 1000.0:.1f} ms on its "
                f"smaller allreduce); {verdict}")


@dataclass(frozen=True)
class Interference:
    """How much slower compute runs while communication overlaps it (``slowdown``: ``k`` of ``d0 * (1 + k f)``)."""

    slowdown: float
    stderr: float
    ops: int                # ops (rank, name) whose overlap varied enough to take part
    samples: int
    source: str
    # measured by a controlled comparison (the recorder's probe, or runs of one op compared inside one step), not
    # read off whole steps
    probed: bool = False
    transfer: TransferSlowdown | None = None  # the other side: transfers slowed by the compute beside them

    @property
    def applies(self) -> bool:
        """Whether what-ifs use it: measured by a controlled comparison, significantly above zero and believable.
        The steps' fit is shown, never applied: a step slowed for another reason also overlaps more (its allreduce
        waits longer), so duration and overlap correlate without the one causing the other."""
        return self.probed and 0.0 < self.slowdown <= MAX_SLOWDOWN and self.slowdown > SIGNIFICANCE * self.stderr

    def plausible(self) -> tuple[float, ...]:
        """The slowdowns the measurement cannot rule out, as its ends (``SIGNIFICANCE`` standard errors either side
        of the fit, within 0 and ``MAX_SLOWDOWN``): where a change moves overlap, its gain must hold at both. Empty
        where nothing was measured by a controlled comparison."""
        if not self.probed or self.ops == 0 or not math.isfinite(self.stderr) or not math.isfinite(self.slowdown):
            return ()
        centre = max(self.slowdown, 0.0)
        return (max(0.0, centre - SIGNIFICANCE * self.stderr), min(MAX_SLOWDOWN, centre + SIGNIFICANCE * self.stderr))

    def at(self, slowdown: float) -> Interference:
        """This measurement taken as exactly ``slowdown`` (applied when above zero)."""
        return replace(self, slowdown=slowdown, stderr=0.0)

    def ends(self) -> tuple[Interference, ...]:
        """The interference the probes cannot rule out, as two ends taken as exact: both sides at their low end,
        then both at their high end (one contention slows compute and transfers alike). Empty where neither side
        was measured by a probe."""
        compute = self.plausible()
        transfer = self.transfer.plausible() if self.transfer is not None else ()
        if not compute and not transfer:
            return ()
        out = []
        for k in range(2):
            end = self.at(compute[k]) if compute else self
            out.append(replace(end, transfer=transfer[k]) if transfer else end)
        return tuple(out)

    def describe(self) -> str:
        if self.ops == 0:
            text = f"interference not measurable: {self.source}"
            return text if self.transfer is None else f"{text}; {self.transfer.describe()}"
        verdict = "applied in what-ifs" if self.applies else (
            "not applied (within its uncertainty)" if self.probed else "shown, not applied (no probe: read off the "
            "steps, where overlap and slowness go together either way)")
        text = (f"compute overlapped by communication runs {100.0 * self.slowdown:+.0f}% +/- "
                f"{100.0 * self.stderr:.0f}% slower when fully overlapped ({self.source}; {self.samples} samples); "
                f"{verdict}")
        return text if self.transfer is None else f"{text}; {self.transfer.describe()}"

    @property
    def stretches_transfers(self) -> bool:
        """Whether what-ifs slow the transfers they price beside compute (``TransferSlowdown``)."""
        return self.transfer is not None and self.transfer.applies


NONE = Interference(0.0, math.inf, 0, 0, "no recorded op overlapped communication by different amounts in "
                                           "different steps")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _covered(start: float, end: float, busy: list[tuple[float, float]]) -> float:
    """Fraction of [start, end) inside the union ``busy``."""
    if end <= start:
        return 0.0
    total = 0.0
    for a, b in busy:
        if b <= start:
            continue
        if a >= end:
            break
        total += min(b, end) - max(a, start)
    return total / (end - start)


def _leaves(events: list[tuple[str, str, int, float, float]]) -> list[tuple[str, str, int, float, float]]:
    """Compute events ``(name, category, tid, ts, dur)`` that hold no other compute event of their queue (a parent
    module's FW holds its children's: its overlap is theirs)."""
    by_queue: dict[object, list[tuple[str, str, int, float, float]]] = defaultdict(list)
    for e in events:
        by_queue[e[2]].append(e)
    out = []
    for items in by_queue.values():
        items.sort(key=lambda e: (e[3], -e[4]))
        for i, e in enumerate(items):
            nxt = items[i + 1] if i + 1 < len(items) else None
            if nxt is not None and nxt[3] + nxt[4] <= e[3] + e[4] and nxt[3] >= e[3]:
                continue
            out.append(e)
    return out


def _steps_of(trace: RankTrace, wanted: set[int] | None) -> list[list[tuple[str, str, int, float, float]]]:
    """A rank's events ``(name, category, tid, ts, dur)`` per step (steps in the order they first appear in the
    file, events in file order), of the ``wanted`` steps (all: None)."""
    t = trace.table
    index = np.arange(len(t)) if wanted is None else np.flatnonzero(np.isin(t.step, sorted(wanted)))
    _, first, inverse = np.unique(t.step[index], return_index=True, return_inverse=True)
    place = np.empty(first.size, dtype=np.int64)
    place[np.argsort(first, kind="stable")] = np.arange(first.size)  # each step's place in file order
    key = place[inverse.reshape(-1)]
    by_step = np.argsort(key, kind="stable")
    index, key = index[by_step], key[by_step]
    cuts = np.flatnonzero(np.diff(key)) + 1
    rows = list(zip([t.names[n] for n in t.name[index].tolist()], [CATEGORIES[c] for c in t.cat[index].tolist()],
                    t.tid[index].tolist(), t.ts[index].tolist(), t.dur[index].tolist(), strict=True))
    bounds = [0, *cuts.tolist(), len(rows)] if rows else []
    return [rows[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def fit_interference(run: Run, steps: list[int] | None = None) -> Interference:
    """Fit the slowdown of overlapped compute from ``run``'s recorded steps (all, or ``steps``); the recorder's
    probe, where it ran, instead."""
    transfer = _transfer_from_probe(run)
    probed = _from_probe(run)
    if probed is not None:
        return replace(probed, transfer=transfer)
    wanted = set(steps) if steps is not None else None
    xs: list[float] = []
    ys: list[float] = []
    ops = 0
    for trace in run.ranks.values():
        samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for events in _steps_of(trace, wanted):
            busy = _union([(e[3], e[3] + e[4]) for e in events if e[1] in TRACE_COMM])
            if not busy:
                continue
            seen: dict[str, int] = defaultdict(int)
            for name, _, _, ts, dur in _leaves([e for e in events if e[1] in COMPUTE_CATEGORIES]):
                seen[name] += 1
                key = name if seen[name] == 1 else f"{name}#{seen[name]}"
                samples[key].append((_covered(ts, ts + dur, busy), float(dur)))
        for values in samples.values():
            if len(values) < MIN_STEPS:
                continue
            fs = [f for f, _ in values]
            mean_f = statistics.fmean(fs)
            mean_d = statistics.fmean(d for _, d in values)
            if mean_d <= 0 or max(fs) - min(fs) < 0.05:
                continue
            ops += 1
            xs += [f - mean_f for f in fs]
            ys += [d / mean_d - 1.0 for _, d in values]
    fitted = NONE
    if ops and len(xs) >= 3:
        x, y = np.asarray(xs), np.asarray(ys)
        sxx = float(x @ x)
        slope = float(x @ y) / sxx
        residual = y - slope * x
        stderr = math.sqrt(float(residual @ residual) / max(len(xs) - 1, 1) / sxx)
        fitted = Interference(slope, stderr, ops, len(xs),
                              "each op's duration against how much of it overlapped communication, step to step")
    return replace(fitted, transfer=transfer)


def _from_probe(run: Run) -> Interference | None:
    """The recorder's interference probe (run.json's ``interference_probe``: a fixed kernel alone and overlapped by
    an allreduce), when the steps alone cannot tell."""
    probe = (run.meta or {}).get("interference_probe") or {}
    slowdown, stderr = probe.get("slowdown"), probe.get("stderr")
    if not isinstance(slowdown, (int, float)) or not math.isfinite(slowdown):
        return None
    runs = len(probe.get("compute_overlapped_us") or [])
    error = float(stderr) if isinstance(stderr, (int, float)) and math.isfinite(stderr) else math.inf
    compute = str(probe.get("compute") or "a fixed kernel")[:80]
    return Interference(float(slowdown), error, 1, runs,
                        f"the recorder's probe: {compute} alone and while an allreduce was in flight", probed=True)


def _transfer_from_probe(run: Run) -> TransferSlowdown | None:
    """The recorder's transfer probe (run.json's ``transfer_probe``), where it ran and fitted."""
    probe = (run.meta or {}).get("transfer_probe") or {}
    values = [probe.get(k) for k in ("stall_us", "slowdown", "stall_stderr", "stderr", "excess_us", "excess_stderr")]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return None
    return TransferSlowdown(*(float(v) for v in values))


def stretch_transfers(g: Graph, sched: Schedule, nodes: np.ndarray, alone: np.ndarray,
                      transfer: TransferSlowdown) -> None:
    """Set the duration of each of ``nodes`` (transfers every rank takes part in) to its time beside the compute of
    ``sched`` (any rank's: a collective moves at the pace of its slowest member), from ``alone``, its time alone."""
    intervals = [(float(sched.start[i]), float(sched.end[i])) for i, cat in enumerate(g.category)
                 if cat in COMPUTE_CATEGORIES and sched.end[i] > sched.start[i]]
    busy = _union(intervals)
    for node, work in zip(nodes.tolist(), alone.tolist(), strict=True):
        start = float(sched.start[node])
        g.duration[node] = transfer.end(start, work, busy) - start


def fit_trace_interference(traces: list[KinetoTrace]) -> Interference:
    """The slowdown of overlapped compute, from profiler traces (which hold no probe).

    A step runs the same operator on the same shapes several times (a model's identical blocks, a layer's
    forward and its recomputation), some runs overlapped by the rank's collectives more than others. Within each
    (rank, step, operator, shapes) group, each run's duration relative to the group's mean is regressed on its
    overlap relative to the group's mean: runs compared inside one step, so what slows or speeds a whole step
    (the confound of the steps' own fit) cancels out. Compute is the GPU's kernels where the trace has them,
    else the host's innermost operators (a CPU backend's collectives run on threads of their own)."""
    xs: list[float] = []
    ys: list[float] = []
    groups = 0
    for trace in traces:
        kernels = [e for e in trace.gpu_ops if str(e.get("cat", "")).lower() == "kernel"]
        comm = [e for e in kernels if is_nccl(e)] if kernels else list(trace.cpu_comms)
        compute = [e for e in kernels if not is_nccl(e)] if kernels else _leaf_ops(
            [e for e in trace.cpu_ops if not _is_comm_op(e)])
        busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in comm])
        if not busy or not compute:
            continue
        by_group: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        for e in compute:
            step = _step_at(trace, e["ts"])
            if step is not None and e["dur"] > 0:
                by_group[(step, e.get("name"), _shape_key(e))].append(
                    (_covered(e["ts"], e["ts"] + e["dur"], busy), float(e["dur"])))
        for values in by_group.values():
            fs = [f for f, _ in values]
            if len(values) < 2 or max(fs) - min(fs) < 0.05:
                continue
            mean_f, mean_d = statistics.fmean(fs), statistics.fmean(d for _, d in values)
            groups += 1
            xs += [f - mean_f for f in fs]
            ys += [d / mean_d - 1.0 for _, d in values]
    if not groups or len(xs) < 3:
        return replace(NONE, source="no operator ran on the same shapes both overlapped by communication and not "
                                    "in one step")
    x, y = np.asarray(xs), np.asarray(ys)
    sxx = float(x @ x)
    slope = float(x @ y) / sxx
    residual = y - slope * x
    stderr = math.sqrt(float(residual @ residual) / max(len(xs) - groups - 1, 1) / sxx)
    return Interference(slope, stderr, groups, len(xs), "runs of one operator on the same shapes inside one step, "
                        "more and less overlapped by communication", probed=True)


def _leaf_ops(ops: list[dict]) -> list[dict]:
    """The host operators that hold no other operator of their thread (``_leaves`` over trace events)."""
    kept = _leaves([(str(e.get("name", "")), "", e.get("tid"), float(e["ts"]), float(e["dur"])) for e in ops])
    at = {(e.get("tid"), float(e["ts"]), float(e["dur"])): e for e in ops}
    return [at[(tid, ts, dur)] for _, _, tid, ts, dur in kept]


def _is_comm_op(e: dict) -> bool:
    name = str(e.get("name", ""))
    return name.startswith(TRACE_COMM_PREFIXES) or name == "record_param_comms"


def _shape_key(e: dict) -> str:
    args = e.get("args") or {}
    return str(args.get("Input Dims") or args.get("grid") or "") + str(args.get("block") or "")


def _step_at(trace: KinetoTrace, ts: float) -> int | None:
    for k, w in enumerate(trace.steps):
        if w.ts <= ts < w.end:
            return k
    return None


def node_overlap(g: Graph, sched: Schedule, compute: frozenset[str] = COMPUTE_CATEGORIES,
                 comm: frozenset[str] = GRAPH_COMM) -> np.ndarray:
    """For each node of the replay of a category in ``compute``, the fraction of it that overlaps a node of a
    category in ``comm`` of its rank (or a transfer every rank takes part in: rank -1)."""
    out = np.zeros(g.size)
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for i, cat in enumerate(g.category):
        if cat in comm and sched.end[i] > sched.start[i]:
            busy[int(g.rank[i])].append((float(sched.start[i]), float(sched.end[i])))
    shared = busy.pop(-1, [])  # a collective's transfer (rank -1) runs on every rank
    ranks = {int(r) for r in np.unique(g.rank) if r >= 0}
    merged = {rank: _union(busy.get(rank, []) + shared) for rank in ranks}
    for i, cat in enumerate(g.category):
        if cat in compute and int(g.rank[i]) in merged:
            out[i] = _covered(float(sched.start[i]), float(sched.end[i]), merged[int(g.rank[i])])
    return out


def op_overlap(g: Graph, sched: Schedule) -> dict[tuple[int, str], float]:
    """Mean overlap per (rank, op name) over the replayed iterations after the first (the first has no previous
    step's communication to overlap)."""
    overlap = node_overlap(g, sched)
    sums: dict[tuple[int, str], list[float]] = defaultdict(list)
    for i, cat in enumerate(g.category):
        if cat in COMPUTE_CATEGORIES and int(g.iteration[i]) > 0:
            sums[(int(g.rank[i]), g.names[i])].append(float(overlap[i]))
    return {key: statistics.fmean(v) for key, v in sums.items()}


def scale_for_overlap(g: Graph, sched: Schedule, recorded: dict[tuple[int, str], float], slowdown: float,
                      base_duration: np.ndarray) -> None:
    """Set each compute node's duration to ``base_duration`` scaled by how much more (or less) it overlaps
    communication in ``sched`` than in the recorded configuration (``recorded``)."""
    overlap = node_overlap(g, sched)
    for i, cat in enumerate(g.category):
        if cat in COMPUTE_CATEGORIES:
            before = recorded.get((int(g.rank[i]), g.names[i]))
            if before is not None:
                g.duration[i] = base_duration[i] * (1.0 + slowdown * overlap[i]) / (1.0 + slowdown * before)
