"""Horovod timelines (``HOROVOD_TIMELINE``): read them, find the fused buffers, merge them into a run.

A Horovod timeline is a JSON array of Chrome trace events written by rank 0 (the coordinator) only.
Each tensor is a "process" (``pid``) whose ``process_name`` metadata event names the tensor; its
life is a sequence of nested ``B``/``E`` phases::

    NEGOTIATE_ALLREDUCE                 from rank 0 taking the request to every rank being ready
    ALLREDUCE                           the operation, containing activities:
        MEMCPY_IN_FUSION_BUFFER           copy into the fusion buffer (fused tensors only)
        GLOO_ALLREDUCE (MPI_/NCCL_...)    the transfer
        MEMCPY_OUT_FUSION_BUFFER          copy out again

``ts`` are microseconds since the timeline started (``hvd.init()``, or ``hvd.start_timeline``) on
CLOCK_MONOTONIC; the ``process_name`` event of pid 0 holds ``start_time_since_epoch_in_micros``.
Horovod closes the array after every event, but a killed job can leave the file cut anywhere, so the
reader takes every complete event and reports the cut (``Timeline.truncated``).

Tensors whose ALLREDUCE phases overlap were fused into one buffer: Horovod opens the ALLREDUCE
phase of every tensor of a response before it runs the response, and closes them all afterwards,
and it runs one response at a time (``fused_groups``).

``merge_horovod_timeline(run)`` (called by ``dpro.engines.prepared`` when the run holds
``horovod-timeline.json``) places the timeline on rank 0's clock and gives each of the recorder's
per-tensor ``COMM.<tensor>.allreduce`` events the end of the fused buffer the tensor went in (the
recorder sees a completion only at its next poll) and the buffer's index, size and phases. Names do
not depend on fusion, which Horovod decides from timing and which differs from step to step, so
every profiled step enters the mean step; tensors fused with the one before them end with it
(an empty transfer in the DAG).

Clock: the recorder stores a (wall clock, rank clock) pair in run.json, which with the timeline's
start time on the wall clock gives the offset. Launch and completion times bound it (an operation
ends after its launch and before the recorder saw it complete); without the pair (a hand-made run)
the operations' ends are matched to the completions the recorder saw.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpro.dag.align import align
from dpro.errors import TraceError
from dpro.io.limits import is_finite_number, parse_bounded_json, read_file

if TYPE_CHECKING:
    from dpro.io.load import Run

__all__ = [
    "TIMELINE_FILE",
    "FusedGroup",
    "TensorOp",
    "Timeline",
    "find_timeline",
    "fused_groups",
    "merge_horovod_timeline",
    "parse_timeline_text",
    "read_block_timelines",
    "read_timeline",
    "tensor_ops",
    "timeline_file",
]

TIMELINE_FILE = "horovod-timeline.json"
PROBE_PREFIX = "dpro.probe."
_SIZES = {"uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "float32": 4,
          "float64": 8, "bool": 1, "bfloat16": 2}
DTYPE_BYTES = {**_SIZES, **{f"HOROVOD_{k.upper()}": v for k, v in _SIZES.items()}}  # Horovod writes "float32"
MATCH_TOLERANCE_US = 500.0   # clock noise allowed when pairing timeline operations with recorded launches
_GROUPED = re.compile(r"(.+)_(\d+)of(\d+)")
_OP_PREFIXES = ("allreduce", "grouped_allreduce", "broadcast", "allgather", "grouped_allgather", "alltoall",
                "reducescatter", "grouped_reducescatter")


@dataclass
class TensorOp:
    """One collective of one tensor: its negotiation, the operation and the activities inside it (µs)."""

    tensor: str
    op: str                                   # ALLREDUCE, BROADCAST, ALLGATHER, ...
    start: float                              # the operation phase (e.g. ALLREDUCE) B .. E
    end: float
    negotiate: tuple[float, float] | None = None
    activities: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (first start, last end)
    activity_us: dict[str, float] = field(default_factory=dict)               # name -> summed duration
    nbytes: int | None = None                 # from the dtype and shape Horovod writes at the end
    ranks_ready: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """The name the tensor was launched under: Horovod writes ``allreduce.<name>`` (and
        ``grouped_allreduce.<name>_2of5`` for the second tensor of a grouped allreduce)."""
        match = _GROUPED.fullmatch(self.tensor)
        name = match.group(1) if match and match.group(1).startswith("grouped_") else self.tensor
        prefix, dot, rest = name.partition(".")
        return rest if dot and prefix in _OP_PREFIXES else name

    @property
    def index_in_launch(self) -> int:
        match = _GROUPED.fullmatch(self.tensor)
        return int(match.group(2)) - 1 if match and match.group(1).startswith("grouped_") else 0


@dataclass
class FusedGroup:
    """Tensors Horovod reduced in one fused buffer (one response)."""

    op: str
    members: list[TensorOp]

    @property
    def start(self) -> float:
        return min(m.start for m in self.members)

    @property
    def end(self) -> float:
        return max(m.end for m in self.members)

    @property
    def tensors(self) -> list[str]:
        return [m.tensor for m in self.members]

    @property
    def nbytes(self) -> int | None:
        sizes = [m.nbytes for m in self.members]
        return None if any(s is None for s in sizes) else sum(sizes)

    def phases(self) -> dict[str, float]:
        """negotiate (the last tensor's negotiation), queue (negotiated -> operation), the activities, total."""
        out: dict[str, float] = {}
        negotiations = [m.negotiate for m in self.members if m.negotiate is not None]
        if negotiations:
            last_start = max(n[0] for n in negotiations)
            last_end = max(n[1] for n in negotiations)
            out["negotiate_us"] = max(0.0, last_end - last_start)
            out["queue_us"] = max(0.0, self.start - last_end)
        activity: dict[str, float] = defaultdict(float)
        for m in self.members:
            for name, us in m.activity_us.items():
                activity[name] = max(activity[name], us)
        for name, us in activity.items():
            label = ("memcpy_in_us" if name == "MEMCPY_IN_FUSION_BUFFER" else
                     "memcpy_out_us" if name == "MEMCPY_OUT_FUSION_BUFFER" else
                     "allreduce_us" if name.endswith("_ALLREDUCE") else f"{name.lower()}_us")
            out[label] = out.get(label, 0.0) + us
        out["operation_us"] = self.end - self.start
        return out


@dataclass
class Timeline:
    """A parsed timeline: tensor operations, fused groups, and what was wrong with the file."""

    path: Path
    ops: list[TensorOp]
    groups: list[FusedGroup]
    start_epoch_us: float | None
    truncated: bool
    incomplete: int                # operations still open where the file ends
    cycles: list[float] = field(default_factory=list)   # CYCLE_START markers (HOROVOD_TIMELINE_MARK_CYCLES)


# ---- reading -------------------------------------------------------------------------------------


def parse_timeline_text(text: str, path: str | Path = "<timeline>") -> tuple[list[dict[str, Any]], bool]:
    """The events of a timeline and whether the file was cut off.

    Takes a complete JSON array, or an array without its closing bracket, with a trailing comma, or
    cut inside its last event (a killed job).

    Raises:
        TraceError: the text is empty, is not a JSON array of objects, or is broken before its end.
    """
    path = Path(path)
    stripped = text.strip()
    if not stripped:
        raise TraceError(path, "the Horovod timeline is empty (Horovod opens it in hvd.init() and writes "
                               "the first event when a tensor is negotiated)")
    try:
        doc = parse_bounded_json(stripped, path, TraceError)
    except json.JSONDecodeError:
        doc = None
    if doc is not None:
        if not isinstance(doc, list) or not all(isinstance(e, dict) for e in doc):
            raise TraceError(path, "a Horovod timeline must be a JSON array of event objects")
        return _checked(doc, path), False
    if not stripped.startswith("["):
        raise TraceError(path, "not a Horovod timeline: it must start with '[' (a JSON array of events)")
    decoder = json.JSONDecoder()
    events: list[dict[str, Any]] = []
    pos, n = 1, len(stripped)
    while True:
        while pos < n and stripped[pos] in " \t\r\n,":
            pos += 1
        if pos >= n:
            return _checked(events, path), True           # no closing bracket
        if stripped[pos] == "]":
            if stripped[pos + 1:].strip():
                raise TraceError(path, "text after the end of the event array", f"character {pos + 1}")
            return _checked(events, path), False
        try:
            event, end = decoder.raw_decode(stripped, pos)
        except json.JSONDecodeError as err:
            rest = stripped[pos:]
            if _parses_later(decoder, rest):
                raise TraceError(path, f"broken event in the middle of the timeline: {err.msg}",
                                 f"line {err.lineno}, column {err.colno}") from err
            return _checked(events, path), True           # cut inside the last event
        if not isinstance(event, dict):
            raise TraceError(path, f"an event must be an object, found {type(event).__name__}", f"event {len(events)}")
        events.append(event)
        pos = end


def _checked(events: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """The events, once each field the reader uses has its type: ``pid`` an integer or a name, ``ph`` and
    ``name`` text, ``ts``/``dur`` finite numbers, ``args`` an object, ``start_time_since_epoch_in_micros``
    a finite number.

    Raises:
        TraceError: naming the event and the field.
    """
    for i, ev in enumerate(events):
        where = f"event {i}"
        pid = ev.get("pid")
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (int, str))):
            raise TraceError(path, f"'pid' must be an integer, found {pid!r:.40}", where)
        for key in ("ph", "name"):
            if key in ev and not isinstance(ev[key], str):
                raise TraceError(path, f"{key!r} must be text, found {ev[key]!r:.40}", where)
        for key in ("ts", "dur"):
            if key in ev and not is_finite_number(ev[key]):
                raise TraceError(path, f"{key!r} must be a finite number of µs, found {ev[key]!r:.40}", where)
        args = ev.get("args")
        if args is not None and not isinstance(args, dict):
            raise TraceError(path, f"'args' must be an object, found {type(args).__name__}", where)
        start = (args or {}).get("start_time_since_epoch_in_micros")
        if start is not None and not is_finite_number(start):
            raise TraceError(path, f"args.start_time_since_epoch_in_micros must be a finite number, found "
                                   f"{start!r:.40}", where)
    return events


