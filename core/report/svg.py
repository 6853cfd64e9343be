"""Hand-made SVG charts for the HTML report: pure functions from plain data to an ``<svg>`` string.

``bar_chart`` (horizontal bars, stacked segments per row), ``signed_bars`` (one bar per row, left of zero when
negative), ``line_chart`` (one or more series over x, linear or log x) and ``timeline`` (lanes of time spans).
Every text that reaches the SVG (labels, op names from traces) goes through ``esc``: traces are hostile input.
Colours are CSS classes (``c-FW``, ``c-COMM``, ...) that ``STYLE`` defines, so thousands of rectangles stay short.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "CATEGORY_CLASSES",
    "STYLE",
    "Lane",
    "Series",
    "Span",
    "bar_chart",
    "esc",
    "line_chart",
    "nice_ticks",
    "signed_bars",
    "timeline",
]

CATEGORY_CLASSES = ("FW", "BW", "RECOMPUTE", "COMM", "XFER", "UPDATE", "IO", "STEP", "COMPUTE", "CPU", "MEMCPY",
                    "OTHER")
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac")
STYLE = """
svg.chart{font:11px sans-serif;display:block;margin:4px 0 14px}
svg.chart .axis{stroke:#888;stroke-width:1}
svg.chart .grid{stroke:#e4e4e4;stroke-width:1}
svg.chart text.t{font-weight:bold;font-size:12px}
svg.chart .c-FW{fill:#4e79a7}svg.chart .c-BW{fill:#f28e2b}svg.chart .c-RECOMPUTE{fill:#b07aa1}
svg.chart .c-COMM,svg.chart .c-XFER{fill:#e15759}svg.chart .c-UPDATE{fill:#59a14f}svg.chart .c-IO{fill:#edc948}
svg.chart .c-STEP{fill:none}svg.chart .c-COMPUTE{fill:#76b7b2}svg.chart .c-MEMCPY{fill:#9c755f}
svg.chart .c-OTHER{fill:#bab0ac}svg.chart .c-CPU{fill:#86bcb6}
svg.chart .rep{opacity:.45}svg.chart .crit{stroke:#000;stroke-width:1.2}
"""


def esc(text: object) -> str:
    """``text`` safe inside SVG/HTML text and attribute values (``&<>"'`` escaped)."""
    return html.escape(str(text), quote=True)


def _num(x: float) -> str:
    """A coordinate, short: at most one decimal."""
    if not math.isfinite(x):
        return "0"
    r = round(x, 1)
    return str(int(r)) if r == int(r) else f"{r:.1f}"


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering ``[lo, hi]`` (1, 2 or 5 times a power of ten apart)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else [0.0]
    raw = (hi - lo) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        if t >= lo - step * 1e-9:
            ticks.append(round(t, 12))
        t += step
    return ticks


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e9:
        return f"{value / 1e9:g}G"
    if magnitude >= 1e6:
        return f"{value / 1e6:g}M"
    if magnitude >= 1e4:
        return f"{value / 1e3:g}k"
    return f"{value:.3g}"


def _open(width: float, height: float, title: str, label: str) -> list[str]:
    return [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{_num(width)}" height="{_num(height)}" '
            f'viewBox="0 0 {_num(width)} {_num(height)}" role="img" aria-label="{esc(label or title)}">',
            f'<text class="t" x="4" y="14">{esc(title)}</text>']


def _x_grid(ticks: Sequence[tuple[float, str]], top: float, bottom: float, label_y: float) -> list[str]:
    """Vertical grid lines at ``(x, label)`` from ``top`` to ``bottom``, each labelled at ``label_y``."""
    return [f'<line class="grid" x1="{_num(x)}" y1="{_num(top)}" x2="{_num(x)}" y2="{_num(bottom)}"/>'
            f'<text x="{_num(x)}" y="{_num(label_y)}" text-anchor="middle">{label}</text>' for x, label in ticks]


def _legend(items: Sequence[tuple[str, str]], x: float, y: float) -> list[str]:
    """Legend entries ``(name, css fill)`` in one row from ``(x, y)``."""
    out = []
    for name, fill in items:
        out.append(f'<rect x="{_num(x)}" y="{_num(y - 9)}" width="10" height="10" fill="{esc(fill)}"/>'
                   f'<text x="{_num(x + 14)}" y="{_num(y)}">{esc(name)}</text>')
        x += 24 + 6.5 * len(name)
    return out


def bar_chart(rows: Sequence[str], segments: Sequence[tuple[str, Sequence[float]]], *, title: str, unit: str = "ms",
              width: int = 760, bar_height: int = 18, colors: Sequence[str] = PALETTE) -> str:
    """Horizontal bars, one per row, each the stack of ``segments`` (``(name, value per row)``), with a legend.

    Negative or non-finite values are drawn as 0.
    """
    left, right, top = min(260, max(110, 7 * max((len(r) for r in rows), default=0) + 12)), 70, 40
    height = top + len(rows) * (bar_height + 6) + 30
    totals = [sum(max(0.0, v) for _, vals in segments for v in [vals[i]] if math.isfinite(v))
              for i in range(len(rows))]
    top_value = max(totals, default=0.0) or 1.0
    scale = (width - left - right) / top_value
    out = _open(width, height, title, title)
    out += _legend([(name, colors[k % len(colors)]) for k, (name, _) in enumerate(segments)], left, 30)
    ticks = nice_ticks(0, top_value)
    out += _x_grid([(left + t * scale, _fmt(t)) for t in ticks], top - 4, height - 24, height - 10)
    out.append(f'<text x="{width - right + 6}" y="{_num(height - 10)}">{esc(unit)}</text>')
    for i, row in enumerate(rows):
        y = top + i * (bar_height + 6)
        out.append(f'<text x="{left - 6}" y="{_num(y + bar_height * 0.7)}" text-anchor="end">{esc(row)}</text>')
        x = float(left)
        for k, (name, vals) in enumerate(segments):
            v = vals[i] if math.isfinite(vals[i]) else 0.0
            w = max(0.0, v) * scale
            if w > 0:
                out.append(f'<rect x="{_num(x)}" y="{y}" width="{_num(w)}" height="{bar_height}" '
                           f'fill="{colors[k % len(colors)]}"><title>{esc(row)}: {esc(name)} {v:.3f} {esc(unit)}'
                           f'</title></rect>')
            x += w
        out.append(f'<text x="{_num(x + 4)}" y="{_num(y + bar_height * 0.7)}">{totals[i]:.2f}</text>')
    out.append("</svg>")
    return "".join(out)


def signed_bars(rows: Sequence[tuple[str, float]], *, title: str, unit: str = "ms", width: int = 760,
                bar_height: int = 16) -> str:
    """One bar per ``(label, value)``, right of the zero line when positive (red: slower), left when negative."""
    left, right, top = 260, 60, 30
    height = top + len(rows) * (bar_height + 5) + 30
    values = [v if math.isfinite(v) else 0.0 for _, v in rows]
    lo, hi = min([0.0, *values]), max([0.0, *values])
    span = (hi - lo) or 1.0
    scale = (width - left - right) / span
    zero = left + (0 - lo) * scale
    out = _open(width, height, title, title)
    ticks = nice_ticks(lo, hi)
    out += _x_grid([(left + (t - lo) * scale, _fmt(t)) for t in ticks], top - 4, height - 24, height - 10)
    out.append(f'<line class="axis" x1="{_num(zero)}" y1="{top - 4}" x2="{_num(zero)}" y2="{_num(height - 24)}"/>')
    out.append(f'<text x="{width - right + 6}" y="{_num(height - 10)}">{esc(unit)}</text>')
    for i, ((label, _), v) in enumerate(zip(rows, values, strict=True)):
        y = top + i * (bar_height + 5)
        x, w = (zero, v * scale) if v >= 0 else (zero + v * scale, -v * scale)
        shown = label if len(label) <= 40 else label[:37] + "..."
        out.append(f'<text x="{left - 6}" y="{_num(y + bar_height * 0.75)}" text-anchor="end">{esc(shown)}</text>'
                   f'<rect x="{_num(x)}" y="{y}" width="{_num(max(w, 0.5))}" height="{bar_height}" '
                   f'fill="{"#e15759" if v > 0 else "#59a14f"}"><title>{esc(label)}: {v:+.3f} {esc(unit)}</title>'
                   f'</rect>')
    out.append("</svg>")
    return "".join(out)


@dataclass
class Series:
    """One line of a ``line_chart``: ``points`` are ``(x, y)``; ``labels`` (optional) name each point."""

    name: str
    points: list[tuple[float, float]]
    labels: list[str] = field(default_factory=list)


def line_chart(series: Sequence[Series], *, title: str, x_label: str, y_label: str, log_x: bool = False,
               mark_x: float | None = None, mark_label: str = "in force", width: int = 480, height: int = 260,
               connect: bool = True) -> str:
    """Series over a shared x axis (log scale with ``log_x``; points with x <= 0 are then left out), a marker
    at ``mark_x`` (the value in force), a point label on each point that has one."""
    left, right, top, bottom = 56, 16, 40 if len(series) > 1 else 28, 42

    def fx(x: float) -> float:
        return math.log10(x) if log_x else x
    pts = [(fx(x), y) for s in series for x, y in s.points if math.isfinite(y) and (x > 0 or not log_x)]
    out = _open(width, height, title, title)
    if not pts:
        out.append(f'<text x="{left}" y="{top + 20}">no point to plot</text></svg>')
        return "".join(out)
    x_lo, x_hi = min(p[0] for p in pts), max(p[0] for p in pts)
    y_lo, y_hi = min(p[1] for p in pts), max(p[1] for p in pts)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    pad = max((y_hi - y_lo) * 0.1, abs(y_hi) * 0.05) or 1.0  # a flat curve still gets a readable axis
    y_lo, y_hi = max(0.0, y_lo - pad) if y_lo >= 0 else y_lo - pad, y_hi + pad
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * pw

    def py(y: float) -> float:
        return top + ph - (y - y_lo) / (y_hi - y_lo) * ph

    for tick in nice_ticks(y_lo, y_hi):
        out.append(f'<line class="grid" x1="{left}" y1="{_num(py(tick))}" x2="{width - right}" '
                   f'y2="{_num(py(tick))}"/><text x="{left - 4}" y="{_num(py(tick) + 4)}" '
                   f'text-anchor="end">{_fmt(tick)}</text>')
    x_ticks = _log_ticks(x_lo, x_hi) if log_x else nice_ticks(x_lo, x_hi)
    for tick in x_ticks:
        if x_lo - 1e-9 <= tick <= x_hi + 1e-9:
            shown = _fmt(round(10 ** tick, 6)) if log_x else _fmt(tick)
            out.append(f'<text x="{_num(px(tick))}" y="{top + ph + 14}" text-anchor="middle">{shown}</text>')
    out.append(f'<line class="axis" x1="{left}" y1="{top + ph}" x2="{width - right}" y2="{top + ph}"/>'
               f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}"/>'
               f'<text x="{left + pw / 2:.0f}" y="{height - 8}" text-anchor="middle">{esc(x_label)}</text>'
               f'<text x="12" y="{top + ph / 2:.0f}" transform="rotate(-90 12 {top + ph / 2:.0f})" '
               f'text-anchor="middle">{esc(y_label)}</text>')
    if mark_x is not None and (mark_x > 0 or not log_x) and x_lo <= fx(mark_x) <= x_hi:
        mx = px(fx(mark_x))
        out.append(f'<line x1="{_num(mx)}" y1="{top}" x2="{_num(mx)}" y2="{top + ph}" stroke="#555" '
                   f'stroke-dasharray="3 3"/><text x="{_num(mx + 3)}" y="{top + 10}">{esc(mark_label)}</text>')
    if len(series) > 1:  # a row of its own under the title
        out += _legend([(s.name, PALETTE[k % len(PALETTE)]) for k, s in enumerate(series)], left, 28)
    for k, s in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        keep = [(fx(x), y, s.labels[i] if i < len(s.labels) else "") for i, (x, y) in enumerate(s.points)
                if math.isfinite(y) and (x > 0 or not log_x)]
        if connect and len(keep) > 1:
            path = " ".join(f"{_num(px(x))},{_num(py(y))}" for x, y, _ in sorted(keep))
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
        for x, y, label in keep:
            shown_x = _fmt(10 ** x) if log_x else _fmt(x)
            out.append(f'<circle cx="{_num(px(x))}" cy="{_num(py(y))}" r="3" fill="{color}"><title>'
                       f'{esc(s.name)}: {esc(label or shown_x)} -> {y:.3f}</title></circle>')
            if label:  # right of the point, or left of it near the right edge
                near_edge = px(x) > left + 0.7 * pw
                anchor = ' text-anchor="end"' if near_edge else ""
                out.append(f'<text x="{_num(px(x) + (-4 if near_edge else 4))}" y="{_num(py(y) - 5)}"{anchor}>'
                           f'{esc(label[:24])}</text>')
    out.append("</svg>")
    return "".join(out)


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Ticks of a log10 axis from ``lo`` to ``hi`` (exponents): each decade, and its 2 and 5 when the axis spans
    fewer than three decades."""
    decades = range(math.floor(lo), math.ceil(hi) + 1)
    steps = (1, 2, 5) if hi - lo < 3 else (1,)
    return [math.log10(m) + d for d in decades for m in steps]


@dataclass
class Span:
    """One op drawn on a timeline lane: start and end (µs from the lane's origin), its name and category."""

    start: float
    end: float
    name: str
    category: str
    critical: bool = False


@dataclass
class Lane:
    """One row of a timeline: a label (``rank 0 compute``), its spans, and whether it shows the replay."""

    label: str
    spans: list[Span]
    replayed: bool = False


def timeline(lanes: Sequence[Lane], *, title: str, max_rects: int = 20_000, width: int = 1100,
             lane_height: int = 14) -> tuple[str, int, int]:
    """Lanes of spans on one time axis (µs), replayed lanes lighter, critical spans outlined.

    At most ``max_rects`` rectangles are drawn: when there are more, the shortest are left out (they would be
    under a pixel wide anyway). Returns the SVG, the rectangles drawn and those left out.
    """
    left, right, top = min(300, max(120, int(6.2 * max((len(lane.label) for lane in lanes), default=0)) + 10)), 34, 24
    spans = [(lane_i, s) for lane_i, lane in enumerate(lanes) for s in lane.spans
             if s.end > s.start and s.category != "STEP"]
    t_end = max((s.end for _, s in spans), default=1.0) or 1.0
    t_start = min((s.start for _, s in spans), default=0.0)
    t_start = min(0.0, t_start)
    dropped = 0
    if len(spans) > max_rects:
        ranked = sorted(spans, key=lambda ls: ls[1].end - ls[1].start, reverse=True)
        dropped = len(spans) - max_rects
        spans = ranked[:max_rects]
    height = top + len(lanes) * (lane_height + 2) + 26
    scale = (width - left - right) / (t_end - t_start)
    out = _open(width, height, title, title)
    ticks = nice_ticks(t_start / 1000.0, t_end / 1000.0, 10)
    out += _x_grid([(left + (t * 1000.0 - t_start) * scale, _fmt(t)) for t in ticks], top, height - 22, height - 8)
    out.append(f'<text x="{width - right + 8}" y="{_num(height - 8)}">ms</text>')
    for i, lane in enumerate(lanes):
        y = top + i * (lane_height + 2)
        out.append(f'<text x="{left - 6}" y="{_num(y + lane_height - 3)}" text-anchor="end">{esc(lane.label)}</text>')
    for lane_i, s in spans:
        y = top + lane_i * (lane_height + 2)
        cat = s.category if s.category in CATEGORY_CLASSES else "OTHER"
        x = left + (s.start - t_start) * scale
        w = max(0.4, (s.end - s.start) * scale)
        # a critical span is drawn solid, and outlined where it is wide enough for an outline to be seen
        crit = (" crit" if w >= 3 else " solid") if s.critical else ""
        cls = f"c-{cat}" + (" rep" if lanes[lane_i].replayed and not s.critical else "") + crit
        out.append(f'<rect class="{cls}" x="{_num(x)}" y="{y}" width="{_num(w)}" height="{lane_height}">'
                   f'<title>{esc(s.name)} {(s.end - s.start) / 1000.0:.3f} ms</title></rect>')
    out.append("</svg>")
    return "".join(out), len(spans), dropped
