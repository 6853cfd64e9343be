"""``dpro report``'s page: ``render_report(ReportData) -> str``, one self-contained HTML file.

Everything is inline (style, the hand-made SVG charts of ``dpro.report.svg``, a few lines of script that sort
tables), so the page opens offline, from a file, in any browser. Every text taken from a trace goes through
``esc``. The headline numbers carry ``data-value`` attributes and the page embeds them as JSON
(``<script type="application/json" id="dpro-headline">``), so tools and tests read them without parsing text.
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
from collections.abc import Sequence
from typing import Any

from dpro import __version__
from dpro.report.collect import ReportData
from dpro.report.svg import (
    CATEGORY_CLASSES,
    STYLE,
    Series,
    bar_chart,
    esc,
    line_chart,
    signed_bars,
    timeline,
)
from dpro.report.tables import format_bytes

__all__ = ["PAGE_STYLE", "SORT_SCRIPT", "headline", "page", "render_report", "table"]

PAGE_STYLE = STYLE + """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header .src{opacity:.8;font-family:monospace;word-break:break-all}
nav{padding:6px 24px;background:#eceff1;position:sticky;top:0;z-index:2}nav a{margin-right:14px;color:#1565c0}
main{padding:8px 24px 40px;max-width:1200px}section{margin-top:22px}h2{font-size:17px;border-bottom:1px solid #ccc}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{background:#fff;border:1px solid #ddd;border-radius:6px;
padding:8px 14px;min-width:130px}.card .k{font-size:12px;color:#666}.card .v{font-size:22px;font-weight:600}
.good{color:#2e7d32}.fair{color:#ef6c00}.bad{color:#c62828}.warn{background:#fff3e0;border:1px solid #ffb74d;
padding:6px 10px;border-radius:4px}
table.t{border-collapse:collapse;background:#fff;margin:6px 0 12px}table.t th,table.t td{border:1px solid #ddd;
padding:3px 8px;text-align:right}table.t th{background:#f1f3f4;cursor:pointer}table.t td.l,table.t th.l{text-align:left}
pre{background:#fff;border:1px solid #ddd;padding:8px;overflow:auto;max-height:360px}
.grid2{display:flex;flex-wrap:wrap;gap:8px}.muted{color:#666;font-size:12px}
.legend span{display:inline-block;margin-right:12px}.legend i{display:inline-block;width:10px;height:10px;
margin-right:4px;vertical-align:middle}
"""

# Click a header to sort its table (numbers by value, text alphabetically); the page marks itself ready.
SORT_SCRIPT = """
document.querySelectorAll("table.t th").forEach(function (th) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0], i = th.cellIndex;
    var up = th.dataset.dir !== "asc"; th.dataset.dir = up ? "asc" : "desc";
    var key = function (row) { var c = row.cells[i];
      var v = c.dataset.value !== undefined ? c.dataset.value : c.textContent;
      var n = parseFloat(v); return isNaN(n) ? v : n; };
    Array.from(body.rows).sort(function (a, b) { var x = key(a), y = key(b);
      var r = (typeof x === typeof y) ? (x < y ? -1 : x > y ? 1 : 0) : (typeof x === "number" ? -1 : 1);
      return up ? r : -r; }).forEach(function (row) { body.appendChild(row); });
  });
});
document.documentElement.dataset.ready = "1";
window.addEventListener("load", function () {  // time to the first frame after load: how long the page takes
  requestAnimationFrame(function () { document.documentElement.dataset.renderMs = performance.now().toFixed(0); });
});
"""

PART_ORDER = ("FW", "BW", "RECOMPUTE", "COMPUTE", "compute", "CPU", "UPDATE", "IO", "MEMCPY", "memcpy",
              "communication", "idle")
PART_NAMES = {"FW": "forward", "BW": "backward", "RECOMPUTE": "recompute", "COMPUTE": "compute", "CPU": "host ops",
              "UPDATE": "update", "IO": "input", "MEMCPY": "memcpy", "communication": "communication (exposed)",
              "idle": "idle"}
CATEGORY_FILLS = {"FW": "#4e79a7", "BW": "#f28e2b", "RECOMPUTE": "#b07aa1", "COMM": "#e15759", "UPDATE": "#59a14f",
                  "IO": "#edc948", "COMPUTE": "#76b7b2", "MEMCPY": "#9c755f", "CPU": "#86bcb6", "OTHER": "#bab0ac"}


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, left: int = 1, table_id: str = "") -> str:
    """An HTML table; the first ``left`` columns are text (left-aligned), numbers keep their value for sorting."""
    out = [f'<table class="t"{f" id={json.dumps(table_id)}" if table_id else ""}><thead><tr>']
    out += [f'<th class="{"l" if i < left else ""}">{esc(h)}</th>' for i, h in enumerate(headers)]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>")
        for i, cell in enumerate(row):
            if isinstance(cell, tuple):  # (shown text, sort value)
                shown, value = cell
                out.append(f'<td data-value="{esc(value)}">{esc(shown)}</td>')
            else:
                out.append(f'<td class="{"l" if i < left else ""}">{esc(cell)}</td>')
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _ms(value: float | None, digits: int = 2) -> tuple[str, float] | str:
    if value is None or not math.isfinite(value):
        return "-"
    return (f"{value:.{digits}f}", value)


def _error_class(error_pct: float) -> str:
    if not math.isfinite(error_pct):
        return "bad"
    return "good" if abs(error_pct) <= 5 else "fair" if abs(error_pct) <= 10 else "bad"


def headline(data: ReportData) -> dict[str, Any]:
    """The headline numbers (the page's cards and its embedded JSON): those of ``dpro analyze --json``."""
    a = data.analysis
    return {"source": data.source, "kind": data.kind, "engine": data.engine, "world_size": data.world_size,
            "ranks": data.ranks, "missing_ranks": data.missing_ranks, "measured_step_ms": a.measured_step_ms,
            "predicted_step_ms": a.predicted_step_ms, "error_pct": a.error_pct, "knobs": data.knobs}


def _card(key: str, value: str, html_id: str = "", raw: float | None = None, cls: str = "") -> str:
    attrs = (f' id="{html_id}"' if html_id else "") + (f' data-value="{raw!r}"' if raw is not None else "")
    return f'<div class="card"><div class="k">{esc(key)}</div><div class="v {cls}"{attrs}>{esc(value)}</div></div>'


def _headline_section(data: ReportData) -> str:
    a = data.analysis
    cards = [_card("measured step", f"{a.measured_step_ms:.2f} ms", "measured-step", a.measured_step_ms),
             _card("predicted step (replay)", f"{a.predicted_step_ms:.2f} ms", "predicted-step", a.predicted_step_ms),
             _card("prediction error", f"{a.error_pct:+.2f} %", "error-pct", a.error_pct, _error_class(a.error_pct)),
             _card("world size", str(data.world_size), "world-size", float(data.world_size)),
             _card("engine", data.engine or ("PyTorch profiler" if data.kind == "kineto" else "-"), "engine"),
             _card("graph nodes", str(a.graph_nodes))]
    if data.recording_overhead:  # what the recorder measured recording cost the training thread
        cpu = statistics.median(o["thread_cpu_pct"] for o in data.recording_overhead.values())
        cards.append(_card("recording overhead (thread CPU)", f"{cpu:+.1f} %", "recording-overhead", cpu))
    out = ['<section id="headline"><h2>Headline</h2><div class="cards">', *cards, "</div>"]
    if data.missing_ranks:
        out.append(f'<p class="warn" id="missing-ranks">ranks {esc(data.missing_ranks)} of {data.world_size} have no '
                   f'trace: the figures are over ranks {esc(data.ranks)} only.</p>')
    knobs = {k: v for k, v in data.knobs.items() if k != "tensor_groups"}
    if knobs:
        rows = [[k, json.dumps(v)] for k, v in sorted(knobs.items())]
        out.append(f"<details><summary>knobs in force ({len(rows)})</summary>{table(['knob', 'value'], rows, left=2)}"
                   "</details>")
    out.append("</section>")
    return "".join(out)


def _legend(categories: set[str]) -> str:
    shown = [c for c in CATEGORY_CLASSES if c in categories and c in CATEGORY_FILLS]
    return ('<div class="legend">' + "".join(f'<span><i style="background:{CATEGORY_FILLS[c]}"></i>{esc(c)}</span>'
                                            for c in shown)
            + '<span><i style="background:#fff;border:1.5px solid #000"></i>critical path</span></div>')


def _timeline_section(data: ReportData) -> str:
    if not data.lanes:
        return '<section id="timeline"><h2>Timeline</h2><p>No step to draw.</p></section>'
    svg, drawn, dropped = timeline(data.lanes, title="one step per rank and queue: measured above, replayed below")
    note = f" {dropped} spans under a pixel wide were left out." if dropped else ""
    cats = {s.category for lane in data.lanes for s in lane.spans}
    return (f'<section id="timeline"><h2>Timeline</h2><p class="muted">{esc(data.timeline_note)}. Hover a span for its '
            f'name and length; outlined spans are on the critical path.{esc(note)}</p>{_legend(cats)}'
            f'<div style="overflow-x:auto">{svg}</div></section>')


def _breakdown_section(data: ReportData) -> str:
    ranks = sorted(data.step_parts)
    if not ranks:
        return ""
    present = {k for parts in data.step_parts.values() for k in parts if k != "overlapped_communication"}
    order = [k for k in PART_ORDER if k in present] + sorted(present - set(PART_ORDER))
    segments = [(PART_NAMES.get(k, k), [data.step_parts[r].get(k, 0.0) for r in ranks]) for k in order]
    colors = [CATEGORY_FILLS.get({"communication": "COMM", "compute": "COMPUTE", "memcpy": "MEMCPY",
                                  "idle": "OTHER"}.get(k, k), "#999") for k in order]
    svg = bar_chart([f"rank {r}" for r in ranks], segments, title="where a replayed step goes, per rank (ms)",
                    colors=colors)
    rows = [[f"rank {r}", *(_ms(data.step_parts[r].get(k, 0.0), 3) for k in order),
             _ms(data.step_parts[r].get("overlapped_communication", 0.0), 3)] for r in ranks]
    headers = ["rank", *(PART_NAMES.get(k, k) + " ms" for k in order), "overlapped communication ms"]
    b = data.analysis.breakdown
    summary = ", ".join(f"{k.replace('_', ' ')} {v:.2f} ms" for k, v in b.items() if isinstance(v, int | float))
    return (f'<section id="breakdown"><h2>Where the step goes</h2>{svg}{table(headers, rows)}'
            f'<p class="muted">Each instant of the step is charged to one part (compute before communication: '
            f'communication under compute is "overlapped" and listed apart). dpro analyze\'s breakdown (median over '
            f'ranks): {esc(summary)}.</p>{_per_rank_table(data)}</section>')


def _per_rank_table(data: ReportData) -> str:
    rows = [[f"rank {r['rank']}", _ms(r.get("measured_step_ms")), _ms(r.get("predicted_step_ms"))]
            for r in data.analysis.per_rank]
    return table(["rank", "measured step ms", "predicted step ms"], rows) if rows else ""


def _comm_section(data: ReportData) -> str:
    out = ['<section id="communication"><h2>Communication and stragglers</h2>']
    if data.comm:
        named = [(c["name"], c["transfer_ms"] if c["transfer_ms"] is not None else c["launch_to_end_ms"])
                 for c in data.comm]
        short = [n.removeprefix("COMM.") for n, _ in named]
        out.append(bar_chart([n if len(n) <= 32 else n[:31] + "…" for n in short],
                             [("transfer", [v or 0.0 for _, v in named])], title="time per collective (ms)"))
        rows = [[c["name"], (format_bytes(c["bytes"]), c["bytes"]) if c["bytes"] is not None else "-",
                 _ms(c["transfer_ms"], 3), _ms(c["launch_to_end_ms"], 3), _ms(c["gbit_per_s"], 3)]
                for c in data.comm]
        out.append(table(["collective", "bytes", "transfer ms", "launch to end ms (longest rank)",
                          "achieved Gbit/s"], rows))
        out.append('<p class="muted">transfer: from the last rank\'s arrival to the end (measured); launch to end '
                   'includes waiting for the other ranks.</p>')
    else:
        out.append("<p>No collective in the profiled steps.</p>")
    if data.analysis.stragglers:
        rows = [[f"rank {s['rank']}", (str(s["last_to_arrive"]), s["last_to_arrive"]),
                 _ms(s["wait_caused_ms_per_step"], 3), _ms(s["share_pct"], 1),
                 _ms(s.get("waits_ms_per_step"), 3), _ms(s.get("waits_pct_of_step"), 1)]
                for s in data.analysis.stragglers]
        out.append("<h3>Stragglers</h3>" + table(["rank", "last to arrive", "others wait ms/step", "% of waiting",
                                                  "it waits ms/step", "% of its steps"], rows))
    out.append("</section>")
    return "".join(out)


def _curve_svg(curve: Any, measured: float | None, replayed: float | None) -> str:
    series = [Series("predicted", curve.points)]
    if curve.in_force is not None:
        if replayed is not None:
            series.append(Series("replayed", [(curve.in_force, replayed)]))
        if measured is not None:
            series.append(Series("measured", [(curve.in_force, measured)]))
    return line_chart(series, title=f"step time vs {curve.knob}", x_label=curve.x_label or curve.knob,
                      y_label="step ms", log_x=curve.log_x, mark_x=curve.in_force)


def _whatif_section(data: ReportData) -> str:
    out = ['<section id="whatif"><h2>What-if (every point a replay)</h2>']
    if data.curves:
        out.append('<div class="grid2">')
        out += [_curve_svg(c, data.analysis.measured_step_ms, data.analysis.predicted_step_ms) for c in data.curves]
        out.append("</div>")
    if len(data.memory) > 1:
        points = [(m["peak_memory_bytes"] / 2**20, m["step_ms"]) for m in data.memory]
        labels = [m.get("choice") or m["recompute"] for m in data.memory]
        chart = line_chart([Series("choice", points, labels)],
                           title="peak memory vs step time: recomputing one module, micro-batches, autocast",
                           x_label="peak memory MiB", y_label="step ms", connect=False, width=720)
        rows = [[label, (format_bytes(m["peak_memory_bytes"]), m["peak_memory_bytes"]), _ms(m["step_ms"])]
                for label, m in zip(labels, data.memory, strict=True)]
        out.append(chart + table(["recomputed / knob", "peak memory", "step ms"], rows))
    if not data.curves and len(data.memory) <= 1:
        out.append("<p>No what-if for this source.</p>")
    out += [f'<p class="warn">{esc(u)}</p>' for u in data.unavailable]
    out.append("</section>")
    return "".join(out)


def _recommendation_section(data: ReportData) -> str:
    rec = data.recommendation
    if rec is None:
        return ""
    base, pred = rec["baseline_step_ms"], rec["predicted_step_ms"]
    gain = 100.0 * (pred / base - 1.0) if base else float("nan")
    rows = [(item.get("knob", ""), float(item.get("predicted_gain_ms", 0.0))) for item in rec["explain"]]
    chart = signed_bars([(k, -v) for k, v in rows], title="predicted change of the step per recommendation (ms)") \
        if any(v for _, v in rows) else ""
    explain = table(["knob", "predicted gain ms", "why"],
                    [[item.get("knob", ""), _ms(item.get("predicted_gain_ms")), item.get("why", "")]
                     for item in rec["explain"]], left=1)
    config = json.dumps(rec["config"], indent=2)
    cards = (_card("replayed as recorded", f"{base:.2f} ms")
             + _card("predicted with the config", f"{pred:.2f} ms", "recommended-step", pred)
             + _card("change", f"{gain:+.1f} %", "", None, "good" if gain < -0.05 else "")
             + _card("search", f"{rec['search_seconds']:.2f} s"))
    return (f'<section id="recommendations"><h2>Recommendations</h2><div class="cards">{cards}</div>{chart}{explain}'
            f"<h3>The config dpro optimize writes</h3><pre>{esc(config)}</pre>"
            f'<p class="muted">Apply it with <code>dpro-launch --apply config.json ...</code> or the plugins\' '
            f"config argument.</p></section>")


def _critical_section(data: ReportData) -> str:
    rows = [[c["op"], c["where"], _ms(c["ms"], 3), _ms(c["share_pct"], 1)] for c in data.analysis.critical_path]
    return (f'<section id="critical"><h2>Critical path (last replayed step)</h2>'
            f'{table(["op", "where", "ms", "% of step"], rows, left=2)}</section>') if rows else ""


def _notes_section(data: ReportData) -> str:
    if not data.analysis.notes:
        return ""
    return '<section id="notes"><h2>Notes</h2><ul>' + "".join(f"<li>{esc(n)}</li>" for n in data.analysis.notes) \
        + "</ul></section>"


def page(title: str, subtitle: str, sections: Sequence[tuple[str, str, str]], data_json: dict[str, Any]) -> str:
    """The page around ``sections`` (``(id, nav label, html)``; empty html is left out), with the headline JSON."""
    shown = [(sid, label, body) for sid, label, body in sections if body]
    nav = "".join(f'<a href="#{sid}">{esc(label)}</a>' for sid, label, _ in shown)
    embedded = json.dumps(data_json, allow_nan=True).replace("</", "<\\/")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return ("<!doctype html>\n"
            f'<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">'
            f"<title>{esc(title)}</title><style>{PAGE_STYLE}</style></head><body>"
            f'<header><h1>{esc(title)}</h1><div class="src">{esc(subtitle)}</div></header><nav>{nav}</nav><main>'
            + "".join(body for _, _, body in shown)
            + f'<footer class="muted">dpro {esc(__version__)}, {stamp}</footer></main>'
            f'<script type="application/json" id="dpro-headline">{embedded}</script>'
            f"<script>{SORT_SCRIPT}</script></body></html>\n")


def render_report(data: ReportData) -> str:
    """The whole report page for ``data``."""
    sections = [("headline", "headline", _headline_section(data)), ("timeline", "timeline", _timeline_section(data)),
                ("breakdown", "where the step goes", _breakdown_section(data)),
                ("communication", "communication", _comm_section(data)),
                ("whatif", "what-if", _whatif_section(data)),
                ("recommendations", "recommendations", _recommendation_section(data)),
                ("critical", "critical path", _critical_section(data)), ("notes", "notes", _notes_section(data))]
    return page("dpro report", data.source, sections, headline(data))