def _parses_later(decoder: json.JSONDecoder, rest: str) -> bool:
    """Whether a complete event follows a broken one (corruption, not a cut-off end)."""
    for match in re.finditer(r"\n\s*\{", rest):
        try:
            decoder.raw_decode(rest, match.end() - 1)
            return True
        except json.JSONDecodeError:
            continue
    return False


def tensor_ops(events: list[dict[str, Any]]) -> tuple[list[TensorOp], float | None, int, list[float]]:
    """Per-tensor operations from timeline events.

    Returns (operations in order of their start, the timeline's start on the wall clock in µs or None,
    the number of operations left open at the end of the file, CYCLE_START marker times).
    """
    names: dict[Any, str] = {}
    start_epoch: float | None = None
    stacks: dict[Any, list[tuple[str, float]]] = defaultdict(list)
    negotiated: dict[Any, tuple[float, float, dict[str, float]]] = {}
    ready: dict[Any, dict[str, float]] = defaultdict(dict)
    current: dict[Any, TensorOp] = {}
    ops: list[TensorOp] = []
    cycles: list[float] = []
    for ev in events:
        ph, pid = ev.get("ph"), ev.get("pid")
        if ph == "M":
            args = ev.get("args") or {}
            if ev.get("name") == "process_name":
                if "name" in args:
                    names[pid] = str(args["name"])
                if "start_time_since_epoch_in_micros" in args:
                    start_epoch = float(args["start_time_since_epoch_in_micros"])
            continue
        if ph == "i":
            if ev.get("name") == "CYCLE_START" and _num(ev.get("ts")):
                cycles.append(float(ev["ts"]))
            continue
        if not _num(ev.get("ts")):
            continue
        ts = float(ev["ts"])
        stack = stacks[pid]
        if ph == "B":
            name = str(ev.get("name", ""))
            if not stack and not name.startswith("NEGOTIATE_"):
                current[pid] = TensorOp(tensor=names.get(pid, str(pid)), op=name, start=ts, end=ts)
                if pid in negotiated:
                    n0, n1, rdy = negotiated.pop(pid)
                    current[pid].negotiate = (n0, n1)
                    current[pid].ranks_ready = rdy
            stack.append((name, ts))
        elif ph == "E":
            if not stack:
                continue                  # an end without a begin (timeline started mid-operation)
            name, t0 = stack.pop()
            if name.startswith("NEGOTIATE_") and not stack:
                negotiated[pid] = (t0, ts, ready.pop(pid, {}))
            elif not stack and pid in current:
                op = current.pop(pid)
                op.end = ts
                op.nbytes = _nbytes(ev.get("args") or {})
                ops.append(op)
            elif pid in current:
                op = current[pid]
                first = op.activities.get(name)
                op.activities[name] = (first[0] if first else t0, ts)
                op.activity_us[name] = op.activity_us.get(name, 0.0) + ts - t0
        elif ph == "X" and stack and stack[-1][0].startswith("NEGOTIATE_"):
            ready[pid][str(ev.get("name", ""))] = ts
    incomplete = sum(1 for s in stacks.values() if s)
    ops.sort(key=lambda o: o.start)
    return ops, start_epoch, incomplete, cycles


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _nbytes(args: dict[str, Any]) -> int | None:
    size = DTYPE_BYTES.get(str(args.get("dtype", "")))
    shape = args.get("shape")
    if size is None or not isinstance(shape, str):
        return None
    dims = [int(d) for d in re.findall(r"-?\d{1,18}", shape)]  # int() refuses over 4300 digits
    count = 1
    for d in dims:
        count *= max(d, 0)
    return count * size


