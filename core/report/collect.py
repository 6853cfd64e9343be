"""What ``dpro report`` shows, gathered as plain data (``ReportData``) from any source the core reads.

``collect_run(path)`` reads a dpro run directory (every engine), ``collect_traces(paths)`` PyTorch profiler
(Kineto) traces. Each runs the analysis ``dpro analyze`` runs (so the headline equals ``dpro analyze --json``),
then draws what a page needs from it: one step per rank and queue measured and replayed, where the step goes,
communication per collective, and, for run directories with a model, what-if curves and the optimizer's
recommendation. ``dpro.report.html.render_report`` turns the result into the page.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpro.analyze import Analysis, AnalyzedRun, analyze_run, time_by_category
from dpro.dag.graph import NO_QUEUE, Graph
from dpro.engines import load_prepared
from dpro.errors import DproError
from dpro.io.load import Run, overhead_of
from dpro.progress import Progress
from dpro.report.svg import Lane, Span
from dpro.sim.replay import Schedule, critical_path

__all__ = [
    "BANDWIDTH_SCALES",
    "Curve",
    "ReportData",
    "WORLD_SIZES",
    "collect_run",
    "collect_traces",
    "replayed_lanes",
]

log = logging.getLogger("dpro")

BANDWIDTH_SCALES = (0.25, 0.5, 1.0, 2.0, 4.0, 10.0)
WORLD_SIZES = (2, 4, 8, 16, 32, 64)
MAX_RECOMPUTE_POINTS = 8   # single-module recompute choices priced for the memory chart
MAX_COMM_ROWS = 40


@dataclass
class Curve:
    """One what-if curve: the predicted step (ms) at each value of a knob, and the value in force."""

    knob: str
    points: list[tuple[float, float]]
    in_force: float | None = None
    log_x: bool = False
    x_label: str = ""


@dataclass
class ReportData:
    """Everything the report page shows, as plain data (times in ms unless named otherwise)."""

    source: str
    kind: str                                  # "run" (a dpro run directory) or "kineto" (profiler traces)
    engine: str
    world_size: int
    ranks: list[int]
    missing_ranks: list[int]
    knobs: dict[str, Any]
    analysis: Analysis
    step_parts: dict[int, dict[str, float]]    # rank -> part of the step -> ms (adds up to the step)
    lanes: list[Lane]                          # the timeline: measured lanes, then replayed ones
    timeline_note: str
    comm: list[dict[str, Any]]                 # per collective: name, bytes, ms, gbit_per_s
    curves: list[Curve] = field(default_factory=list)
    # recompute choice (or ``choice``: micro-batches, autocast) -> peak bytes, step ms
    memory: list[dict[str, Any]] = field(default_factory=list)
    recommendation: dict[str, Any] | None = None                # explain rows, predicted, the config document
    unavailable: list[str] = field(default_factory=list)        # sections that could not be computed, and why
    recording_overhead: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> what recording cost it


# ---- dpro run directories -----------------------------------------------------------------------------

def collect_run(path: str | Path, *, whatif: bool = True, recommend: bool = True,
                quiet: bool | None = None) -> ReportData:
    """Analyze a run directory and gather the report's data; ``whatif``/``recommend`` add the curves and the
    optimizer's recommendation (replays: the slow part, shown as progress unless ``quiet``)."""
    run = load_prepared(path)
    result = analyze_run(run)
    step = _typical_step(result)
    data = ReportData(
        source=str(run.path), kind="run", engine=str((run.meta or {}).get("engine") or ""),
        world_size=run.world_size, ranks=sorted(run.ranks), missing_ranks=run.missing_ranks,
        knobs=dict((run.meta or {}).get("knobs") or {}), analysis=result.analysis,
        step_parts={r: {k: v / 1000.0 for k, v in parts.items()}
                    for r, parts in time_by_category(result.graph, result.schedule).items()},
        lanes=measured_lanes(run, result, step) + replayed_lanes(result.graph, result.schedule),
        timeline_note=f"measured: step {step} (the step closest to the median), clocks aligned; replayed: the last "
                      f"of {_iterations(result.graph)} replayed steps",
        comm=run_collectives(result),
        recording_overhead={r: o for r, t in run.ranks.items()
                            if (o := overhead_of(t.header.get("recording_overhead"))) is not None})
    if whatif or recommend:
        _add_predictions(data, run, whatif=whatif, recommend=recommend, quiet=quiet)
    return data


