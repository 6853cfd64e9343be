"""Read PyTorch profiler (Kineto) traces and predict their step time by replaying a DAG.

``load_kineto`` reads one Chrome trace (``*.json`` or ``*.json.gz``, one file per rank) into a
``KinetoTrace``; ``graph_from_kineto`` turns the profiled steps of one or more ranks into a
``dpro.dag.graph.Graph``; ``analyze_kineto`` replays it and reports an ``Analysis`` (``dpro analyze FILE``).

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

Prediction: the replayed span of ``ProfilerStep#N`` (begin marker to the end of the step's last host op:
the definition of the measured step) and, beside it, the time until the step's last GPU op ends.
This module imports no framework: json, gzip and numpy only.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpro.analyze import Analysis, critical_ops, error_pct, overlap_length, total_length, union_intervals
from dpro.dag.graph import Graph, GraphBuilder
from dpro.errors import GraphError, TraceError, UsageError
from dpro.io.limits import WORLD_SIZE_ENV, parse_bounded_json, read_bounded, world_size_limit
from dpro.sim.replay import Schedule, plan_levels, replay

__all__ = [
    "AnalyzedTraces",
    "Collective",
    "KinetoGraphInfo",
    "KinetoTrace",
    "StepWindow",
    "analyze_kineto",
    "analyze_traces",
    "graph_from_kineto",
    "load_kineto",
    "held_out_steps",
    "mean_graph",
    "mean_step_graph",
    "measured_step_ms",
    "op_keys",
    "replayed_step_ms",
    "replay_traces",
    "short_name",
    "split_prediction",
    "whatif_traces",
]

STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
NO_STEPS = ("cannot find the training steps: no ProfilerStep#N annotations; record with "
            "torch.profiler.profile(schedule=...) and call prof.step()")
CPU_CATS = {"cpu_op", "operator"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "runtime"}
GPU_CATS = {"kernel": "KERNEL", "gpu_memcpy": "MEMCPY", "memcpy": "MEMCPY", "gpu_memset": "MEMSET",
            "memset": "MEMSET"}
DEVICE_SYNC = {"cudaDeviceSynchronize", "cuCtxSynchronize", "cudaFree", "cuMemFree", "cuMemFree_v2"}
ONE_SYNC = {"cudaStreamSynchronize", "cudaEventSynchronize", "cuStreamSynchronize", "cuEventSynchronize",
            "cudaMemcpy", "cudaMemcpy2D", "cudaMemcpy3D", "cudaMemcpyToSymbol", "cudaMemcpyFromSymbol",
            "cudaMemcpyPeer", "cuMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2"}
DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
               "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "char": 1, "int8": 1,
               "byte": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
EPS_US = 2.0            # CPU and GPU clocks in one trace agree to about this much
LONG_CALL_US = 50.0     # a launch call this long may be blocked on a full launch queue
HANDOFF_US = 50.0       # a host thread idle this long may be waiting for another thread
# a CPU backend's collective annotation closes after it has woken the thread waiting for it (gloo: seen up to 4 ms,
# 1.6% of a 250 ms allreduce): by this much, or this share of the collective, whichever is more
COMM_CLOSES_LATE_US, COMM_CLOSES_LATE_SHARE = 3000.0, 0.05
# collectives run on a CPU backend's own threads, recorded as user annotations ("gloo:all_reduce")
CPU_COMM_NAME = re.compile(r"^(gloo|mpi|ucc):")
XSTREAM_GAP_US = 5.0    # a GPU op this late after its own predecessors may wait for another stream ...
XSTREAM_NEAR_US = 10.0  # ... when an op on another stream ended at most this long before it started
WARMUP_FACTOR = 1.5


# ---- loading ------------------------------------------------------------------------------------

@dataclass
class StepWindow:
    """One ``ProfilerStep#N`` annotation: the measured step (µs, the trace's clock)."""

    number: int
    ts: float
    dur: float

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class Collective:
    """One NCCL kernel with what the trace says about its message."""

    kernel: str
    op: str
    process_group: str
    device: int
    stream: int
    ts: float
    dur: float
    in_nelems: int | None
    out_nelems: int | None
    dtype: str | None
    bytes: int | None
    group_size: int | None