def fused_groups(ops: list[TensorOp]) -> list[FusedGroup]:
    """Group operations that Horovod ran as one response (one fused buffer).

    Horovod opens the operation phase of every tensor of a response before running it and closes
    them after, and runs responses one after another, so a tensor belongs to the current group when
    its operation starts before the first member of the group ends.
    """
    groups: list[FusedGroup] = []
    by_op: dict[str, list[TensorOp]] = defaultdict(list)
    for op in ops:
        by_op[op.op].append(op)
    for kind, members in by_op.items():
        members.sort(key=lambda o: (o.start, o.end))
        group: list[TensorOp] = []
        first_end = float("inf")
        for op in members:
            if group and op.start < first_end:
                group.append(op)
                first_end = min(first_end, op.end)
            else:
                if group:
                    groups.append(FusedGroup(kind, group))
                group, first_end = [op], op.end
        if group:
            groups.append(FusedGroup(kind, group))
    groups.sort(key=lambda g: g.start)
    return groups


def read_timeline(path: str | Path) -> Timeline:
    """Read a Horovod timeline file into tensor operations and fused groups.

    Raises:
        TraceError: the file is unreadable, empty, not a timeline, or broken before its end.
    """
    path = Path(path)
    text = read_file(path, TraceError).decode("utf-8", errors="replace")
    events, truncated = parse_timeline_text(text, path)
    ops, start_epoch, incomplete, cycles = tensor_ops(events)
    return Timeline(path=path, ops=ops, groups=fused_groups(ops), start_epoch_us=start_epoch,
                    truncated=truncated, incomplete=incomplete, cycles=cycles)


