"""What a run directory holds, at a glance: ``dpro info RUN``.

``summarize_run`` turns a loaded ``Run`` into plain data (JSON-ready: ``dpro info --json`` prints it
as is); ``format_run_summary`` renders that data as terminal text with aligned tables.

Example::

    print(format_run_summary(summarize_run(dpro.engines.load_prepared("dpro-runs/20240101-120000"))))
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from dpro.errors import TraceError
from dpro.io.load import RankTrace, Run, format_steps, median_difference_stderr_pct, overhead_of, step_times_ms
from dpro.io.probes import Probe, read_probes
from dpro.record.trace import CATEGORIES
from dpro.report.tables import format_bytes, format_table, indent

__all__ = ["format_run_summary", "summarize_run"]

_RANK_COLUMNS = ("rank", "host", "state", "steps", *CATEGORIES, "step ms (median)", "COMM/step")


def summarize_run(run: Run) -> dict[str, Any]:
    """Plain-data summary of a run: metadata, per-rank state and event counts, model sizes, problems.

    ``steps_recorded`` are the steps every rank with a trace recorded; per rank, ``state`` is
    ``complete``, ``partial`` (stopped early) or ``missing`` (no trace file at all).
    """
    meta = run.meta or {}
    ranks = [_rank_summary(run, rank) for rank in sorted(set(range(run.world_size)) | set(run.ranks))]
    return {
        "run": str(run.path),
        "framework": meta.get("framework"),
        "engine": meta.get("engine"),
        "world_size": run.world_size,
        "hosts": meta.get("hosts") or [r["host"] for r in ranks],
        "steps_asked": run.profiled_steps,
        "steps_recorded": _common_steps(run),
        "knobs": dict(meta.get("knobs") or {}),
        "model_fingerprint": meta.get("model_fingerprint"),
        "dpro_version": meta.get("dpro_version"),
        "created": meta.get("created"),
        "ranks": ranks,
        "model": _model_summary(run.model),
        "probes": _probes_summary(run),
        "problems": list(run.problems),
    }


def _probes_summary(run: Run) -> dict[str, Any] | None:
    """The recorder's probe passes after the window (``dpro.io.probes``): rank 0's (or the first rank's) in full, and
    which ranks ran any. None when there are none."""
    try:
        probes = read_probes(run.path)
    except TraceError as err:
        return {"error": str(err)}
    if not probes:
        return None
    first = probes[min(probes)]
    reference = first.find(None, first.batch) if first.batch is not None else None
    rows = [{"amp": p.amp, "batch": p.batch, "passes": p.passes, "pass_ms": p.pass_us / 1000.0, "compile": p.compile,
             "vs_recorded": _versus(p, reference)} for p in first.probes]
    return {"rank": first.rank, "ranks": sorted(probes), "batch": first.batch, "probes": rows,
            "skipped": [f"{s['probe']}: {s['why']}" for s in first.skipped]}


def _versus(probe: Probe, reference: Probe | None) -> float | None:
    """A probe's pass against the same pass as recorded: for a compile probe, its region eager in the same probe."""
    if probe.compile is not None:
        eager = sum((probe.eager or {}).values())
        return probe.pass_us / eager if eager else None
    return probe.pass_us / reference.pass_us if reference is not None and reference.pass_us else None


def _common_steps(run: Run) -> list[int]:
    sets = [set(t.steps) for t in run.ranks.values()]
    return sorted(set.intersection(*sets)) if sets else []


def _rank_summary(run: Run, rank: int) -> dict[str, Any]:
    trace = run.ranks.get(rank)
    hosts = (run.meta or {}).get("hosts") or []
    host = trace.host if trace is not None and trace.host else (hosts[rank] if rank < len(hosts) else None)
    if trace is None:
        return {"rank": rank, "host": host, "state": "missing", "file": None, "steps": [],
                "events": dict.fromkeys(CATEGORIES, 0), "step_ms_median": None, "comm_bytes_per_step": None,
                "note": ""}
    times = list(step_times_ms(trace).values())
    comm = _comm_bytes_by_step(trace)
    return {
        "rank": rank,
        "host": host,
        "state": "complete" if trace.complete else "partial",
        "file": trace.path.name,
        "steps": sorted(trace.steps),
        "events": _count_categories(trace),
        "step_ms_median": round(statistics.median(times), 3) if times else None,
        "comm_bytes_per_step": int(statistics.median(comm.values())) if comm else None,
        "note": trace.note,
        "recording_overhead": overhead_of(trace.header.get("recording_overhead")),
    }


def _count_categories(trace: RankTrace) -> dict[str, int]:
    counts = Counter(ev["cat"] for ev in trace.events)
    return {cat: counts.get(cat, 0) for cat in CATEGORIES}


def _comm_bytes_by_step(trace: RankTrace) -> dict[int, float]:
    """COMM bytes each step moved (steps with no COMM event count as 0)."""
    by_step = dict.fromkeys(trace.steps, 0.0)
    for ev in trace.events:
        if ev["cat"] == "COMM":
            step = ev["args"]["step"]
            by_step[step] = by_step.get(step, 0.0) + ev["args"].get("bytes", 0)
    return by_step


def _model_summary(model: dict[str, Any] | None) -> dict[str, Any] | None:
    if model is None:
        return None
    gradients = model.get("gradients", [])
    modules = model.get("modules", [])
    return {
        "gradients": len(gradients),
        "gradient_bytes": sum(g["bytes"] for g in gradients),
        "buckets": len(model.get("buckets", [])),
        "modules": len(modules),
        "recorded_modules": sum(1 for m in modules if m.get("recorded")),
        "param_bytes": model.get("param_bytes"),
    }


# ---- text ----------------------------------------------------------------------------------------


def format_run_summary(summary: dict[str, Any]) -> str:
    """Render ``summarize_run``'s data as terminal text: a header, knobs, a rank table, problems."""
    blocks = [_header_block(summary)]
    if summary["knobs"]:
        rows = [[str(k), _value(v)] for k, v in sorted(summary["knobs"].items())]
        blocks.append("knobs\n" + indent(format_table(["knob", "value"], rows, header=False)))
    blocks.append("ranks\n" + indent(_rank_table(summary["ranks"])))
    measured = [r for r in summary["ranks"] if r.get("recording_overhead")]
    if measured:
        rows = [_overhead_row(r["rank"], r["recording_overhead"]) for r in measured]
        gaps = all(r["recording_overhead"].get("baseline") == "gaps" for r in measured)
        against = ("the unrecorded steps between its blocks" if gaps else
                   "the unrecorded steps just before the window, which may still be warming up (a window in blocks, "
                   "START:STOP:BLOCK, measures against steps of the same state)")
        blocks.append(f"recording overhead (median step, recorded vs {against}; +/-: the wall figure's standard "
                      "error, from the unrecorded steps' spread and the steps counted: a figure within twice it "
                      "cannot be told from chance)\n"
                      + indent(format_table(["rank", "training thread CPU", "wall", "+/-", "steps"], rows,
                                            align=">>>><")))
    if summary.get("probes"):
        blocks.append(_probes_block(summary["probes"]))
    problems = summary["problems"]
    if problems:
        blocks.append(f"problems ({len(problems)})\n" + "\n".join(f"  - {p}" for p in problems))
    else:
        blocks.append("problems: none")
    return "\n\n".join(blocks)


def _probes_block(probes: dict[str, Any]) -> str:
    """The probe passes: flagged as such, since they are not steps of the run and no model of it uses them."""
    if "error" in probes:
        return f"probe passes: unreadable ({probes['error']})"
    head = (f"probe passes after the window (rank {probes['rank']}; ranks with probes: "
            f"{', '.join(map(str, probes['ranks']))}): not recorded steps, left out of the model of this run; "
            "they price the amp, micro_batches and compile what-ifs (a compile probe: its region alone, against "
            "itself eager)")
    rows = [[f"compiled {p['compile']}" if p.get("compile") else p["amp"] or "as recorded", str(p["batch"]),
             str(p["passes"]), f"{p['pass_ms']:.2f}",
             "?" if p["vs_recorded"] is None else f"{p['vs_recorded']:.2f}x"] for p in probes["probes"]]
    text = head + "\n" + indent(format_table(["probe", "batch", "passes", "pass ms", "vs as recorded"], rows,
                                              align="<>>>>"))
    if probes["skipped"]:
        text += "\n" + "\n".join(f"  skipped {s}" for s in probes["skipped"])
    return text


def _overhead_row(rank: int, overhead: dict[str, Any]) -> list[str]:
    spread = overhead.get("wall_spread_pct")
    error = None if spread is None else median_difference_stderr_pct(
        spread, int(overhead["unrecorded_steps"]), int(overhead["recorded_steps"]))
    return [str(rank), f"{overhead['thread_cpu_pct']:+.1f}%", f"{overhead['wall_pct']:+.1f}%",
            "?" if error is None else f"{error:.1f}%",
            f"{overhead['recorded_steps']} vs {overhead['unrecorded_steps']}"]


def _header_block(summary: dict[str, Any]) -> str:
    asked, recorded = summary["steps_asked"], summary["steps_recorded"]
    steps = f"asked {format_steps(asked) or '?'}; recorded {format_steps(recorded) or 'none'}"
    steps += " on every rank with a trace"
    rows = [
        ["run", summary["run"]],
        ["framework", summary["framework"] or "?"],
        ["engine", summary["engine"] or "?"],
        ["world size", str(summary["world_size"])],
        ["hosts", _hosts_line(summary["hosts"])],
        ["steps", steps],
        ["model", _model_line(summary["model"], summary["model_fingerprint"])],
    ]
    if summary["created"] or summary["dpro_version"]:
        rows.append(["recorded", f"{summary['created'] or '?'} by dpro {summary['dpro_version'] or '?'}"])
    return format_table(["", ""], rows, header=False)


def _hosts_line(hosts: Sequence[str | None]) -> str:
    ranks_of: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        ranks_of.setdefault(host or "?", []).append(rank)
    if not ranks_of:
        return "?"
    return "; ".join(f"{host} (rank{'s' * (len(r) > 1)} {format_steps(r)})" for host, r in ranks_of.items())


def _model_line(model: dict[str, Any] | None, fingerprint: str | None) -> str:
    if model is None:
        return "unknown (no model.json)"
    line = (f"{_plural(model['gradients'], 'gradient')}, {format_bytes(model['gradient_bytes'])} in "
            f"{_plural(model['buckets'], 'bucket')}; {_plural(model['modules'], 'module')} "
            f"({model['recorded_modules']} recorded)")
    return f"{line}; fingerprint {fingerprint}" if fingerprint else line


def _rank_table(ranks: list[dict[str, Any]]) -> str:
    rows = []
    for r in ranks:
        missing = r["state"] == "missing"
        rows.append([
            str(r["rank"]), r["host"] or "?", r["state"],
            "-" if missing else (format_steps(r["steps"]) or "none"),
            *("-" if missing else str(r["events"][cat]) for cat in CATEGORIES),
            "-" if r["step_ms_median"] is None else f"{r['step_ms_median']:.2f}",
            "-" if r["comm_bytes_per_step"] is None else format_bytes(r["comm_bytes_per_step"]),
        ])
    align = ">" + "<<<" + ">" * (len(_RANK_COLUMNS) - 4)
    return format_table(list(_RANK_COLUMNS), rows, align=align)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
