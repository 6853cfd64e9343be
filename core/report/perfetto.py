"""The Perfetto view: ``write_replay_trace`` writes one Chrome trace holding the measured timeline
(aligned clocks) beside the replayed one, to open in Perfetto (ui.perfetto.dev).

The measured side holds the last ``measured_steps`` steps the model was built from (default 20): the replayed
side spans a few steps, and a recording of thousands of steps would make a trace Perfetto cannot open."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dpro.dag.align import Alignment
from dpro.dag.graph import Graph
from dpro.io.events import events_of
from dpro.io.load import Run
from dpro.record.trace import CATEGORIES, write_chunks_atomic
from dpro.sim.replay import Schedule

try:  # a fast encoder for a thousand ranks' timelines; the standard library's otherwise
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

__all__ = [
    "REPLAY_PID_BASE",
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
    write_chunks_atomic(path, _document(chunks))
    return path


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


def _replayed(g: Graph, sched: Schedule, origin: float, chunk: int = 100_000) -> Iterator[list[dict[str, Any]]]:
    """The replayed nodes (pid = 1000 + rank; a transfer on each rank taking part), ``chunk`` nodes at a time."""
    queue_tid: dict[str, int] = {}
    tids_of: dict[int, int] = {}
    events: list[dict[str, Any]] = []
    start, end = sched.start.tolist(), sched.end.tolist()
    ranks, queues, gaps, durations, iterations = (g.rank.tolist(), g.queue.tolist(), g.gap.tolist(),
                                                 g.duration.tolist(), g.iteration.tolist())
    for node in range(g.size):
        members = [ranks[node]]
        if g.category[node] == "XFER":
            members = sorted({int(g.rank[p]) for p in g.preds(node) if g.rank[p] >= 0})
        qname = g.queue_names[queues[node]].split("/", 1)[1] if queues[node] >= 0 else "comm"
        for rank in members:
            pid = REPLAY_PID_BASE + rank
            key = f"{pid}/{qname}"
            if key not in queue_tid:
                queue_tid[key] = tids_of.get(pid, 0)
                tids_of[pid] = queue_tid[key] + 1
                events.append(_meta("thread_name", pid, queue_tid[key], {"name": qname}))
                if queue_tid[key] == 0:
                    events.append(_meta("process_name", pid, 0, {"name": f"rank {rank} replayed"}))
            if durations[node] <= 0 and g.category[node] != "STEP":
                continue
            events.append({"name": g.names[node], "cat": g.category[node], "ph": "X", "pid": pid,
                           "tid": queue_tid[key], "ts": origin + start[node], "dur": end[node] - start[node],
                           "args": {"iteration": iterations[node], "gap_us": gaps[node]}})
        if len(events) >= chunk:
            yield events
            events = []
    yield events


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _shown_steps(run: Run, steps: Iterable[int] | None, limit: int) -> set[int | None]:
    if steps is None:
        steps = set()
        for trace in run.ranks.values():
            steps.update(np.unique(trace.table.step).tolist())
    return set(sorted(steps)[-limit:])