def _iterations(g: Graph) -> int:
    return int(g.iteration.max()) + 1 if g.size else 0


def _typical_step(result: AnalyzedRun) -> int:
    """The profiled step whose slowest rank is closest to the median such step."""
    spans: dict[int, float] = defaultdict(float)
    for (_, step), (lo, hi) in result.model.step_spans.items():
        spans[step] = max(spans[step], hi - lo)
    if not spans:
        return result.model.steps[len(result.model.steps) // 2]
    median = statistics.median(spans.values())
    return min(spans, key=lambda s: (abs(spans[s] - median), s))


def measured_lanes(run: Run, result: AnalyzedRun, step: int) -> list[Lane]:
    """One lane per rank and queue: the recorded events of ``step``, on the aligned clock, from its start."""
    shift = result.alignment.offset_us
    starts = [e["ts"] - shift.get(r, 0.0) for r, t in run.ranks.items() for e in t.events
              if e["cat"] == "STEP" and e["args"].get("step") == step]
    if not starts:
        return []
    origin = min(starts)
    lanes = []
    for rank, trace in sorted(run.ranks.items()):
        by_queue: dict[str, list[Span]] = defaultdict(list)
        for e in trace.events:
            if e["args"].get("step") != step or e["cat"] == "STEP":
                continue
            start = e["ts"] - shift.get(rank, 0.0) - origin
            queue = trace.queues.get(e.get("tid"), str(e.get("tid")))
            by_queue[queue].append(Span(start, start + e["dur"], e["name"], e["cat"]))
        lanes += [Lane(f"r{rank} {queue} (measured)", spans) for queue, spans in sorted(by_queue.items())]
    return lanes


def replayed_lanes(g: Graph, sched: Schedule, iteration: int | None = None,
                   categories: dict[str, str] | None = None) -> list[Lane]:
    """One lane per queue of the replayed ``iteration`` (default: the last), transfers on a lane of their own;
    spans on the critical path to the iteration's last step end are marked. ``categories`` renames a graph's
    categories for display (a Kineto graph's KERNEL is compute)."""
    if not g.size:
        return []
    it = _iterations(g) - 1 if iteration is None else iteration
    ends = [(float(sched.end[n]), n) for (_, i), n in g.step_end.items() if i == it]
    starts = [float(sched.end[n]) for (_, i), n in g.step_end.items() if i == it - 1]
    nodes = np.flatnonzero(g.iteration == it)
    origin = min(starts) if starts else float(sched.start[nodes].min()) if nodes.size else 0.0
    critical = set(critical_path(g, sched, max(ends)[1])) if ends else set()
    by_queue: dict[str, list[Span]] = defaultdict(list)
    rename = categories or {}
    for node in nodes:
        if g.duration[node] <= 0:
            continue
        queue = g.queue_names[g.queue[node]] if g.queue[node] != NO_QUEUE else "transfers"
        cat = g.category[node]
        by_queue[queue].append(Span(float(sched.start[node]) - origin, float(sched.end[node]) - origin,
                                    g.names[node], rename.get(cat, cat), critical=int(node) in critical))
    return [Lane(f"{queue.replace('/', ' ')} (replayed)", spans, replayed=True)
            for queue, spans in sorted(by_queue.items(), key=lambda kv: _queue_order(kv[0]))]


def _queue_order(queue: str) -> tuple[int, str]:
    """Lanes by rank (``r0/compute`` before ``r1/...``), shared queues (transfers, servers) last."""
    head = queue.split("/", 1)[0]
    return (int(head[1:]), queue) if head[:1] == "r" and head[1:].isdigit() else (1 << 30, queue)


def run_collectives(result: AnalyzedRun) -> list[dict[str, Any]]:
    """Per collective of a step (rank 0's order): bytes, the measured transfer (last arrival to end) and the
    bandwidth it achieved, and the longest any rank's collective took from its launch (waiting included)."""
    ops = result.model.ops
    if not ops:
        return []
    longest: dict[str, float] = defaultdict(float)
    for rank_ops in ops.values():
        for op in rank_ops:
            if op.category == "COMM":
                longest[op.name] = max(longest[op.name], op.duration)
    rows = []
    for op in ops[min(ops)]:
        if op.category != "COMM":
            continue
        size = op.args.get("bytes")
        size = int(size) if isinstance(size, int | float) and math.isfinite(size) and size >= 0 else None
        transfer = result.model.transfer.get(op.name)
        rows.append({"name": op.name, "bytes": size,
                     "transfer_ms": transfer / 1000.0 if transfer is not None else None,
                     "launch_to_end_ms": longest[op.name] / 1000.0,
                     "gbit_per_s": size * 8 / transfer / 1000.0 if size and transfer else None})
    return rows[:MAX_COMM_ROWS] if len(rows) <= MAX_COMM_ROWS else sorted(
        rows, key=lambda r: -(r["transfer_ms"] or r["launch_to_end_ms"]))[:MAX_COMM_ROWS]


def _add_predictions(data: ReportData, run: Run, *, whatif: bool, recommend: bool, quiet: bool) -> None:
    """What-if curves and the optimizer's recommendation; a section that cannot be had says why instead."""
    from dpro.sim.whatif import context

    try:
        ctx = context(run)
    except DproError as err:
        data.unavailable.append(f"what-if and recommendations: {err}")
        return
    if whatif:
        try:
            data.curves, data.memory = whatif_curves(ctx, quiet=quiet)
        except DproError as err:
            data.unavailable.append(f"what-if curves: {err}")
    if recommend:
        from dpro.optimize import config_document, optimize

        try:
            result = optimize(ctx, progress=Progress(None, "optimize", quiet=quiet))
        except DproError as err:
            data.unavailable.append(f"recommendations: {err}")
            return
        data.recommendation = {"measured_step_ms": result.measured_step_ms,
                               "baseline_step_ms": result.baseline.predicted_step_ms,
                               "predicted_step_ms": result.predicted.predicted_step_ms,
                               "explain": result.explain, "config": config_document(result, ctx),
                               "search_seconds": result.search_seconds}


def whatif_curves(ctx: Any, *, quiet: bool | None = None) -> tuple[list[Curve], list[dict[str, Any]]]:
    """Step time vs the engine's own knobs (``Engine.sweeps``), vs bandwidth and vs world size, and peak memory
    vs recomputing each candidate module, every point a replay."""
    from dpro.engines import get_engine
    from dpro.sim.choices import recompute_candidates
    from dpro.sim.whatif import predict

    sweeps = [(knob, list(values)) for knob, values in get_engine(ctx.engine).sweeps(ctx)]
    sweeps.append(("bandwidth_scale", list(BANDWIDTH_SCALES)))
    sweeps.append(("world_size", sorted({*WORLD_SIZES, ctx.run.world_size})))
    modules = recompute_candidates(ctx)[:MAX_RECOMPUTE_POINTS] if ctx.memory.activation_bytes else []
    total = sum(len(values) for _, values in sweeps) + len(modules) + 1 + len(_probed_choices(ctx))
    curves = []
    with Progress(total, "what-if curves", quiet=quiet) as bar:
        for knob, values in sweeps:
            points = []
            for value in values:
                bar.advance(note=f"{knob}={value}")
                try:
                    points.append((float(value), predict(ctx, {knob: value}).predicted_step_ms))
                except DproError as err:  # a value the engine refuses for this run: left off the curve
                    log.debug("what-if %s=%s left out: %s", knob, value, err)
            in_force = 1.0 if knob == "bandwidth_scale" else _number(ctx.knobs.get(knob))
            if knob == "world_size":
                in_force = float(ctx.run.world_size)
            curves.append(Curve(knob, points, in_force, log_x=_spans_decades(values), x_label=knob))
        base = predict(ctx, {})
        bar.advance(note="as recorded")
        memory = [{"recompute": "(none)", "peak_memory_bytes": base.predicted_peak_memory_bytes,
                   "step_ms": base.predicted_step_ms}]
        for module in modules:
            bar.advance(note=f"recompute {module}")
            p = predict(ctx, {"recompute": [module]})
            memory.append({"recompute": module, "peak_memory_bytes": p.predicted_peak_memory_bytes,
                           "step_ms": p.predicted_step_ms})
        for knob, value in _probed_choices(ctx):
            bar.advance(note=f"{knob}={value}")
            try:
                p = predict(ctx, {knob: value})
            except DproError as err:  # e.g. a precision the recorder could not probe
                log.debug("what-if %s=%s left out: %s", knob, value, err)
                continue
            memory.append({"recompute": "(none)", "choice": f"{knob}={value}",
                           "peak_memory_bytes": p.predicted_peak_memory_bytes, "step_ms": p.predicted_step_ms})
    return curves, memory


PROBED_CHOICES = (("micro_batches", 2), ("micro_batches", 4), ("amp", "bf16"), ("amp", "fp16"))


def _probed_choices(ctx: Any) -> tuple[tuple[str, Any], ...]:
    """The knobs the recorder's probe passes price (``dpro.sim.probes``), when the run has probes."""
    return PROBED_CHOICES if ctx.probes else ()


def _spans_decades(values: list[Any]) -> bool:
    """A log axis for values that span 20x or more (bucket sizes, bandwidth); a linear one for counts such as
    servers (on a log axis, values at 0 are left out)."""
    positive = [float(v) for v in values if _number(v) is not None and float(v) > 0]
    return bool(positive) and max(positive) >= 20 * min(positive)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


# ---- PyTorch profiler (Kineto) traces -----------------------------------------------------------------

KINETO_CATEGORIES = {"KERNEL": "COMPUTE", "NCCL": "COMM", "MEMSET": "MEMCPY", "CPU": "CPU", "RUNTIME": "OTHER",
                     "SYNC": "OTHER"}


def collect_traces(paths: list[str | Path]) -> ReportData:
    """Analyze PyTorch profiler traces (one per rank) and gather the report's data. What-if curves and
    recommendations need a dpro run directory (the traces carry no gradient list): the page says so."""
    from dpro.analyze.traces import replay_traces
    from dpro.io.kineto import load_traces

    result = replay_traces(load_traces([Path(p) for p in paths]))
    info, a = result.info, result.analysis
    last = len(info.steps) - 1
    parts = {}
    for row in a.per_rank:
        comm, hidden = row.get("communication_ms") or 0.0, row.get("overlapped_communication_ms") or 0.0
        parts[row["rank"]] = {"compute": row.get("compute_ms") or 0.0, "memcpy": row.get("memcpy_ms") or 0.0,
                              "communication": max(0.0, comm - hidden), "idle": row.get("idle_ms") or 0.0,
                              "overlapped_communication": hidden}
    world = max([t.world_size or 1 for t in result.traces] + [len(result.traces)])
    return ReportData(
        source=a.source, kind="kineto", engine="", world_size=world, ranks=list(info.ranks),
        missing_ranks=sorted(set(range(world)) - set(info.ranks)), knobs={}, analysis=a, step_parts=parts,
        lanes=kineto_measured_lanes(result, last) + replayed_lanes(result.graph, result.schedule, last,
                                                                   KINETO_CATEGORIES),
        timeline_note=f"ProfilerStep#{info.steps[last]}: measured (each trace's own clock, from the step's start) "
                      "and replayed",
        comm=kineto_collectives(result, last),
        unavailable=["what-if curves and recommendations: profiler traces carry no gradient list; record the job "
                     "with dpro (or dpro-launch --profile) for them"])


def kineto_measured_lanes(result: Any, iteration: int) -> list[Lane]:
    """Per rank: its top-level host operators per thread and its GPU ops per stream within one step."""
    from dpro.io.kineto import short_name

    lanes = []
    number = result.info.steps[iteration]
    for rank, trace in sorted(zip(result.info.ranks, result.traces, strict=True), key=lambda rt: rt[0]):
        window = next((w for w in trace.steps if w.number == number), None)
        if window is None:
            continue
        threads: dict[Any, list[Span]] = defaultdict(list)
        for e in trace.cpu_ops:
            if window.ts <= e["ts"] < window.end:
                threads[e.get("tid")].append(Span(e["ts"] - window.ts, e["ts"] + e["dur"] - window.ts,
                                                  short_name(str(e.get("name", ""))), "CPU"))
        for tid, spans in sorted(threads.items(), key=lambda kv: str(kv[0])):
            lanes.append(Lane(f"r{rank} thread {tid} (measured)", _outermost(spans)))
        comm_threads: dict[Any, list[Span]] = defaultdict(list)
        for e in trace.cpu_comms:  # a CPU backend's collectives on its own threads (gloo)
            if window.ts <= e["ts"] < window.end:
                comm_threads[e.get("tid")].append(Span(e["ts"] - window.ts, e["ts"] + e["dur"] - window.ts,
                                                       str(e.get("name", "")), "COMM"))
        for tid, spans in sorted(comm_threads.items(), key=lambda kv: str(kv[0])):
            lanes.append(Lane(f"r{rank} comm thread {tid} (measured)", spans))
        streams: dict[Any, list[Span]] = defaultdict(list)
        for e in trace.gpu_ops:
            if window.ts <= e["ts"] < window.end + window.dur:
                cat = str(e.get("cat", "")).lower()
                shown = "COMM" if "nccl" in str(e.get("name", "")).lower() else (
                    "MEMCPY" if "mem" in cat else "COMPUTE")
                streams[(e.get("args") or {}).get("stream", e.get("tid"))].append(
                    Span(e["ts"] - window.ts, e["ts"] + e["dur"] - window.ts, short_name(str(e.get("name", ""))),
                         shown))
        for stream, spans in sorted(streams.items(), key=lambda kv: str(kv[0])):
            lanes.append(Lane(f"r{rank} stream {stream} (measured)", spans))
    return lanes


def _outermost(spans: list[Span]) -> list[Span]:
    """Spans not nested in an earlier one (a thread's top-level operators)."""
    out: list[Span] = []
    end = -math.inf
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        if s.start >= end - 1e-3:
            out.append(s)
            end = s.end
    return out


def kineto_collectives(result: Any, iteration: int) -> list[dict[str, Any]]:
    """The NCCL kernels (and CPU backends' collectives) of one step on the first rank: bytes, time and the bandwidth
    that implies."""
    trace = result.traces[0]
    window = next((w for w in trace.steps if w.number == result.info.steps[iteration]), None)
    if window is None:
        return []
    rows = []
    for c in trace.collectives():
        if window.ts <= c.ts < window.end + window.dur:
            rows.append({"name": f"{c.op or c.kernel}", "bytes": c.bytes, "transfer_ms": c.dur / 1000.0,
                         "launch_to_end_ms": c.dur / 1000.0,
                         "gbit_per_s": c.bytes * 8 / c.dur / 1000.0 if c.bytes and c.dur > 0 else None})
    for e in trace.cpu_comms:  # gloo's annotations carry no size
        if window.ts <= e["ts"] < window.end:
            rows.append({"name": str(e.get("name", "")), "bytes": None, "transfer_ms": e["dur"] / 1000.0,
                         "launch_to_end_ms": e["dur"] / 1000.0, "gbit_per_s": None})
    return rows[:MAX_COMM_ROWS]