def timeline_file(block: int) -> str:
    """The timeline file of a window's ``block``-th recorded block (1: ``horovod-timeline.json``; a recorder that
    restarts Horovod's timeline for each block writes ``horovod-timeline.2.json``, ... for the later ones)."""
    return TIMELINE_FILE if block <= 1 else TIMELINE_FILE.replace(".json", f".{block}.json")


def read_block_timelines(first: str | Path) -> Timeline:
    """``read_timeline`` of ``first`` and of the later blocks' files beside it (``timeline_file``), as one
    timeline. Each file counts its ``ts`` from its own start time (the header's epoch), so later files are
    moved onto the first one's."""
    first = Path(first)
    paths = [first]
    if first.name == TIMELINE_FILE:
        while (first.parent / timeline_file(len(paths) + 1)).is_file():
            paths.append(first.parent / timeline_file(len(paths) + 1))
    timelines = [read_timeline(p) for p in paths]
    if len(timelines) == 1:
        return timelines[0]
    base = timelines[0].start_epoch_us
    ops: list[TensorOp] = []
    cycles: list[float] = []
    for t in timelines:
        shift = (t.start_epoch_us - base) if base is not None and t.start_epoch_us is not None else 0.0
        ops += [_shifted(op, shift) for op in t.ops] if shift else t.ops
        cycles += [c + shift for c in t.cycles]
    return Timeline(path=first, ops=ops, groups=fused_groups(ops), start_epoch_us=base,
                    truncated=any(t.truncated for t in timelines), incomplete=sum(t.incomplete for t in timelines),
                    cycles=cycles)


def _shifted(op: TensorOp, shift: float) -> TensorOp:
    """``op`` with every time ``shift`` µs later."""
    return dataclasses.replace(
        op, start=op.start + shift, end=op.end + shift,
        negotiate=None if op.negotiate is None else (op.negotiate[0] + shift, op.negotiate[1] + shift),
        activities={k: (a + shift, b + shift) for k, (a, b) in op.activities.items()},
        ranks_ready={k: t + shift for k, t in op.ranks_ready.items()})


