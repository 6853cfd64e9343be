"""Terminal text of an analysis: the prediction and its error, the breakdown, the critical path, stragglers."""

from __future__ import annotations

from dpro.analyze import Analysis
from dpro.report.tables import format_table, indent

__all__ = ["format_analysis", "format_summary"]


def format_summary(a: Analysis, top: int = 3) -> str:
    """A few lines for a framework's profiler report: the prediction and its error, where a step goes, the top of
    the critical path."""
    b = a.breakdown
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.2f} ms" for k, v in b.items())
    path = ", ".join(f"{c['op']} ({c['share_pct']:.0f} %)" for c in a.critical_path[:top]) or "-"
    return "\n".join([
        f"dpro: {a.source}",
        f"  measured step {a.measured_step_ms:.2f} ms, predicted {a.predicted_step_ms:.2f} ms "
        f"(prediction error {a.error_pct:+.2f} %)",
        f"  where a step goes (replayed): {parts}",
        f"  critical path, top ops: {path}",
        "  (dpro analyze RUN for the rest; dpro report RUN for a page)",
    ])


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
    lines.append(indent(format_table(["part", "ms", "% of step"], rows, align="<>>")))
    if a.per_rank:
        lines += ["", "per rank"]
        rows = [[str(r["rank"]), f"{r['measured_step_ms']:.2f}", f"{r['predicted_step_ms']:.2f}",
                 f"{r['compute_ms']:.2f}", f"{r['communication_ms']:.2f}", f"{r['idle_ms']:.2f}"] for r in a.per_rank]
        lines.append(indent(format_table(["rank", "measured ms", "predicted ms", "compute ms", "comm ms", "idle ms"],
                                          rows, align=">>>>>>")))
    lines += ["", "critical path (last replayed step), top ops"]
    rows = [[c["op"], c["where"], f"{c['ms']:.3f}", f"{c['share_pct']:.1f}"] for c in a.critical_path]
    lines.append(indent(format_table(["op", "where", "ms", "% of step"], rows, align="<<>>")))
    if a.stragglers:
        lines += ["", "stragglers (measured: who arrives last at collectives)"]
        rows = [[str(s["rank"]), str(s["last_to_arrive"]), f"{s['wait_caused_ms_per_step']:.3f}",
                 f"{s['share_pct']:.0f}",
                 f"{s['waits_ms_per_step']:.3f}" if "waits_ms_per_step" in s else "-",
                 f"{s['waits_pct_of_step']:.0f}" if "waits_pct_of_step" in s else "-"] for s in a.stragglers]
        lines.append(indent(format_table(["rank", "last to arrive", "others wait ms/step", "% of waiting",
                                          "it waits ms/step", "% of its steps"], rows, align=">>>>>>")))
        lines.append("  (means over the profiled steps; a rank's waiting is the union of its waits at collectives "
                     "in flight together)")
    if a.notes:
        lines += ["", "notes"] + [f"  - {n}" for n in a.notes]
    return "\n".join(lines)