@dataclass
class KinetoTrace:
    """One rank's PyTorch profiler trace, its events sorted into kinds (ts/dur in µs floats)."""

    path: Path
    rank: int | None
    world_size: int | None
    backend: str | None
    base_time_ns: int | None
    steps: list[StepWindow]
    main_tid: Any
    cpu_ops: list[dict[str, Any]]
    annotations: list[dict[str, Any]]
    runtime: list[dict[str, Any]]
    gpu_ops: list[dict[str, Any]]
    gpu_annotations: list[dict[str, Any]]
    flows: dict[Any, dict[str, dict[str, Any]]] = field(default_factory=dict)   # ac2g id -> {"s": ev, "f": ev}
    devices: list[dict[str, Any]] = field(default_factory=list)
    cpu_comms: list[dict[str, Any]] = field(default_factory=list)  # collectives on a CPU backend's threads

    @property
    def nccl_kernels(self) -> list[dict[str, Any]]:
        return [e for e in self.gpu_ops if _is_nccl(e)]

    def collectives(self) -> list[Collective]:
        """The NCCL kernels in time order, with sizes from their args (or from ``record_param_comms``)."""
        comms = _comm_ops_by_tid(self.cpu_ops)
        launches = {_corr(e): e for e in self.runtime if _corr(e) is not None}
        out = []
        for k in sorted(self.nccl_kernels, key=lambda e: e["ts"]):
            args = dict(k.get("args") or {})
            if "In msg nelems" not in args:
                args = {**_enclosing_comm_args(comms, launches.get(_corr(k))), **args}
            out.append(_collective(k, args))
        return out


def load_kineto(path: str | Path) -> KinetoTrace:
    """Read one Kineto Chrome trace (``.json`` or ``.json.gz``).

    Raises:
        TraceError: unreadable file, bad gzip, not JSON or truncated, no ``traceEvents``, an ``X`` event
            without numeric ``ts``/``dur``, or no ``ProfilerStep#N`` annotation.
    """
    path = Path(path)
    doc = _parse_json(path, _read_bytes(path))
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(path, "no traceEvents list: not a PyTorch profiler (Kineto) trace")
    trace = _sort_events(path, doc["traceEvents"])
    dist = doc.get("distributedInfo") or {}
    if not isinstance(dist, dict):
        raise TraceError(path, f"'distributedInfo' must be an object, found {type(dist).__name__}")
    trace.rank = _opt_int(dist.get("rank"))
    trace.world_size = _opt_int(dist.get("world_size"))
    if trace.rank is not None and not 0 <= trace.rank < world_size_limit():
        raise TraceError(path, f"distributedInfo.rank {trace.rank} is not a rank")
    if trace.world_size is not None and not 0 < trace.world_size <= world_size_limit():
        raise TraceError(path, f"distributedInfo.world_size {trace.world_size} is not a world size (1.."
                               f"{world_size_limit():,}, ${WORLD_SIZE_ENV})")
    backend = dist.get("backend")
    trace.backend = backend if isinstance(backend, str) else None
    trace.base_time_ns = _opt_int(doc.get("baseTimeNanoseconds"))
    devices = doc.get("deviceProperties") or []
    if not isinstance(devices, list):
        raise TraceError(path, f"'deviceProperties' must be a list of devices, found {type(devices).__name__}")
    trace.devices = [d for d in devices if isinstance(d, dict)]
    return trace


def _read_bytes(path: Path) -> bytes:
    try:
        return read_bounded(path, TraceError)  # gunzipped
    except OSError as err:
        raise TraceError(path, f"cannot be read: {err.strerror or err}") from err


