"""The Perfetto view: ``write_replay_trace`` writes one Chrome trace holding the measured timeline
(aligned clocks) beside the replayed one, to open in Perfetto (ui.perfetto.dev).

The measured side holds the last ``measured_steps`` steps the model was built from (default 20): the replayed
side spans a few steps, and a recording of thousands of steps would make a trace Perfetto cannot open.

Perfetto draws the slices of one track (pid, tid) as a stack: two slices there must nest fully or not overlap, or
it shows them wrongly (and reports an import error). Concurrent collectives on one comm queue, or a replayed
transfer shown on every member rank, do overlap; ``nest_tracks`` moves each slice that would break the nesting to
another track of the same process (``comm (2)``, ...), and ``nesting_problems`` checks a finished trace. The trace
is written a process at a time, each nested on its own (a track never spans processes)."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dpro.dag.align import Alignment
from dpro.dag.graph import Graph
from dpro.io.events import events_of
from dpro.io.load import Run
from dpro.record.trace import CATEGORIES, write_chunks_atomic
from dpro.sim.replay import Schedule

if TYPE_CHECKING:
    from dpro.analyze.run import AnalyzedRun

try:  # a fast encoder for a thousand ranks' timelines; the standard library's otherwise
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

__all__ = [
    "REPLAY_PID_BASE",
    "nest_tracks",
    "nesting_problems",
    "replayed_events",
    "write_analyzed_replay",
    "write_graph_trace",
    "write_replay_trace",
]


REPLAY_PID_BASE = 1000
DEFAULT_MEASURED_STEPS = 20
STEP_CODE = CATEGORIES.index("STEP")


def write_replay_trace(path: Path, run: Run, alignment: Alignment, g: Graph, sched: Schedule,
                       steps: Iterable[int] | None = None, measured_steps: int = DEFAULT_MEASURED_STEPS) -> Path:
    """One Chrome trace: measured events (pid = rank) and replayed ones (pid = 1000 + rank), written a rank at a
    time (a thousand ranks' events would not fit in memory as dicts at once).

    Args:
        steps: the steps the model was built from (default: every step in the traces); the measured side shows
            the last ``measured_steps`` of them.
    """
    shown = _shown_steps(run, steps, measured_steps)
    origin = _origin(run, alignment, shown)
    path.parent.mkdir(parents=True, exist_ok=True)
    chunks = itertools.chain(_measured(run, alignment, shown), _replayed(g, sched, origin))
    write_chunks_atomic(path, _document(nest_tracks(events) for events in chunks))
    return path


def write_analyzed_replay(path: Path, result: AnalyzedRun) -> Path:
    """``write_replay_trace`` of what ``analyze_run`` computed (the measured side: the steps its model was built
    from): ``dpro analyze``'s ``analysis/replay.json``, ``dpro export --format perfetto``."""
    return write_replay_trace(path, result.run, result.alignment, result.graph, result.schedule,
                              steps=result.model.steps)


def write_graph_trace(path: Path, g: Graph, sched: Schedule, origin: float = 0.0) -> Path:
    """The replayed timeline of any graph (a profiler trace's: its measured side is the trace itself)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_chunks_atomic(path, _document(nest_tracks(events) for events in _replayed(g, sched, origin)))
    return path


def replayed_events(g: Graph, sched: Schedule, origin: float) -> list[dict[str, Any]]:
    """The replayed nodes as Chrome events (pid = 1000 + rank, a thread per queue, a collective's transfer on the
    comm queue of each of its ranks, times from ``origin`` µs), every process's tracks nested."""
    return [e for events in _replayed(g, sched, origin) for e in nest_tracks(events)]


def _document(chunks: Iterable[list[dict[str, Any]]]) -> Iterator[bytes]:
    """``{"displayTimeUnit":"ms","traceEvents":[...]}``, the events coming in chunks."""
    yield b'{"displayTimeUnit":"ms","traceEvents":['
    first = True
    for events in chunks:
        if not events:
            continue
        body = _dumps(events)
        yield body[1:-1] if first else b"," + body[1:-1]
        first = False
    yield b"]}"


def _dumps(value: Any) -> bytes:
    if _orjson is not None:
        try:
            return _orjson.dumps(value)
        except TypeError:  # an integer beyond 64 bits: the standard library writes it
            pass
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def _origin(run: Run, alignment: Alignment, shown: set[int | None]) -> float:
    """The earliest aligned start of a shown step (0 without one): the replayed side starts there."""
    origin = None
    wanted = sorted(s for s in shown if s is not None)
    for rank, trace in sorted(run.ranks.items()):
        t = trace.table
        marks = (t.cat == STEP_CODE) & np.isin(t.step, wanted)
        if marks.any():
            first = float((t.ts[marks] - alignment.offset_us.get(rank, 0.0)).min())
            origin = first if origin is None or first < origin else origin
    return origin or 0.0


def _measured(run: Run, alignment: Alignment, shown: set[int | None]) -> Iterator[list[dict[str, Any]]]:
    """Per rank: its process and queue names, then its events of the shown steps on the aligned clock."""
    wanted = sorted(s for s in shown if s is not None)
    for rank, trace in sorted(run.ranks.items()):
        shift = alignment.offset_us.get(rank, 0.0)
        events = [_meta("process_name", rank, 0, {"name": f"rank {rank} measured"})]
        events += [_meta("thread_name", rank, tid, {"name": name}) for tid, name in trace.queues.items()]
        t = trace.table
        for e in events_of(t.take(np.flatnonzero(np.isin(t.step, wanted))), rank, copy=False):
            e["ts"] = e["ts"] - shift
            events.append(e)
        yield events


def _replayed(g: Graph, sched: Schedule, origin: float) -> Iterator[list[dict[str, Any]]]:
    """The replayed nodes, a rank's process at a time (pid = 1000 + rank; a transfer on each rank taking part)."""
    start, end = sched.start.tolist(), sched.end.tolist()
    ranks, queues, gaps, durations, iterations = (g.rank.tolist(), g.queue.tolist(), g.gap.tolist(),
                                                 g.duration.tolist(), g.iteration.tolist())
    nodes_of: dict[int, list[int]] = defaultdict(list)
    for node in range(g.size):
        if g.category[node] == "XFER":
            for rank in sorted({int(g.rank[p]) for p in g.preds(node) if g.rank[p] >= 0}):
                nodes_of[rank].append(node)
        else:
            nodes_of[ranks[node]].append(node)
    for rank in sorted(nodes_of):
        pid = REPLAY_PID_BASE + rank
        events = [_meta("process_name", pid, 0, {"name": f"rank {rank} replayed"})]
        queue_tid: dict[str, int] = {}
        for node in nodes_of[rank]:
            qname = g.queue_names[queues[node]].split("/", 1)[1] if queues[node] >= 0 else "comm"
            if qname not in queue_tid:
                queue_tid[qname] = len(queue_tid)
                events.append(_meta("thread_name", pid, queue_tid[qname], {"name": qname}))
            if durations[node] <= 0 and g.category[node] != "STEP":
                continue
            events.append({"name": g.names[node], "cat": g.category[node], "ph": "X", "pid": pid,
                           "tid": queue_tid[qname], "ts": origin + start[node], "dur": end[node] - start[node],
                           "args": {"iteration": iterations[node], "gap_us": gaps[node]}})
        yield events


def _span_ns(e: dict[str, Any]) -> tuple[int, int]:
    """A slice's start and end as Perfetto imports them: µs floats to whole ns, the duration rounded apart."""
    start = round(float(e["ts"]) * 1000.0)
    return start, start + round(float(e.get("dur", 0.0)) * 1000.0)


def _tracks(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], list[int]]:
    """Complete ("X") events by track (pid, tid), each list in Perfetto's order: by start, longer first."""
    tracks: dict[tuple[Any, Any], list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        if e.get("ph") == "X":
            tracks[(e.get("pid"), e.get("tid"))].append(i)
    for idx in tracks.values():
        idx.sort(key=lambda i: (_span_ns(events[i])[0], -_span_ns(events[i])[1]))
    return tracks


def nesting_problems(events: list[dict[str, Any]], limit: int = 20) -> list[str]:
    """Slices of one track (pid, tid) that overlap without nesting: what Perfetto cannot draw (at most ``limit``)."""
    problems: list[str] = []
    for (pid, tid), idx in _tracks(events).items():
        stack: list[int] = []  # ends of the open slices, innermost last
        opened: list[int] = []
        for i in idx:
            start, end = _span_ns(events[i])
            while stack and stack[-1] <= start:
                stack.pop()
                opened.pop()
            if stack and end > stack[-1]:
                outer = events[opened[-1]]
                problems.append(f"pid {pid} tid {tid}: {events[i]['name']!r} ({start / 1000:.3f}.."
                                f"{end / 1000:.3f} us) starts inside {outer['name']!r} (ends {stack[-1] / 1000:.3f} "
                                "us) and ends after it")
                if len(problems) >= limit:
                    return problems
                continue
            stack.append(end)
            opened.append(i)
    return problems


def nest_tracks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` with every slice that would overlap another of its track without nesting moved to a further track
    of its process (the first where it nests or overlaps nothing), named after the first with `` (2)``, ..."""
    names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    used: dict[Any, set[Any]] = defaultdict(set)
    for e in events:
        used[e.get("pid")].add(e.get("tid"))
    out = list(events)
    for (pid, tid), idx in _tracks(events).items():
        lanes: list[tuple[Any, list[int]]] = [(tid, [])]  # (tid, ends of the open slices)
        for i in idx:
            start, end = _span_ns(events[i])
            lane = _first_fit(lanes, start, end)
            if lane is None:
                new_tid = max((t for t in used[pid] if isinstance(t, int)), default=0) + 1
                used[pid].add(new_tid)
                lanes.append((new_tid, []))
                lane = len(lanes) - 1
                out.append(_meta("thread_name", pid, new_tid, {"name": f"{names.get((pid, tid), tid)} ({len(lanes)})"}))
            lane_tid, stack = lanes[lane]
            stack.append(end)
            if lane_tid != tid:
                out[i] = dict(events[i], tid=lane_tid)
    return out


def _first_fit(lanes: list[tuple[Any, list[int]]], start: int, end: int) -> int | None:
    """The first lane where a slice (start, end) nests in the open slices or overlaps none (closing those that ended
    before it starts), else None."""
    for lane, (_, stack) in enumerate(lanes):
        while stack and stack[-1] <= start:
            stack.pop()
        if not stack or end <= stack[-1]:
            return lane
    return None


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _shown_steps(run: Run, steps: Iterable[int] | None, limit: int) -> set[int | None]:
    if steps is None:
        steps = set()
        for trace in run.ranks.values():
            steps.update(np.unique(trace.table.step).tolist())
    return set(sorted(steps)[-limit:])
