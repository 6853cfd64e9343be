"""The Perfetto view: ``write_replay_trace`` writes one Chrome trace holding the measured timeline
(aligned clocks) beside the replayed one, to open in Perfetto (ui.perfetto.dev).

The measured side holds the last ``measured_steps`` steps the model was built from (default 20): the replayed
side spans a few steps, and a recording of thousands of steps would make a trace Perfetto cannot open."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dpro.dag.align import Alignment
from dpro.dag.graph import Graph
from dpro.io.load import Run
from dpro.record.trace import write_json_atomic
from dpro.sim.replay import Schedule

__all__ = [
    "REPLAY_PID_BASE",
    "write_replay_trace",
]


REPLAY_PID_BASE = 1000
DEFAULT_MEASURED_STEPS = 20


def write_replay_trace(path: Path, run: Run, alignment: Alignment, g: Graph, sched: Schedule,
                       steps: Iterable[int] | None = None, measured_steps: int = DEFAULT_MEASURED_STEPS) -> Path:
    """One Chrome trace: measured events (pid = rank) and replayed ones (pid = 1000 + rank).

    Args:
        steps: the steps the model was built from (default: every step in the traces); the measured side shows
            the last ``measured_steps`` of them.
    """
    events: list[dict[str, Any]] = []
    origin = None
    shown = _shown_steps(run, steps, measured_steps)
    for rank, trace in sorted(run.ranks.items()):
        shift = alignment.offset_us.get(rank, 0.0)
        events.append(_meta("process_name", rank, 0, {"name": f"rank {rank} measured"}))
        for tid, name in trace.queues.items():
            events.append(_meta("thread_name", rank, tid, {"name": name}))
        for e in trace.events:
            if e["args"].get("step") not in shown:
                continue
            aligned = dict(e, ts=e["ts"] - shift)
            events.append(aligned)
            if e["cat"] == "STEP" and (origin is None or aligned["ts"] < origin):
                origin = aligned["ts"]
    origin = origin or 0.0
    queue_tid: dict[str, int] = {}
    for node in range(g.size):
        members = [int(g.rank[node])]
        if g.category[node] == "XFER":
            members = sorted({int(g.rank[p]) for p in g.preds(node) if g.rank[p] >= 0})
        qname = g.queue_names[g.queue[node]].split("/", 1)[1] if g.queue[node] >= 0 else "comm"
        for rank in members:
            pid = REPLAY_PID_BASE + rank
            key = f"{pid}/{qname}"
            if key not in queue_tid:
                queue_tid[key] = len([k for k in queue_tid if k.startswith(f"{pid}/")])
                events.append(_meta("thread_name", pid, queue_tid[key], {"name": qname}))
                if queue_tid[key] == 0:
                    events.append(_meta("process_name", pid, 0, {"name": f"rank {rank} replayed"}))
            if g.duration[node] <= 0 and g.category[node] != "STEP":
                continue
            events.append({"name": g.names[node], "cat": g.category[node], "ph": "X", "pid": pid,
                           "tid": queue_tid[key], "ts": origin + float(sched.start[node]),
                           "dur": float(sched.end[node] - sched.start[node]),
                           "args": {"iteration": int(g.iteration[node]), "gap_us": float(g.gap[node])}})
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"displayTimeUnit": "ms", "traceEvents": events})
    return path


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _shown_steps(run: Run, steps: Iterable[int] | None, limit: int) -> set[int | None]:
    if steps is None:
        steps = {e["args"].get("step") for trace in run.ranks.values() for e in trace.events}
        steps.discard(None)
    return set(sorted(steps)[-limit:])