def _parse_json(path: Path, raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TraceError(path, f"not JSON: not UTF-8 text (byte {err.start})") from err
    if not text.strip():
        raise TraceError(path, "not JSON: the file is empty")
    try:
        return parse_bounded_json(text, path, TraceError)
    except json.JSONDecodeError as err:
        at = f"line {err.lineno}, column {err.colno}"
        if not text[err.pos:].strip() or err.msg.startswith("Unterminated string"):
            raise TraceError(path, f"truncated JSON: the document ends too early ({err.msg})", at) from err
        raise TraceError(path, f"not JSON: {err.msg}", at) from err


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _opt_int(value: Any) -> int | None:
    return int(value) if _is_number(value) and math.isfinite(value) else None


def _sort_events(path: Path, events: list[Any]) -> KinetoTrace:
    """Validate the events and sort them by kind; find the ProfilerStep windows."""
    kinds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    flows: dict[Any, dict[str, dict[str, Any]]] = defaultdict(dict)
    flow_at: dict[tuple[Any, Any, float], Any] = {}
    steps: dict[int, StepWindow] = {}
    step_tids: Counter = Counter()
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise TraceError(path, f"an event is {type(ev).__name__}, not an object", f"traceEvents[{i}]")
        _check_ids(path, ev, i)
        ph, cat = ev.get("ph"), str(ev.get("cat", "")).lower()
        if ph in ("s", "f") and cat == "ac2g" and _is_number(ev.get("ts")):
            flows[ev.get("id")][ph] = ev
            flow_at[(ev.get("pid"), ev.get("tid"), round(float(ev["ts"]), 3))] = ev.get("id")
        if ph != "X":
            continue
        _check_x(path, ev, i)
        name = str(ev.get("name", ""))
        m = STEP_NAME.match(name)
        if m and cat != "gpu_user_annotation":
            steps.setdefault(int(m.group(1)), StepWindow(int(m.group(1)), ev["ts"], ev["dur"]))
            step_tids[ev.get("tid")] += 1
        elif cat in CPU_CATS:
            kinds["cpu"].append(ev)
        elif cat == "user_annotation" and CPU_COMM_NAME.match(name):
            kinds["cpu_comm"].append(ev)
        elif cat == "user_annotation":
            kinds["ann"].append(ev)
        elif cat in RUNTIME_CATS:
            kinds["rt"].append(ev)
        elif cat in GPU_CATS:
            kinds["gpu"].append(ev)
        elif cat == "gpu_user_annotation":
            kinds["gpu_ann"].append(ev)
    if not steps:
        raise TraceError(path, NO_STEPS)
    _fill_correlations(kinds["rt"] + kinds["gpu"], flow_at)
    return KinetoTrace(
        path=path, rank=None, world_size=None, backend=None, base_time_ns=None,
        steps=[steps[n] for n in sorted(steps)], main_tid=step_tids.most_common(1)[0][0],
        cpu_ops=kinds["cpu"], annotations=kinds["ann"], runtime=kinds["rt"], gpu_ops=kinds["gpu"],
        gpu_annotations=kinds["gpu_ann"], flows=dict(flows), cpu_comms=kinds["cpu_comm"])


def _fill_correlations(events: list[dict[str, Any]], flow_at: dict[tuple[Any, Any, float], Any]) -> None:
    """Runtime calls and GPU ops without ``args.correlation`` take it from their ``ac2g`` flow event."""
    for ev in events:
        args = ev.setdefault("args", {})
        if isinstance(args, dict) and args.get("correlation") is None:
            cid = flow_at.get((ev.get("pid"), ev.get("tid"), round(ev["ts"], 3)))
            if cid is not None:
                args["correlation"] = cid


def _check_ids(path: Path, ev: dict[str, Any], i: int) -> None:
    """pid, tid, a flow's id and args.correlation key the reader's tables: each must be a number or a name."""
    args = ev.get("args")
    for key, value in (("pid", ev.get("pid")), ("tid", ev.get("tid")), ("id", ev.get("id")),
                       ("args.correlation", args.get("correlation") if isinstance(args, dict) else None)):
        if value is not None and not isinstance(value, int | float | str):
            raise TraceError(path, f"'{key}' must be a number or a name, found {type(value).__name__}",
                             f"traceEvents[{i}] {str(ev.get('name', '?'))[:60]!r}")


def _check_x(path: Path, ev: dict[str, Any], i: int) -> None:
    for key in ("ts", "dur"):
        if not _is_number(ev.get(key)):
            raise TraceError(path, f"event has no numeric '{key}' (every 'X' event needs ts and dur in µs)",
                             f"traceEvents[{i}] {str(ev.get('name', '?'))[:60]!r}")
    ev["ts"] = float(ev["ts"])
    ev["dur"] = max(0.0, float(ev["dur"]))


# ---- event helpers --------------------------------------------------------------------------------

def _corr(ev: dict[str, Any] | None) -> Any:
    return (ev.get("args") or {}).get("correlation") if ev else None


def _is_nccl(ev: dict[str, Any]) -> bool:
    return str(ev.get("cat", "")).lower() == "kernel" and "nccl" in str(ev.get("name", "")).lower()


def _stream(ev: dict[str, Any]) -> int:
    value = (ev.get("args") or {}).get("stream", ev.get("tid"))
    return int(value) if _is_number(value) else 0


def _device(ev: dict[str, Any]) -> int:
    value = (ev.get("args") or {}).get("device", ev.get("pid"))
    return int(value) if _is_number(value) else 0


def short_name(name: str) -> str:
    """A kernel or op name without ``void``, template arguments and parameters (at most 80 characters)."""
    s = name.strip()
    if s.startswith("void "):
        s = s[5:]
    cuts = [i for i in (s.find("<"), s.find("(")) if i > 0]
    return s[:min(cuts)].strip()[:80] if cuts else s[:80]


def _comm_ops_by_tid(cpu_ops: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in cpu_ops:
        if e.get("name") == "record_param_comms":
            out[e.get("tid")].append(e)
    for ops in out.values():
        ops.sort(key=lambda e: e["ts"])
    return out


def _enclosing_comm_args(comms: dict[Any, list[dict[str, Any]]], launch: dict[str, Any] | None) -> dict:
    """Args of the ``record_param_comms`` op around a launch call (sizes for older traces)."""
    if launch is None:
        return {}
    ops = comms.get(launch.get("tid"), [])
    i = bisect.bisect_right([e["ts"] for e in ops], launch["ts"]) - 1
    if i >= 0 and ops[i]["ts"] + ops[i]["dur"] >= launch["ts"]:
        return dict(ops[i].get("args") or {})
    return {}


def _collective(k: dict[str, Any], args: dict[str, Any]) -> Collective:
    m = re.search(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", str(k.get("name", "")))
    op = str(args.get("Collective name") or (m.group(1) if m else "nccl")).lower()
    dtype = args.get("dtype")
    n_in, n_out = _opt_int(args.get("In msg nelems")), _opt_int(args.get("Out msg nelems"))
    width = DTYPE_BYTES.get(str(dtype).lower()) if dtype else None
    n = max(x for x in (n_in, n_out, 0) if x is not None)
    return Collective(
        kernel=short_name(str(k.get("name", ""))), op=op,
        process_group=str(args.get("Process Group Name", args.get("Process Group ID", "default"))),
        device=_device(k), stream=_stream(k), ts=k["ts"], dur=k["dur"], in_nelems=n_in, out_nelems=n_out,
        dtype=dtype, bytes=n * width if width and n else None, group_size=_opt_int(args.get("Group size")))


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
    op: str = ""                   # NCCL: collective name
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
        by_corr[_corr(op)].append(op)
    by_corr.pop(None, None)
    # a correlation id names one runtime call; one shared by several cannot tell which launched what (and linking
    # every sharer to every GPU op would take calls x ops): such ids link nothing
    calls_per_id = Counter(_corr(r) for r in trace.runtime)
    shared = [c for c in by_corr if calls_per_id.get(c, 0) > 1]
    for c in shared:
        del by_corr[c]
    host_tids, skipped = _host_threads(trace, by_corr)
    launch_ts = {_corr(r): r["ts"] for r in trace.runtime if r.get("tid") in host_tids and _corr(r) in by_corr}
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
            nodes.append(_Node(str(ev.get("name", "")), "COMM", queue, ev["ts"], ev["ts"] + ev["dur"], step))
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
    busy = {e.get("tid") for e in trace.cpu_ops} | {r.get("tid") for r in trace.runtime if _corr(r) in by_corr}
    busy.add(trace.main_tid)
    others = {r.get("tid") for r in trace.runtime} - busy
    return [trace.main_tid] + sorted(busy - {trace.main_tid}, key=str), sorted(others, key=str)


def _gpu_nodes(trace: KinetoTrace, rank: int, step_of: _StepOf,
               launch_ts: dict[Any, float]) -> tuple[list[_Node], dict[int, _Node]]:
    """One node per GPU op, assigned to the step its launch lies in (its own start if unlaunched)."""
    nodes, of = [], {}
    comm_args = {}
    if any(_is_nccl(e) for e in trace.gpu_ops):
        comm_args = {id(k): c for k, c in zip(sorted(trace.nccl_kernels, key=lambda e: e["ts"]),
                                               trace.collectives(), strict=True)}
    for op in trace.gpu_ops:
        launched = launch_ts.get(_corr(op))
        step = step_of(op["ts"] if launched is None else launched)
        if step is None:
            continue
        cat = "NCCL" if _is_nccl(op) else GPU_CATS[str(op.get("cat")).lower()]
        n = _Node(short_name(str(op.get("name", ""))), cat, f"r{rank}/gpu{_device(op)}/stream{_stream(op)}",
                  op["ts"], op["ts"] + op["dur"], step, prio=2,
                  launch_ts=op["ts"] if launched is None else launched)
        if id(op) in comm_args:
            c = comm_args[id(op)]
            n.pg, n.op = c.process_group, c.op
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
                    (_corr(r) in by_corr or r.get("name") in DEVICE_SYNC or r.get("name") in ONE_SYNC)),
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
        launched = [gpu_of[id(op)] for op in by_corr.get(_corr(call), []) if id(op) in gpu_of]
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


# ---- prediction ------------------------------------------------------------------------------------

def host_step_us(g: Graph, sched: Schedule, info: KinetoGraphInfo, key: tuple[int, int]) -> float:
    """The replayed ProfilerStep span of (rank, iteration): its begin marker's start to its end marker's end."""
    return float(sched.end[g.step_end[key]] - sched.start[info.step_begin[key]])


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


def _used_iterations(info: KinetoGraphInfo, notes: list[str]) -> list[int]:
    """All iterations, less a first warm-up step longer than 1.5x the median of the others."""
    its = list(range(len(info.steps)))
    per_it = [statistics.median(info.measured_host_us[(r, i)] for r in info.ranks) for i in its]
    if len(its) >= 3 and per_it[0] > WARMUP_FACTOR * statistics.median(per_it[1:]):
        notes.append(f"warm-up step ProfilerStep#{info.steps[0]} ({per_it[0] / 1000:.2f} ms, more than "
                     f"{WARMUP_FACTOR}x the median of the others) is left out of measured and predicted times")
        return its[1:]
    return its


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
    its = _used_iterations(info, notes)
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
    (a gloo allreduce that takes 4 ms in one step and 18 in the next) add up to no step (-11% on a 2-rank gloo
    trace where the means give +0.9%)."""
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
    result.update({"measured_step_ms": measured_step_ms(info, its),
                   "baseline_predicted_step_ms": replayed_step_ms(base, info, its),
                   "predicted_step_ms": replayed_step_ms(changed, changed_info, its)})
    return result


def mean_step_graph(traces: list[KinetoTrace]) -> tuple[Graph, KinetoGraphInfo, list[int]]:
    """The traces' graph with every op at its mean over the profiled steps (what-if's baseline), its info and the
    iterations used (a long warm-up step left out)."""
    g, info = graph_from_kineto(traces)
    its = _used_iterations(info, [])
    return mean_graph(g, op_keys(g), set(its)), info, its


def replayed_step_ms(g: Graph, info: KinetoGraphInfo, its: list[int]) -> float:
    """The median host step (ms) over the ranks and iterations ``its`` of ``g`` replayed."""
    sched = replay(g)
    return statistics.median(host_step_us(g, sched, info, (r, i)) for r in info.ranks for i in its) / 1000.0


def measured_step_ms(info: KinetoGraphInfo, its: list[int]) -> float:
    """The median measured ProfilerStep (ms) over the ranks and iterations ``its``."""
    return statistics.median(info.measured_host_us[(r, i)] for r in info.ranks for i in its) / 1000.0


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


def analyze_kineto(paths: list[Path], steps: list[int] | None = None) -> Analysis:
    """``dpro analyze FILE...``: load one Kineto trace per rank, replay, report (see ``analyze_traces``)."""
    return analyze_traces(load_traces(paths), steps)


def load_traces(paths: list[Path]) -> list[KinetoTrace]:
    """``load_kineto`` of each path, with progress when the files together are big (seconds to read)."""
    from dpro.io.load import PROGRESS_BYTES
    from dpro.progress import Progress

    size = sum(Path(p).stat().st_size for p in paths if Path(p).is_file())
    traces = []
    with Progress(len(paths), "loading traces", quiet=None if size >= PROGRESS_BYTES // 4 else True) as bar:
        for p in paths:
            traces.append(load_kineto(p))
            bar.advance(note=Path(p).name)
    return traces
