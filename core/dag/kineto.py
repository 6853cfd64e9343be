"""The DAG of PyTorch profiler (Kineto) traces (read by ``dpro.io.kineto``).

``graph_from_kineto`` turns the profiled steps of one or more ranks into a
``dpro.dag.graph.Graph`` and a ``KinetoGraphInfo`` (where each step begins and ends, what was measured).

The DAG, per rank:

* queues: every host thread that runs operators or launches GPU work (``r0/host<tid>``), and every
  GPU stream (``r0/gpu<device>/stream<id>``); program order on each queue is an edge.
* host nodes: the CUDA runtime calls that launch, copy or synchronize, and the top-level CPU operators
  that launch nothing; the host time between them is their gap. A runtime call is cut where its GPU op
  starts (the launch) so that a copy which returns after its GPU op ends (a blocking copy) can wait for it.
* launch edges: runtime call with correlation ``c`` -> the GPU op with correlation ``c``.
* waits: synchronizing calls (``cudaDeviceSynchronize``, ``cudaStreamSynchronize``, ``cudaEventSynchronize``,
  ``cudaMemcpy``, ``cudaFree`` ...) and launches that block on a full launch queue wait for the last GPU op,
  launched before them, that ended before they returned.
* inferred edges: a host thread that idles until another host thread's op ends waits for it (the main
  thread during backward); a GPU op that starts right after an op on another stream ends, with its own
  predecessors long done, waits for it (``cudaStreamWaitEvent`` carries no event id in Kineto traces).
* collectives: the NCCL kernels of one process group are matched across ranks by order; each rank's
  kernel becomes an arrival, one transfer node follows all arrivals (as in ``dpro.dag.graph``). Kernels end
  together on every rank, so the last rank to arrive has the shortest kernel: that duration is the
  transfer (no clock alignment needed). With one rank given, NCCL kernels keep their measured duration.
* every node's gap is its measured start minus the latest measured end of its predecessors (>= 0).
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpro.dag.graph import Graph, GraphBuilder
from dpro.dag.levels import plan_levels
from dpro.errors import GraphError, TraceError, UsageError
from dpro.io.kineto import (
    GPU_CATS,
    KinetoTrace,
    StepWindow,
    correlation,
    cpu_comm_message,
    device_of,
    is_nccl,
    short_name,
    stream_of,
)

__all__ = [
    "KinetoGraphInfo",
    "graph_from_kineto",
]

DEVICE_SYNC = {"cudaDeviceSynchronize", "cuCtxSynchronize", "cudaFree", "cuMemFree", "cuMemFree_v2"}
ONE_SYNC = {"cudaStreamSynchronize", "cudaEventSynchronize", "cuStreamSynchronize", "cuEventSynchronize",
            "cudaMemcpy", "cudaMemcpy2D", "cudaMemcpy3D", "cudaMemcpyToSymbol", "cudaMemcpyFromSymbol",
            "cudaMemcpyPeer", "cuMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2"}
EPS_US = 2.0            # CPU and GPU clocks in one trace agree to about this much
LONG_CALL_US = 50.0     # a launch call this long may be blocked on a full launch queue
HANDOFF_US = 50.0       # a host thread idle this long may be waiting for another thread
# a CPU backend's collective annotation closes after it has woken the thread waiting for it (gloo: up to a few ms
# late): by this much, or this share of the collective, whichever is more
COMM_CLOSES_LATE_US, COMM_CLOSES_LATE_SHARE = 3000.0, 0.05
XSTREAM_GAP_US = 5.0    # a GPU op this late after its own predecessors may wait for another stream ...
XSTREAM_NEAR_US = 10.0  # ... when an op on another stream ended at most this long before it started


# ---- one rank's nodes ------------------------------------------------------------------------------

@dataclass(eq=False)
class _Node:
    """A node before it enters the graph: measured (effective) start and end on its rank's clock."""

    name: str
    category: str
    queue: str
    start: float
    end: float
    step: int
    prio: int = 1                  # tie-break of equal starts: markers 0, host 1, GPU 2, waits 3, step end 4
    preds: list[_Node] = field(default_factory=list)
    pg: str = ""                   # NCCL: process group (matching key)
    op: str = ""                   # NCCL, COMM: collective name
    nbytes: int = 0                # NCCL, COMM: the message's bytes (0: the trace does not say)
    launch_ts: float = 0.0         # GPU: start of the runtime call that launched it
    gid: int = -1                  # node id in the graph once added
    done: int = -1                 # node whose end means "done" (the transfer of a joined collective)


