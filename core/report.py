"""Stage 8, report: show an analysis the way people read it.

``format_analysis`` prints terminal tables; ``write_replay_trace`` writes one Chrome trace holding the
measured timeline (aligned clocks) beside the replayed one, to open in Perfetto (ui.perfetto.dev).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpro.align import Alignment
from dpro.analyze import Analysis
from dpro.graph import Graph
from dpro.info import format_table
from dpro.load import Run
from dpro.replay import Schedule
from dpro.trace import write_json_atomic

REPLAY_PID_BASE = 1000


def format_analysis(a: Analysis) -> str:
    """Terminal text: the prediction and its error, the breakdown, the critical path, stragglers."""
    lines = [
        f"source            {a.source}",
        f"measured step     {a.measured_step_ms:9.2f} ms   (median over the profiled steps and ranks)",
        f"predicted step    {a.predicted_step_ms:9.2f} ms   (replay of the global DAG, {a.graph_nodes} nodes)",
        f"prediction error  {a.error_pct:+9.2f} %",
        "",
        "where a step goes (replayed, median over ranks)",
    ]
    b = a.breakdown
    step = a.predicted_step_ms or 1.0
    rows = [[k.replace("_", " "), f"{v:.2f}", f"{100 * v / step:.1f}"] for k, v in b.items()]
    lines.append(_indent(format_table(["part", "ms", "% of step"], rows, align="<>>")))
    if a.per_rank:
        lines += ["", "per rank"]
        rows = [[str(r["rank"]), f"{r['measured_step_ms']:.2f}", f"{r['predicted_step_ms']:.2f}",
                 f"{r['compute_ms']:.2f}", f"{r['communication_ms']:.2f}", f"{r['idle_ms']:.2f}"] for r in a.per_rank]
        lines.append(_indent(format_table(["rank", "measured ms", "predicted ms", "compute ms", "comm ms", "idle ms"],
                                          rows, align=">>>>>>")))
    lines += ["", "critical path (last replayed step), top ops"]
    rows = [[c["op"], c["where"], f"{c['ms']:.3f}", f"{c['share_pct']:.1f}"] for c in a.critical_path]
    lines.append(_indent(format_table(["op", "where", "ms", "% of step"], rows, align="<<>>")))
    if a.stragglers:
        lines += ["", "stragglers (measured: who arrives last at collectives)"]
        rows = [[str(s["rank"]), str(s["last_to_arrive"]), f"{s['wait_caused_ms_per_step']:.3f}",
                 f"{s['share_pct']:.0f}",
                 f"{s['waits_ms_per_step']:.3f}" if "waits_ms_per_step" in s else "-",
                 f"{s['waits_pct_of_step']:.0f}" if "waits_pct_of_step" in s else "-"] for s in a.stragglers]
        lines.append(_indent(format_table(["rank", "last to arrive", "others wait ms/step", "% of waiting",
                                           "it waits ms/step", "% of its steps"], rows, align=">>>>>>")))
        lines.append("  (means over the profiled steps; a rank's waiting is the union of its waits at collectives "
                     "in flight together)")
    if a.notes:
        lines += ["", "notes"] + [f"  - {n}" for n in a.notes]
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def write_replay_trace(path: Path, run: Run, alignment: Alignment, g: Graph, sched: Schedule) -> Path:
    """One Chrome trace: measured events (pid = rank) and replayed ones (pid = 1000 + rank)."""
    events: list[dict[str, Any]] = []
    origin = None
    for rank, trace in sorted(run.ranks.items()):
        shift = alignment.offset_us.get(rank, 0.0)
        events.append(_meta("process_name", rank, 0, {"name": f"rank {rank} measured"}))
        for tid, name in trace.queues.items():
            events.append(_meta("thread_name", rank, tid, {"name": name}))
        for e in trace.events:
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
