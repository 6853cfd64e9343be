"""The hand-made SVG charts: ticks, escaping of hostile text, the timeline's rectangle cap, log axes."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

from dpro.report.svg import Lane, Series, Span, bar_chart, esc, line_chart, nice_ticks, signed_bars, timeline


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # well-formed XML, or this raises


def test_nice_ticks_are_round_and_cover_the_range():
    assert nice_ticks(0, 9.3) == [0, 2, 4, 6, 8]
    assert nice_ticks(0.013, 0.049) == [0.02, 0.03, 0.04]
    assert nice_ticks(5, 5) == [5]
    assert nice_ticks(math.nan, 1) == [0.0]


def test_hostile_names_are_escaped_everywhere():
    evil = '"><script>alert(1)</script>&'
    assert esc(evil) == "&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;&amp;"
    charts = [bar_chart([evil], [(evil, [1.0])], title=evil), signed_bars([(evil, -2.0)], title=evil),
              line_chart([Series(evil, [(1, 2), (2, 3)], [evil, evil])], title=evil, x_label=evil, y_label=evil),
              timeline([Lane(evil, [Span(0, 10, evil, evil, critical=True)])], title=evil)[0]]
    for svg in charts:
        assert "<script>" not in svg
        parse(svg)


def test_timeline_draws_at_most_max_rects_keeping_the_longest():
    spans = [Span(i, i + 1 + (i % 10), f"op{i}", "FW") for i in range(500)]
    svg, drawn, dropped = timeline([Lane("r0", spans)], title="t", max_rects=100)
    assert (drawn, dropped) == (100, 400)
    assert len(parse(svg).findall("{http://www.w3.org/2000/svg}rect")) == 100
    assert "op9<" in svg or "op9 " in svg  # a longest span (10 µs) is kept


def test_replayed_and_critical_spans_get_their_classes():
    svg, _, _ = timeline([Lane("m", [Span(0, 1000, "a", "FW")]),
                          Lane("r", [Span(0, 1000, "a", "FW", critical=True), Span(0, 500, "b", "BW")], True)],
                         title="t")
    assert 'class="c-FW crit"' in svg and 'class="c-BW rep"' in svg and 'class="c-FW"' in svg


def test_line_chart_log_axis_leaves_out_points_at_or_below_zero():
    svg = line_chart([Series("s", [(0, 5.0), (1, 4.0), (10, 3.0), (100, 2.0)])], title="t", x_label="x",
                     y_label="y", log_x=True, mark_x=10)
    assert svg.count("<circle") == 3 and "in force" in svg
    assert "no point to plot" in line_chart([Series("s", [(0, math.nan)])], title="t", x_label="x", y_label="y")


def test_bar_chart_treats_bad_values_as_zero():
    svg = bar_chart(["a", "b"], [("x", [math.inf, -3.0]), ("y", [1.0, math.nan])], title="t")
    parse(svg)
    assert "nan" not in svg.replace("title", "")