@dataclass
class _RankPlan:
    """One rank's nodes in insertion order, and what the analysis needs to find again."""

    rank: int
    nodes: list[_Node]
    host_queues: list[str]
    gpu_queues: list[str]
    begin: dict[int, _Node]
    end: dict[int, _Node]
    gpu_by_step: dict[int, list[_Node]]
    windows: list[StepWindow]
    skipped_threads: list[Any]
    shared_correlations: int = 0  # correlation ids several runtime calls carry (left unlinked)


class _StepOf:
    """Which replayed step a time belongs to: the window it lies in, or the short pause after it
    (until the next ProfilerStep begins); None outside."""

    def __init__(self, windows: list[StepWindow], recorded: list[StepWindow]) -> None:
        self.starts = [w.ts for w in windows]
        self.stops = []
        for w in windows:
            nxt = min((s.ts for s in recorded if s.ts > w.ts), default=w.end)
            self.stops.append(nxt if nxt - w.end < 0.1 * w.dur else w.end)

    def __call__(self, t: float) -> int | None:
        i = bisect.bisect_right(self.starts, t) - 1
        return i if i >= 0 and t <= self.stops[i] else None


def _rank_plan(trace: KinetoTrace, rank: int, windows: list[StepWindow]) -> _RankPlan:
    """All nodes of one rank over ``windows``, wired except for queue order and inferred edges."""
    step_of = _StepOf(windows, trace.steps)
    by_corr: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for op in trace.gpu_ops:
        by_corr[correlation(op)].append(op)
    by_corr.pop(None, None)
    # a correlation id names one runtime call; one shared by several cannot tell which launched what (and linking
    # every sharer to every GPU op would take calls x ops): such ids link nothing
    calls_per_id = Counter(correlation(r) for r in trace.runtime)
    shared = [c for c in by_corr if calls_per_id.get(c, 0) > 1]
    for c in shared:
        del by_corr[c]
    host_tids, skipped = _host_threads(trace, by_corr)
    launch_ts = {correlation(r): r["ts"] for r in trace.runtime
                 if r.get("tid") in host_tids and correlation(r) in by_corr}
    gpu_nodes, gpu_of = _gpu_nodes(trace, rank, step_of, launch_ts)
    waits = _WaitIndex(gpu_nodes)
    nodes: list[_Node] = list(gpu_nodes)
    main_q = f"r{rank}/host{trace.main_tid}"
    for tid in host_tids:
        nodes += _host_nodes(trace, tid, f"r{rank}/host{tid}", step_of, by_corr, gpu_of, waits)
    comm_queues = []
    for ev in sorted(trace.cpu_comms, key=lambda e: e["ts"]):  # host-side: an idle thread may be waiting for one
        step = step_of(ev["ts"])
        if step is not None:
            queue = f"r{rank}/comm{ev.get('tid')}"
            comm_queues += [] if queue in comm_queues else [queue]
            op, nbytes = cpu_comm_message(ev)
            nodes.append(_Node(str(ev.get("name", "")), "COMM", queue, ev["ts"], ev["ts"] + ev["dur"], step,
                               op=op, nbytes=nbytes))
    begin, end = _step_markers(windows, main_q, nodes)
    nodes += list(begin.values()) + list(end.values())
    for seq, n in enumerate(nodes):
        n.done = seq  # temporary: creation order for a stable sort
    nodes.sort(key=lambda n: (n.start, n.prio, n.done))
    gpu_by_step: dict[int, list[_Node]] = defaultdict(list)
    for n in gpu_nodes:
        gpu_by_step[n.step].append(n)
    return _RankPlan(rank=rank, nodes=nodes, host_queues=[f"r{rank}/host{t}" for t in host_tids] + comm_queues,
                     gpu_queues=sorted({n.queue for n in gpu_nodes}), begin=begin, end=end,
                     gpu_by_step=dict(gpu_by_step), windows=windows, skipped_threads=skipped,
                     shared_correlations=len(shared))