# ---- merging into a run --------------------------------------------------------------------------


def find_timeline(run: Run) -> Path | None:
    """The run's Horovod timeline: ``<run>/horovod-timeline.json``, else the path run.json names."""
    local = Path(run.path) / TIMELINE_FILE
    if local.is_file():
        return local
    named = ((run.meta or {}).get("horovod") or {}).get("timeline")
    if named and named != "DYNAMIC" and Path(named).is_file():
        return Path(named)
    return None


@dataclass
class _Launch:
    """A recorder's per-tensor COMM event (one launch of one Horovod name)."""

    rank: int
    key: str
    step: int
    launch: float
    done: float
    tensors: list[str]
    nbytes: int
    event: dict[str, Any]


def _launches(run: Run) -> dict[int, list[_Launch]]:
    out: dict[int, list[_Launch]] = defaultdict(list)
    for rank, trace in run.ranks.items():
        for ev in trace.events:
            args = ev["args"]
            if ev["cat"] == "COMM" and "hvd_name" in args:
                out[rank].append(_Launch(rank, str(args["hvd_name"]), args["step"], ev["ts"], ev["ts"] + ev["dur"],
                                         list(args.get("tensors", [])), int(args.get("bytes", 0)), ev))
    return out


def _match(ops_by_key: dict[str, list[TensorOp]], launches: list[_Launch], offset: float) -> dict[int, TensorOp]:
    """Pair each launch (index) with the operation of its name that ended between its launch and the
    completion the recorder saw (on rank 0's clock, given ``offset``), the one ending last."""
    pairs: dict[int, TensorOp] = {}
    by_key: dict[str, list[int]] = defaultdict(list)
    for i, launch in enumerate(launches):
        by_key[launch.key].append(i)
    for key, idxs in by_key.items():
        ops = ops_by_key.get(key, [])
        ends = [o.end + offset for o in ops]
        used: set[int] = set()
        for i in sorted(idxs, key=lambda i: launches[i].launch):
            lo, hi = launches[i].launch - MATCH_TOLERANCE_US, launches[i].done + MATCH_TOLERANCE_US
            j = bisect.bisect_right(ends, hi) - 1
            while j >= 0 and j in used:
                j -= 1
            if j >= 0 and ends[j] >= lo:
                pairs[i] = ops[j]
                used.add(j)
    return pairs


def _offset(timeline: Timeline, launches: list[_Launch],
            meta: dict[str, Any]) -> tuple[float | None, str, dict[int, TensorOp]]:
    """Offset (µs) from timeline time to rank 0's clock, how it was found, and the launch pairs.

    Candidates: the wall-clock pair of run.json; else the first launch's completion matched to each
    operation of its tensor. The candidate pairing the most launches wins; then the offset is kept
    within the bounds every pair sets (an operation ends after its launch and before the recorder saw
    it complete) or, without the wall clock, set to the upper bound (completion seen at once).
    Horovod's negotiation start is no anchor: on rank 0 it is written when any rank's request (or
    cache bit) reaches the coordinator, which may be before or long after rank 0's own launch.
    """
    ops_by_key: dict[str, list[TensorOp]] = defaultdict(list)
    for op in timeline.ops:
        if op.op == "ALLREDUCE":
            ops_by_key[op.key].append(op)
    for ops in ops_by_key.values():
        ops.sort(key=lambda o: o.end)
    clock = (meta.get("horovod") or {}).get("clock") or {}
    candidates: list[tuple[float, str]] = []
    if timeline.start_epoch_us is not None and _num(clock.get("wall_us")) and _num(clock.get("rank_us")):
        candidates.append((clock["rank_us"] - clock["wall_us"] + timeline.start_epoch_us, "wall clock"))
    else:
        for first in sorted(launches, key=lambda x: x.launch)[:1]:
            for op in ops_by_key.get(first.key, []):
                candidates.append((first.done - op.end, "completions matched"))
    best: tuple[int, float, str, dict[int, TensorOp]] | None = None
    for offset, method in candidates:
        pairs = _match(ops_by_key, launches, offset)
        if best is None or len(pairs) > best[0]:
            best = (len(pairs), offset, method, pairs)
    if best is None or not best[3]:
        return None, "no launch matched the timeline", {}
    _, offset, method, pairs = best
    lo = max(launches[i].launch - op.end for i, op in pairs.items())
    hi = min(launches[i].done - op.end for i, op in pairs.items())
    if method == "wall clock":
        if lo <= offset <= hi:
            method += f" (within the launch/completion bounds, {hi - lo:.0f} µs wide)"
        elif lo <= hi:
            offset = min(max(offset, lo), hi)
            method += " clamped to the launch/completion bounds"
        else:
            method += " (launch/completion bounds disagree)"
    elif lo <= hi:
        offset = hi
        method += ": the earliest completion seen coincides with its operation's end"
    return offset, method, _match(ops_by_key, launches, offset)


