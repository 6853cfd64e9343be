"""Read PyTorch profiler (Kineto) traces: ``load_kineto`` reads one Chrome trace (``*.json`` or ``*.json.gz``, one
file per rank) into a ``KinetoTrace`` (its profiled steps, operators, GPU ops, collectives), validated;
``load_traces`` reads one per rank. The graph of the traces is ``dpro.dag.kineto``; their replay and what-ifs are
``dpro.analyze.traces``. This module imports no framework: json, gzip and numpy only.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpro.errors import TraceError
from dpro.io.limits import WORLD_SIZE_ENV, is_finite_number, parse_bounded_json, read_file, world_size_limit
from dpro.io.pool import collector_paused, jobs_wanted, map_ordered

__all__ = [
    "Collective",
    "KinetoTrace",
    "StepWindow",
    "TRACES_DIR",
    "correlation",
    "cpu_comm_message",
    "device_of",
    "is_nccl",
    "load_kineto",
    "load_traces",
    "run_trace_files",
    "short_name",
    "stream_of",
]

STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
NO_STEPS = ("cannot find the training steps: no ProfilerStep#N annotations; record with "
            "torch.profiler.profile(schedule=...) and call prof.step()")
CPU_CATS = {"cpu_op", "operator"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "runtime"}
GPU_CATS = {"kernel": "KERNEL", "gpu_memcpy": "MEMCPY", "memcpy": "MEMCPY", "gpu_memset": "MEMSET",
            "memset": "MEMSET"}
DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
               "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "char": 1, "int8": 1,
               "byte": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
# collectives run on a CPU backend's own threads, recorded as user annotations ("gloo:all_reduce")
CPU_COMM_NAME = re.compile(r"^(gloo|mpi|ucc):")


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
        return [e for e in self.gpu_ops if is_nccl(e)]

    def collectives(self) -> list[Collective]:
        """The NCCL kernels in time order, with sizes from their args (or from ``record_param_comms``)."""
        comms = _comm_ops_by_tid(self.cpu_ops)
        launches = {correlation(e): e for e in self.runtime if correlation(e) is not None}
        out = []
        for k in sorted(self.nccl_kernels, key=lambda e: e["ts"]):
            args = dict(k.get("args") or {})
            if "In msg nelems" not in args:
                args = {**_enclosing_comm_args(comms, launches.get(correlation(k))), **args}
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
    return read_file(path, TraceError)  # gunzipped


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
    return int(value) if is_finite_number(value) else None


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

def correlation(ev: dict[str, Any] | None) -> Any:
    return (ev.get("args") or {}).get("correlation") if ev else None


def is_nccl(ev: dict[str, Any]) -> bool:
    return str(ev.get("cat", "")).lower() == "kernel" and "nccl" in str(ev.get("name", "")).lower()


def stream_of(ev: dict[str, Any]) -> int:
    value = (ev.get("args") or {}).get("stream", ev.get("tid"))
    return int(value) if _is_number(value) else 0


def device_of(ev: dict[str, Any]) -> int:
    value = (ev.get("args") or {}).get("device", ev.get("pid"))
    return int(value) if _is_number(value) else 0


def short_name(name: str) -> str:
    """A kernel or op name without ``void``, template arguments and parameters (at most 80 characters)."""
    s = name.strip()
    if s.startswith("void "):
        s = s[5:]
    cuts = [i for i in (s.find("<"), s.find("(")) if i > 0]
    return s[:min(cuts)].strip()[:80] if cuts else s[:80]


def cpu_comm_message(ev: dict[str, Any]) -> tuple[str, int]:
    """A CPU backend's collective annotation (``gloo:all_reduce``): its operation and its bytes, from the input's
    dims and type (``record_shapes=True``) or ``In msg nelems`` and ``dtype``; 0 bytes when the trace says neither."""
    args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
    op = str(ev.get("name", "")).split(":", 1)[-1]
    dims, types = args.get("Input Dims"), args.get("Input type")
    total = 0
    if isinstance(dims, list) and isinstance(types, list):
        for shape, dtype in zip(dims, types, strict=False):
            width = DTYPE_BYTES.get(str(dtype).lower(), 0)
            if isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
                total += width * math.prod(shape)
    if not total:
        n, width = _opt_int(args.get("In msg nelems")), DTYPE_BYTES.get(str(args.get("dtype", "")).lower(), 0)
        total = (n or 0) * width
    return op, max(0, int(total))


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
        device=device_of(k), stream=stream_of(k), ts=k["ts"], dur=k["dur"], in_nelems=n_in, out_nelems=n_out,
        dtype=dtype, bytes=n * width if width and n else None, group_size=_opt_int(args.get("Group size")))


PARALLEL_BYTES = 16 * 2**20  # traces together this big are parsed on several cores (unless jobs is given)


def load_traces(paths: list[Path], *, jobs: int | None = None) -> list[KinetoTrace]:
    """``load_kineto`` of each path, with progress when the files together are big (seconds to read), in ``jobs``
    processes (``dpro.io.pool.jobs_wanted``; by default once they hold ``PARALLEL_BYTES``); the first bad file in
    ``paths``' order is the error, as read one after another."""
    from dpro.io.load import PROGRESS_BYTES
    from dpro.progress import Progress

    size = sum(Path(p).stat().st_size for p in paths if Path(p).is_file())
    workers = min(jobs_wanted(jobs), max(1, len(paths)))
    if jobs is None and size < PARALLEL_BYTES:
        workers = 1
    traces = []
    with Progress(len(paths), "loading traces", quiet=None if size >= PROGRESS_BYTES // 4 else True) as bar:
        with collector_paused():
            for p, trace in zip(paths, map_ordered(load_kineto, list(paths), workers), strict=True):
                traces.append(trace)
                bar.advance(note=Path(p).name)
    return traces


TRACES_DIR = "traces"  # a run directory recorded by the profiler keeps its ranks' traces here


def run_trace_files(run_dir: str | Path) -> list[Path]:
    """The profiler traces a run directory holds in place of dpro's own rank files (a run recorded by the
    profiler, such as an FSDP job's: ``traces/rank-<r>.json``), by rank; empty for any other directory."""
    root = Path(run_dir)
    if not root.is_dir() or any(root.glob("rank-*.json")):
        return []
    found = []
    for path in (root / TRACES_DIR).glob("rank-*.json"):
        rank = path.name[len("rank-"):-len(".json")]
        if rank.isdigit():
            found.append((int(rank), path))
    return [path for _, path in sorted(found)]