def _host_threads(trace: KinetoTrace, by_corr: dict[Any, list]) -> tuple[list[Any], list[Any]]:
    """Threads that run operators or launch GPU work (main thread first), and the others seen."""
    busy = {e.get("tid") for e in trace.cpu_ops} | {r.get("tid") for r in trace.runtime if correlation(r) in by_corr}
    busy.add(trace.main_tid)
    others = {r.get("tid") for r in trace.runtime} - busy
    return [trace.main_tid] + sorted(busy - {trace.main_tid}, key=str), sorted(others, key=str)


def _gpu_nodes(trace: KinetoTrace, rank: int, step_of: _StepOf,
               launch_ts: dict[Any, float]) -> tuple[list[_Node], dict[int, _Node]]:
    """One node per GPU op, assigned to the step its launch lies in (its own start if unlaunched)."""
    nodes, of = [], {}
    comm_args = {}
    if any(is_nccl(e) for e in trace.gpu_ops):
        comm_args = {id(k): c for k, c in zip(sorted(trace.nccl_kernels, key=lambda e: e["ts"]),
                                               trace.collectives(), strict=True)}
    for op in trace.gpu_ops:
        launched = launch_ts.get(correlation(op))
        step = step_of(op["ts"] if launched is None else launched)
        if step is None:
            continue
        cat = "NCCL" if is_nccl(op) else GPU_CATS[str(op.get("cat")).lower()]
        n = _Node(short_name(str(op.get("name", ""))), cat, f"r{rank}/gpu{device_of(op)}/stream{stream_of(op)}",
                  op["ts"], op["ts"] + op["dur"], step, prio=2,
                  launch_ts=op["ts"] if launched is None else launched)
        if id(op) in comm_args:
            c = comm_args[id(op)]
            n.pg, n.op, n.nbytes = c.process_group, c.op, c.bytes or 0
        nodes.append(n)
        of[id(op)] = n
    return nodes, of


class _WaitIndex:
    """GPU nodes by end time, per queue: which op did a blocking call wait for?"""

    def __init__(self, gpu_nodes: list[_Node]) -> None:
        by_q: dict[str, list[_Node]] = defaultdict(list)
        for n in gpu_nodes:
            by_q[n.queue].append(n)
        self.nodes = {q: sorted(ns, key=lambda n: n.end) for q, ns in by_q.items()}
        self.ends = {q: [n.end for n in ns] for q, ns in self.nodes.items()}

    def last_done(self, queue: str, before: float, launched_before: float, after: float = -np.inf) -> _Node | None:
        """The op on ``queue`` launched before ``launched_before`` that ended last in (after, before]."""
        ends, nodes = self.ends[queue], self.nodes[queue]
        i = bisect.bisect_right(ends, before + EPS_US) - 1
        for j in range(i, max(i - 64, -1), -1):
            if ends[j] <= after:
                return None
            late = ends[j] > before and nodes[j].start >= before - EPS_US  # started as the call returned
            if nodes[j].launch_ts < launched_before and not late:
                return nodes[j]
        return None

    def waited(self, before: float, launched_before: float, after: float = -np.inf,
               every_queue: bool = False) -> list[_Node]:
        found = [n for q in self.nodes if (n := self.last_done(q, before, launched_before, after)) is not None]
        if every_queue or not found:
            return found
        return [max(found, key=lambda n: n.end)]