def merge_horovod_timeline(run: Run, path: str | Path | None = None) -> dict[str, Any] | None:
    """Merge the run's Horovod timeline into its traces (in memory); return a summary, or None.

    Every rank keeps one ``COMM.<tensor>.allreduce`` event per launched tensor (per explicit group
    with ``groups=``); the timeline corrects its end and says how it was fused. The recorder sees a
    completion only when it next polls (at the rank's next launch, or in ``synchronize()``), so its end
    can be milliseconds late; a tensor really completes when its fused buffer does: the timeline's end
    of the buffer (rank 0's clock) placed on the rank's clock, or the completion the rank saw if that
    is earlier. Each event gains ``buffer`` (index of its fused buffer within the step), ``fused``
    (tensors in the buffer), ``buffer_bytes``, ``buffer_tensors`` and Horovod's phases of the buffer in
    µs (``negotiate_us``, ``queue_us``, ``memcpy_in_us``, ``allreduce_us``, ``memcpy_out_us``,
    ``operation_us``), and keeps what the recorder saw as ``seen_done_us``.

    The names do not depend on fusion, which Horovod decides from timing and which may differ from
    step to step: tensors fused with the one before them complete with it, so in the DAG their
    transfer is empty, and every profiled step takes part in the mean step (``dpro.dag.step_model``).

    The summary (also ``run.meta["horovod"]["merged"]``) lists every fused buffer (``buffers``: step,
    tensors, bytes, the last launch over ranks, start and end on rank 0's aligned clock, phases) and
    how many distinct fusions the steps used. The ``comm_probe`` samples become the probe tensors'
    ALLREDUCE phases (no cycle wait). Problems go to ``run.problems``.

    Raises:
        TraceError: the timeline file is unreadable or broken before its end.
    """
    path = Path(path) if path is not None else find_timeline(run)
    if path is None:
        return None
    timeline = read_block_timelines(path)
    meta = run.meta if run.meta is not None else {}
    summary: dict[str, Any] = {"file": str(path), "tensor_operations": len(timeline.ops),
                               "fused_groups": len(timeline.groups), "truncated": timeline.truncated}
    summary["unfinished_operations"] = timeline.incomplete
    if timeline.truncated:
        run.problems.append(f"{path.name}: the Horovod timeline is cut off (the job did not shut down cleanly); "
                            f"read up to the cut, {timeline.incomplete} unfinished operation(s) ignored")
    _probe_from_timeline(run, timeline, summary)
    launches = _launches(run)
    offset, method, pairs = _offset(timeline, launches.get(0, []), meta)
    summary.update({"offset_us": offset, "clock": method})
    if offset is None:
        run.problems.append(f"{path.name}: no recorded allreduce of rank 0 matches the Horovod timeline; "
                            "fusion not merged (per-tensor events kept)")
        _store(run, summary)
        return summary
    rank0 = launches[0]
    step_of_op: dict[int, _Launch] = {id(op): rank0[i] for i, op in pairs.items()}
    covered = {rank0[i].step for i in pairs}
    unmatched = sum(1 for i, launch in enumerate(rank0) if i not in pairs and launch.step in covered)
    if unmatched:
        run.problems.append(f"{path.name}: {unmatched} recorded allreduce(s) of rank 0 have no operation in "
                            "the Horovod timeline; they are kept as recorded")
    summary["steps_without_timeline"] = sorted({launch.step for launch in rank0} - covered)
    steps: dict[int, list[FusedGroup]] = defaultdict(list)
    for group in timeline.groups:
        owners = [step_of_op[id(m)].step for m in group.members if id(m) in step_of_op]
        if owners:
            steps[statistics.mode(owners)].append(group)
    index: dict[tuple[int, int, str], _Launch] = {}
    for rank, items in launches.items():
        for launch in items:
            index[(rank, launch.step, launch.key)] = launch
    shifts = _rank_shifts(run)
    shapes: dict[tuple[tuple[str, ...], ...], list[int]] = defaultdict(list)
    buffers: list[dict[str, Any]] = []
    for step, groups in sorted(steps.items()):
        groups.sort(key=lambda g: g.start)
        shapes[tuple(tuple(g.tensors) for g in groups)].append(step)
        for k, group in enumerate(groups):
            buffer = _annotate_group(run, group, k, step, offset, index, step_of_op, shifts)
            if buffer is not None:
                buffers.append(buffer)
    summary.update({
        "steps": sorted(steps),
        "groups_per_step": {str(s): len(g) for s, g in sorted(steps.items())},
        "distinct_fusions": len(shapes),
        "note": (f"Horovod fused the gradients {len(shapes)} different ways in {len(steps)} steps (fusion depends "
                 "on timing); every step is used" if len(shapes) > 1 else "the same fusion in every step"),
        "buffers": buffers,
    })
    _store(run, summary)
    return summary


def _rank_shifts(run: Run) -> dict[int, float]:
    """Each rank's clock minus rank 0's (µs), from the clock exchange (ranks of one host: 0)."""
    try:
        return dict(align(run).offset_us)
    except (KeyError, TypeError, ValueError):
        return {}


def _annotate_group(run: Run, group: FusedGroup, k: int, step: int, offset: float,
                    index: dict[tuple[int, int, str], _Launch], step_of_op: dict[int, _Launch],
                    shifts: dict[int, float]) -> dict[str, Any] | None:
    """Give each rank's events of the group's tensors the group's end and fusion (see the merge)."""
    keys = list(dict.fromkeys(m.key for m in group.members))
    names: list[str] = []
    nbytes = 0
    for m in group.members:
        launch = step_of_op.get(id(m)) or index.get((0, step, m.key))
        tensors = launch.tensors if launch else []
        i = m.index_in_launch
        names.append(tensors[i] if i < len(tensors) else (tensors[0] if tensors else m.tensor))
        if m.nbytes is not None:
            nbytes += m.nbytes
        elif launch is not None:
            nbytes += launch.nbytes // max(1, len(launch.tensors))
    phases = {name: round(us, 3) for name, us in group.phases().items()}
    end0 = group.end + offset          # rank 0's clock
    last_launch = None
    for rank in run.ranks:
        members = [index.get((rank, step, key)) for key in keys]
        shift = shifts.get(rank, 0.0)
        for launch in members:
            if launch is None:
                continue
            seen = launch.done
            end = max(launch.launch, min(seen, end0 + shift))
            ev = launch.event
            ev["dur"] = end - ev["ts"]
            ev["args"].update({"buffer": k, "fused": len(group.members), "buffer_bytes": nbytes,
                               "buffer_tensors": names, "seen_done_us": round(seen - ev["ts"], 3),
                               "source": "launch to its fused buffer's end (Horovod timeline, rank 0)", **phases})
            aligned = launch.launch - shift
            last_launch = aligned if last_launch is None else max(last_launch, aligned)
    if last_launch is None:
        return None
    out = {"step": step, "index": k, "tensors": names, "bytes": nbytes, "last_launch_us": last_launch,
           "start_us": group.start + offset, "end_us": end0, **phases}
    if "queue_us" in phases:  # when the cycle that ran it had agreed on it (negotiation's end)
        out["negotiated_us"] = group.start + offset - phases["queue_us"]
    return out


def _probe_from_timeline(run: Run, timeline: Timeline, summary: dict[str, Any]) -> None:
    samples = []
    for op in timeline.ops:
        if op.key.startswith(PROBE_PREFIX) and op.op == "ALLREDUCE":
            parts = op.key[len(PROBE_PREFIX):].split(".")
            nbytes = op.nbytes if op.nbytes is not None else (int(parts[0]) if parts[0].isdigit() else None)
            if nbytes is not None:
                samples.append([float(nbytes), op.end - op.start])
    if samples and run.meta is not None:
        probe = run.meta.setdefault("comm_probe", {})
        probe["recorded_samples"] = probe.get("samples", [])
        probe["samples"] = samples
        probe["note"] = "[bytes, µs] of the probe allreduces' ALLREDUCE phase in the Horovod timeline"
        summary["probe_samples"] = len(samples)


def _store(run: Run, summary: dict[str, Any]) -> None:
    if run.meta is not None:
        run.meta.setdefault("horovod", {})["merged"] = summary