def _top_level(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Operators not nested in another operator of the same thread, in time order."""
    out, end = [], -np.inf
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end - 1e-3:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def _host_nodes(trace: KinetoTrace, tid: Any, queue: str, step_of: _StepOf, by_corr: dict[Any, list],
                gpu_of: dict[int, _Node], waits: _WaitIndex) -> list[_Node]:
    """Host nodes of one thread: runtime calls that matter, and top-level operators that launch nothing."""
    tops = _top_level([e for e in trace.cpu_ops if e.get("tid") == tid])
    starts = [e["ts"] for e in tops]
    calls = sorted((r for r in trace.runtime if r.get("tid") == tid and
                    (correlation(r) in by_corr or r.get("name") in DEVICE_SYNC or r.get("name") in ONE_SYNC)),
                   key=lambda r: r["ts"])
    holders: set[int] = set()
    nodes: list[_Node] = []
    for call in calls:
        i = bisect.bisect_right(starts, call["ts"]) - 1
        inside = tops[i] if i >= 0 and call["ts"] < tops[i]["ts"] + tops[i]["dur"] else None
        if inside is not None:
            holders.add(id(inside))
        step = step_of(call["ts"])
        if step is None:
            continue
        label = f"{call['name']} ({inside['name']})" if inside else str(call["name"])
        launched = [gpu_of[id(op)] for op in by_corr.get(correlation(call), []) if id(op) in gpu_of]
        nodes += _call_nodes(call, label, queue, step, launched, waits)
    for op in tops:
        step = step_of(op["ts"])
        if id(op) not in holders and step is not None:
            nodes.append(_Node(str(op.get("name", "")), "CPU", queue, op["ts"], op["ts"] + op["dur"], step))
    return nodes


def _call_nodes(call: dict[str, Any], label: str, queue: str, step: int, launched: list[_Node],
                waits: _WaitIndex) -> list[_Node]:
    """One runtime call: a launch part (up to where its GPU op starts), and a return part if it is longer."""
    cs, ce = call["ts"], call["ts"] + call["dur"]
    name = str(call.get("name", ""))
    if not launched:  # a synchronizing call
        done = waits.waited(ce, cs, every_queue=name in DEVICE_SYNC)
        start = min(max([cs] + [n.end for n in done]), ce)
        return [_Node(label, "SYNC", queue, start, ce, step, prio=3, preds=done)]
    split = min(max(cs, min(n.start for n in launched)), ce)
    first = _Node(label, "RUNTIME", queue, cs, split, step)
    if call["dur"] >= LONG_CALL_US:  # blocked on a full launch queue: waits for a slot to free up
        first.preds = waits.waited(split, cs, after=cs)
        first.start = min(max([cs] + [n.end for n in first.preds]), split)
    for n in launched:
        n.preds.append(first)
    if split >= ce:
        return [first]
    rest = _Node(f"{label} (return)", "RUNTIME", queue, split, ce, step, prio=3)
    blocking = [n for n in launched if n.end <= ce + EPS_US]
    if blocking:  # returned after its GPU op ended: a blocking copy (or a tiny kernel)
        rest.preds = blocking
        rest.start = min(max(split, max(n.end for n in blocking)), ce)
    return [first, rest]


def _step_markers(windows: list[StepWindow], queue: str,
                  nodes: list[_Node]) -> tuple[dict[int, _Node], dict[int, _Node]]:
    """Zero-length begin/end nodes of every ProfilerStep on the main thread; the end waits for other threads."""
    last_other: dict[tuple[int, str], _Node] = {}
    for n in nodes:
        if "/host" in n.queue and n.queue != queue and n.end <= windows[n.step].end:
            key = (n.step, n.queue)
            if key not in last_other or n.end > last_other[key].end:
                last_other[key] = n
    begin, end = {}, {}
    for i, w in enumerate(windows):
        begin[i] = _Node(f"ProfilerStep#{w.number}", "STEP", queue, w.ts, w.ts, i, prio=0)
        preds = [n for (s, _), n in last_other.items() if s == i]
        end[i] = _Node(f"ProfilerStep#{w.number} end", "STEP", queue, w.end, w.end, i, prio=4, preds=preds)
    return begin, end


# ---- the graph -------------------------------------------------------------------------------------

@dataclass
class KinetoGraphInfo:
    """What ``graph_from_kineto`` knows beside the graph: steps, markers, GPU spans, measured times."""

    steps: list[int]                                     # ProfilerStep numbers; iteration i is steps[i]
    ranks: list[int]
    files: dict[int, str]
    step_begin: dict[tuple[int, int], int]               # (rank, iteration) -> begin marker node
    step_gpu: dict[tuple[int, int], list[int]]           # (rank, iteration) -> "done" nodes of its GPU ops
    gpu_spans: dict[int, list[tuple[int, int, str]]]     # rank -> (start node, end node, compute|memcpy|comm)
    measured_host_us: dict[tuple[int, int], float]       # ProfilerStep#N duration
    measured_device_us: dict[tuple[int, int], float]     # step start .. its last GPU op's end
    host_spans: dict[int, list[int]] = field(default_factory=dict)     # rank -> top-level CPU operator nodes
    cpu_comm_spans: dict[int, list[int]] = field(default_factory=dict)  # rank -> collectives on CPU backend threads
    step_ts: dict[tuple[int, int], float] = field(default_factory=dict)  # ProfilerStep#N start (trace clock)
    collectives: list[dict[int, float]] = field(default_factory=list)  # joined: rank -> kernel µs
    comm: dict[int, tuple[str, int]] = field(default_factory=dict)      # collective node -> (operation, bytes)
    nccl_kernels: dict[int, int] = field(default_factory=dict)          # rank -> NCCL kernels in the steps
    node_at: dict[tuple[int, str, float], int] = field(default_factory=dict)  # (rank, queue, start) -> CPU/COMM node
    dropped_edges: int = 0
    notes: list[str] = field(default_factory=list)


def graph_from_kineto(traces: list[KinetoTrace], steps: list[int] | None = None) -> tuple[Graph, KinetoGraphInfo]:
    """The DAG of the profiled steps (all ``ProfilerStep#N`` common to the ranks, or ``steps``).

    Raises:
        UsageError: no traces, or a step asked for that some rank did not record.
    """
    if not traces:
        raise UsageError("graph_from_kineto: no traces given")
    ranks = _rank_ids(traces)
    numbers, notes = _common_steps(traces, ranks, steps)
    plans = [_rank_plan(t, r, [w for w in t.steps if w.number in numbers]) for t, r in zip(traces, ranks, strict=True)]
    joined, coll_notes, coll_durs = _match_collectives(plans)
    notes += coll_notes
    notes += [f"rank {p.rank}: {p.shared_correlations} correlation id(s) are carried by several runtime calls, so "
              "which call launched which GPU op is unknown; those GPU ops are placed by their own times"
              for p in plans if p.shared_correlations]
    try:
        g, info = _build(plans, joined)
        plan_levels(g)
    except GraphError:
        notes.append("matching NCCL kernels across ranks by order made a cycle: collectives kept per rank")
        joined, coll_durs = {}, []
        g, info = _build(plans, joined)
    info.steps, info.files = numbers, {r: str(t.path) for t, r in zip(traces, ranks, strict=True)}
    info.collectives = coll_durs
    info.notes = notes + info.notes
    return g, info


def _rank_ids(traces: list[KinetoTrace]) -> list[int]:
    """The rank of each trace: ``distributedInfo.rank``, else its position; two files of one rank is an error."""
    out: list[int] = []
    seen: dict[int, Path] = {}
    for i, t in enumerate(traces):
        r = t.rank if t.rank is not None else i
        if r in seen:
            raise TraceError(t.path, f"rank {r} is also the rank of {seen[r]}: give one trace per rank")
        seen[r] = t.path
        out.append(r)
    return out


def _common_steps(traces: list[KinetoTrace], ranks: list[int],
                  steps: list[int] | None) -> tuple[list[int], list[str]]:
    """The ProfilerStep numbers every rank recorded (or those asked for), and notes on the others."""
    notes = []
    have = [{w.number for w in t.steps} for t in traces]
    common = set.intersection(*have)
    for t, r, h in zip(traces, ranks, have, strict=True):
        if h - common:
            notes.append(f"rank {r} ({t.path.name}) also recorded steps {sorted(h - common)}: not replayed "
                         "(other ranks lack them)")
    if steps is not None:
        missing = sorted(set(steps) - common)
        if missing:
            raise UsageError(f"steps {missing} are not in every trace; recorded: {sorted(common)}")
        common = set(steps)
    if not common:
        raise UsageError("the traces have no ProfilerStep#N in common: were they recorded in one job?")
    return sorted(common), notes


def _match_collectives(plans: list[_RankPlan]) -> tuple[dict[int, tuple[int, float]], list[str], list[dict]]:
    """NCCL kernels that are one collective across ranks: id(node) -> (collective index, transfer µs)."""
    if len(plans) < 2:
        return {}, [], []
    lists: list[dict[str, list[_Node]]] = []
    for p in plans:
        by_pg: dict[str, list[_Node]] = defaultdict(list)
        for n in p.nodes:
            if n.category == "NCCL":
                by_pg[n.pg or "default"].append(n)
        lists.append(by_pg)
    joined: dict[int, tuple[int, float]] = {}
    durs: list[dict[int, float]] = []
    notes = []
    for pg in sorted(set.intersection(*(set(d) for d in lists))):
        members = [d[pg] for d in lists]
        counts = [len(m) for m in members]
        if len(set(counts)) > 1:
            notes.append(f"process group {pg}: the ranks ran {counts} NCCL kernels in the profiled steps; "
                         "matched up to the shortest list, the rest keep their measured durations")
        for k, group in enumerate(zip(*members, strict=False)):
            if len({n.op for n in group}) > 1:
                notes.append(f"process group {pg}: collective #{k} differs across ranks "
                             f"({sorted({n.op for n in group})}); later ones are not matched")
                break
            dur = {p.rank: n.end - n.start for p, n in zip(plans, group, strict=True)}
            for n in group:
                joined[id(n)] = (len(durs), min(dur.values()))
            durs.append(dur)
    return joined, notes, durs


def _build(plans: list[_RankPlan], joined: dict[int, tuple[int, float]]) -> tuple[Graph, KinetoGraphInfo]:
    """Freeze the ranks' nodes into one graph (joined NCCL kernels share a transfer node)."""
    b = GraphBuilder()
    xfer: dict[int, int] = {}
    info = KinetoGraphInfo(steps=[], ranks=[p.rank for p in plans], files={}, step_begin={}, step_gpu={},
                           gpu_spans={}, measured_host_us={}, measured_device_us={})
    for p in plans:
        for n in p.nodes:
            n.gid = n.done = -1
    for p in plans:
        info.dropped_edges += _add_rank(b, p, joined, xfer)
        _rank_info(p, info, b)
    if info.dropped_edges:
        info.notes.append(f"{info.dropped_edges} dependencies pointed backwards in time and were left out")
    return b.build(), info


def _add_rank(b: GraphBuilder, p: _RankPlan, joined: dict[int, tuple[int, float]], xfer: dict[int, int]) -> int:
    """Add one rank's nodes in time order: gaps from measured times, inferred cross-queue waits."""
    origin = p.windows[0].ts
    qlast: dict[str, _Node] = {}
    ends: dict[str, tuple[list[float], list[_Node]]] = defaultdict(lambda: ([], []))
    host = set(p.host_queues)
    dropped = 0
    for n in p.nodes:
        preds = [q for q in n.preds if q.done >= 0]
        dropped += len(n.preds) - len(preds)
        prev = qlast.get(n.queue)
        ready = max([q.end for q in preds] + [prev.end if prev else origin])
        others = p.host_queues if n.queue in host else [q for q in p.gpu_queues if _same_gpu(q, n.queue)]
        near = XSTREAM_NEAR_US if n.queue not in host else np.inf
        if n.start - ready > (HANDOFF_US if n.queue in host else XSTREAM_GAP_US):
            cand = _latest_end(ends, others, n.queue, ready, n.start, near)
            closing = _closing_comm(ends, n.start) if n.queue in host else None
            if closing is not None and (cand is None or n.start - cand.end > HANDOFF_US):
                times, nodes = ends[closing.queue]
                at = next(i for i in range(len(nodes) - 1, -1, -1) if nodes[i] is closing)  # a recent one
                times[at] = closing.end = n.start  # it ended when it woke this thread
                b.duration[closing.gid] = max(0.0, n.start - closing.start)
                cand = closing
            if cand is not None:
                preds.append(cand)
                ready = max(ready, cand.end)
        gap = max(0.0, n.start - ready)
        pred_ids = list(dict.fromkeys(q.done for q in preds))
        if id(n) in joined:
            k, transfer = joined[id(n)]
            n.gid = b.add(n.name, "NCCL", p.rank, n.step, n.queue, 0.0, gap, pred_ids)
            if k not in xfer:
                xfer[k] = b.add(f"{n.name} (transfer)", "XFER", -1, n.step, None, transfer)
            b.preds[xfer[k]].append(n.gid)
            b.occupy(n.queue, xfer[k])
            n.done = xfer[k]
        else:
            n.gid = n.done = b.add(n.name, n.category, p.rank, n.step, n.queue, n.end - n.start, gap, pred_ids)
        qlast[n.queue] = n
        ends[n.queue][0].append(n.end)
        ends[n.queue][1].append(n)
    return dropped


def _closing_comm(ends: dict[str, tuple[list[float], list[_Node]]], start: float) -> _Node | None:
    """A collective on a CPU backend's thread that was running while a host thread sat idle (it resumes at
    ``start``) and whose annotation closed soon after the thread resumed (``COMM_CLOSES_LATE_US``, or
    ``COMM_CLOSES_LATE_SHARE`` of its length): what it waited for."""
    best = None
    for q, (times, nodes) in ends.items():
        if "/comm" not in q or not times:
            continue
        i = bisect.bisect_right(times, start) - 1 + 1  # the first that ended after the thread resumed
        if i >= len(times):
            continue
        n = nodes[i]
        late = max(COMM_CLOSES_LATE_US, COMM_CLOSES_LATE_SHARE * (n.end - n.start))
        if n.category == "COMM" and start < n.end <= start + late and n.start < start \
                and (best is None or n.end < best.end):
            best = n
    return best


def _same_gpu(a: str, b: str) -> bool:
    return a != b and a.split("/stream")[0] == b.split("/stream")[0]


def _latest_end(ends: dict[str, tuple[list[float], list[_Node]]], queues: list[str], own: str,
                after: float, before: float, near: float) -> _Node | None:
    """The node on another queue that ended last in (after, before], at most ``near`` before ``before``."""
    best = None
    for q in queues:
        if q == own or q not in ends:
            continue
        times, nodes = ends[q]
        i = bisect.bisect_right(times, before) - 1
        if i >= 0 and times[i] > after and before - times[i] <= near and (best is None or times[i] > best.end):
            best = nodes[i]
    return best


def _rank_info(p: _RankPlan, info: KinetoGraphInfo, b: GraphBuilder) -> None:
    kind = {"KERNEL": "compute", "MEMCPY": "memcpy", "MEMSET": "memcpy", "NCCL": "comm"}
    info.gpu_spans[p.rank] = [(n.gid, n.done, kind[n.category]) for n in p.nodes if n.category in kind]
    info.host_spans[p.rank] = [n.gid for n in p.nodes if n.category == "CPU"]
    info.cpu_comm_spans[p.rank] = [n.gid for n in p.nodes if n.category == "COMM"]
    info.comm.update({n.gid: (n.op, n.nbytes) for n in p.nodes if n.category in ("NCCL", "COMM")})
    info.node_at.update({(p.rank, n.queue, n.start): n.gid for n in p.nodes if n.category in ("CPU", "COMM")})
    info.nccl_kernels[p.rank] = sum(n.category == "NCCL" for n in p.nodes)
    for i, w in enumerate(p.windows):
        gpu = p.gpu_by_step.get(i, [])
        info.step_begin[(p.rank, i)] = p.begin[i].gid
        b.step_end[(p.rank, i)] = p.end[i].gid
        info.step_gpu[(p.rank, i)] = [n.done for n in gpu]
        info.measured_host_us[(p.rank, i)] = w.dur
        info.step_ts[(p.rank, i)] = w.ts
        if gpu:
            info.measured_device_us[(p.rank, i)] = max(n.end for n in gpu) - w.ts
    if p.skipped_threads:
        info.notes.append(f"rank {p.rank}: threads {p.skipped_threads} only poll CUDA (e.g. the NCCL watchdog): "
                          "left out")
