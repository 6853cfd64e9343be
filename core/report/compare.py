"""``dpro compare RUN_A RUN_B``: what changed between two runs of one model, and what explains the difference.

``compare_runs(a, b)`` analyzes both run directories and returns a ``Comparison`` (plain data): the knobs that
differ, measured and predicted steps, where each step goes (``time_by_category``, median over ranks), the
collectives (count, bytes, transfer time), per-op durations matched by name, and ``differences``: the parts and
ops that explain the change of the step, largest first. ``format_comparison`` prints it for a terminal,
``render_comparison`` as an HTML page. Runs of different models are refused (``UsageError``).
"""

from __future__ import annotations

import json
import random
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dpro.analyze import AnalyzedRun, analyze_run, time_by_category
from dpro.engines import load_prepared
from dpro.errors import UsageError
from dpro.io.load import Run

__all__ = ["Comparison", "MeasuredChange", "compare_runs", "format_comparison", "measured_change", "render_comparison",
           "same_model"]

TOP_DIFFERENCES = 12
MIN_SHARED_OPS = 0.5  # runs without fingerprints must share at least half their compute ops by name


BOOTSTRAP_DRAWS = 2000
CONFIDENCE = 0.90  # the interval the ratio of median steps must lie in, wholly, for a change to count


@dataclass(frozen=True)
class MeasuredChange:
    """How a run's step compares with a reference run's, measured: ``ratio`` of their median steps (below 1: faster),
    its bootstrap interval (``CONFIDENCE``), and the verdict: ``faster`` or ``slower`` when the whole interval is on
    one side of 1, else ``undecided`` (the two cannot be told apart from these steps)."""

    before_ms: float
    after_ms: float
    ratio: float
    low: float
    high: float
    verdict: str
    steps: tuple[int, int]

    def describe(self) -> str:
        pct = lambda r: f"{100.0 * (r - 1.0):+.1f}%"  # noqa: E731
        return (f"{self.after_ms:.2f} ms against {self.before_ms:.2f} ms, {pct(self.ratio)} "
                f"({int(CONFIDENCE * 100)}% interval {pct(self.low)} .. {pct(self.high)}; "
                f"{self.steps[1]} and {self.steps[0]} steps)")


def measured_change(before: list[float], after: list[float], *, seed: int = 0) -> MeasuredChange:
    """Compare two runs' step times (``io.load.run_step_times_ms``) by the ratio of their medians, with a bootstrap
    interval.

    Raises:
        UsageError: a run with fewer than 3 steps to compare.
    """
    if len(before) < 3 or len(after) < 3:
        raise UsageError(f"too few recorded steps to compare ({len(before)} and {len(after)}; 3 or more each)")
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(after, k=len(after))) /
                    statistics.median(rng.choices(before, k=len(before))) for _ in range(BOOTSTRAP_DRAWS))
    tail = (1.0 - CONFIDENCE) / 2.0
    low, high = ratios[int(tail * BOOTSTRAP_DRAWS)], ratios[int((1.0 - tail) * BOOTSTRAP_DRAWS) - 1]
    b, a = statistics.median(before), statistics.median(after)
    verdict = "faster" if high < 1.0 else "slower" if low > 1.0 else "undecided"
    return MeasuredChange(b, a, a / b, low, high, verdict, (len(before), len(after)))


@dataclass
class Comparison:
    """Two runs side by side (times in ms; ``a`` is the reference, deltas are ``b - a``)."""

    a: str
    b: str
    knobs: list[dict[str, Any]]                  # knob, a, b (only those that differ)
    measured_step_ms: tuple[float, float]
    predicted_step_ms: tuple[float, float]
    error_pct: tuple[float, float]
    parts: list[dict[str, Any]]                  # part of the step, a_ms, b_ms, delta_ms
    collectives: dict[str, tuple[float, float]]  # count, bytes, transfer_ms -> (a, b)
    ops: list[dict[str, Any]]                    # op, category, a_ms, b_ms, delta_ms (ops of both runs)
    differences: list[dict[str, Any]] = field(default_factory=list)  # what, delta_ms, share_pct of the change
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def same_model(a: Run, b: Run) -> str | None:
    """Why ``a`` and ``b`` are not runs of one model, or None when they are: model fingerprints when both runs
    have one, otherwise the gradient names of model.json, otherwise the forward ops' names."""
    fa, fb = ((r.meta or {}).get("model_fingerprint") for r in (a, b))
    if fa and fb:
        return None if fa == fb else f"model fingerprints differ ({fa} vs {fb})"
    ga, gb = ({g.get("name") for g in (r.model or {}).get("gradients", [])} for r in (a, b))
    if ga and gb:
        return None if ga == gb else f"their gradients differ ({len(ga ^ gb)} of {len(ga | gb)} names)"
    oa, ob = (_compute_names(r) for r in (a, b))
    if not oa or not ob:
        return None
    shared = len(oa & ob) / len(oa | ob)
    return None if shared >= MIN_SHARED_OPS else f"they share {100 * shared:.0f}% of their forward/backward ops"


def _compute_names(run: Run) -> set[str]:
    return {e["name"] for t in run.ranks.values() for e in t.events if e["cat"] in ("FW", "BW")}


def compare_runs(path_a: str | Path, path_b: str | Path) -> Comparison:
    """Analyze two run directories of one model and say what differs.

    Raises:
        UsageError: the runs are of different models (naming why).
    """
    run_a, run_b = load_prepared(path_a), load_prepared(path_b)
    why = same_model(run_a, run_b)
    if why is not None:
        raise UsageError(f"{path_a} and {path_b} are not runs of one model: {why}")
    ra, rb = analyze_run(run_a), analyze_run(run_b)
    knobs_a, knobs_b = ((r.meta or {}).get("knobs") or {} for r in (run_a, run_b))
    knobs = [{"knob": k, "a": knobs_a.get(k), "b": knobs_b.get(k)} for k in sorted(set(knobs_a) | set(knobs_b))
             if knobs_a.get(k) != knobs_b.get(k)]
    for key, label in (("world_size", "world size"), ("engine", "engine")):
        va, vb = ((r.meta or {}).get(key) for r in (run_a, run_b))
        if va != vb:
            knobs.append({"knob": label, "a": va, "b": vb})
    parts = _parts(ra, rb)
    ops = _ops(ra, rb)
    colls = _collectives(ra), _collectives(rb)
    c = Comparison(
        a=str(run_a.path), b=str(run_b.path), knobs=knobs,
        measured_step_ms=(ra.analysis.measured_step_ms, rb.analysis.measured_step_ms),
        predicted_step_ms=(ra.analysis.predicted_step_ms, rb.analysis.predicted_step_ms),
        error_pct=(ra.analysis.error_pct, rb.analysis.error_pct), parts=parts,
        collectives={k: (colls[0][k], colls[1][k]) for k in colls[0]}, ops=ops)
    c.differences = _differences(c)
    if not knobs:
        c.notes.append("the runs record the same knobs: the difference is the machine's (noise, load) or the "
                       "script's")
    return c


def _median_parts(r: AnalyzedRun) -> dict[str, float]:
    per_rank = time_by_category(r.graph, r.schedule)
    keys = {k for parts in per_rank.values() for k in parts}
    return {k: statistics.median(parts.get(k, 0.0) for parts in per_rank.values()) / 1000.0 for k in keys}


def _parts(ra: AnalyzedRun, rb: AnalyzedRun) -> list[dict[str, Any]]:
    pa, pb = _median_parts(ra), _median_parts(rb)
    rows = [{"part": k, "a_ms": pa.get(k, 0.0), "b_ms": pb.get(k, 0.0), "delta_ms": pb.get(k, 0.0) - pa.get(k, 0.0)}
            for k in sorted(set(pa) | set(pb))]
    return sorted(rows, key=lambda row: -abs(row["delta_ms"]))


def _op_medians(r: AnalyzedRun) -> dict[str, tuple[str, float]]:
    """Op name -> (category, median over ranks of its median duration in ms); collectives are summed apart."""
    durations: dict[str, list[float]] = defaultdict(list)
    category: dict[str, str] = {}
    for rank_ops in r.model.ops.values():
        for op in rank_ops:
            if op.category in ("COMM", "STEP"):
                continue
            durations[op.name].append(op.duration)
            category[op.name] = op.category
    return {name: (category[name], statistics.median(v) / 1000.0) for name, v in durations.items()}


def _ops(ra: AnalyzedRun, rb: AnalyzedRun) -> list[dict[str, Any]]:
    oa, ob = _op_medians(ra), _op_medians(rb)
    rows = []
    for name in set(oa) | set(ob):
        cat = (oa.get(name) or ob.get(name))[0]
        a_ms, b_ms = oa[name][1] if name in oa else 0.0, ob[name][1] if name in ob else 0.0
        rows.append({"op": name, "category": cat, "a_ms": a_ms, "b_ms": b_ms, "delta_ms": b_ms - a_ms,
                     "in": "both" if name in oa and name in ob else ("a" if name in oa else "b")})
    return sorted(rows, key=lambda row: (-abs(row["delta_ms"]), row["op"]))


def _collectives(r: AnalyzedRun) -> dict[str, float]:
    ops = r.model.ops.get(min(r.model.ops), []) if r.model.ops else []
    comms = [op for op in ops if op.category == "COMM"]
    size = sum(float(op.args.get("bytes") or 0) for op in comms if isinstance(op.args.get("bytes"), int | float))
    transfer = sum(r.model.transfer.get(op.name, 0.0) for op in comms) / 1000.0
    return {"count": float(len(comms)), "bytes": size, "transfer_ms": transfer}


def _differences(c: Comparison) -> list[dict[str, Any]]:
    """The step parts and compute ops whose change is largest, with their share of the measured change."""
    change = c.measured_step_ms[1] - c.measured_step_ms[0]
    items = [{"what": f"{p['part'].replace('_', ' ')} (part of the step)", "delta_ms": p["delta_ms"]}
             for p in c.parts if p["part"] != "overlapped_communication"]
    count_a, count_b = c.collectives["count"]
    if count_a != count_b:
        items.append({"what": f"collectives per step {count_a:.0f} -> {count_b:.0f} (summed transfer time)",
                      "delta_ms": c.collectives["transfer_ms"][1] - c.collectives["transfer_ms"][0]})
    items += [{"what": f"op {o['op']}" + ("" if o["in"] == "both" else f" (only in run {o['in']})"),
               "delta_ms": o["delta_ms"]} for o in c.ops[:TOP_DIFFERENCES]]
    items = [i for i in items if abs(i["delta_ms"]) > 1e-6]
    items.sort(key=lambda i: -abs(i["delta_ms"]))
    for item in items:
        item["share_pct"] = 100.0 * item["delta_ms"] / change if abs(change) > 1e-9 else float("nan")
    return items[:TOP_DIFFERENCES]


def _value(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def format_comparison(c: Comparison) -> str:
    """Terminal text: knobs that differ, the steps, where the change comes from."""
    from dpro.report.tables import format_bytes, format_table, indent

    (ma, mb), (pa, pb) = c.measured_step_ms, c.predicted_step_ms
    lines = [f"A  {c.a}", f"B  {c.b}", ""]
    if c.knobs:
        lines.append("knobs that differ")
        lines.append(indent(format_table(["knob", "A", "B"], [[k["knob"], _value(k["a"]), _value(k["b"])]
                                                             for k in c.knobs])))
    else:
        lines.append("knobs: the same")
    pct = 100.0 * (mb / ma - 1.0) if ma else float("nan")
    lines += ["", "step", indent(format_table(
        ["", "A ms", "B ms", "B - A ms", "change"],
        [["measured", f"{ma:.2f}", f"{mb:.2f}", f"{mb - ma:+.2f}", f"{pct:+.1f}%"],
         ["predicted (replay)", f"{pa:.2f}", f"{pb:.2f}", f"{pb - pa:+.2f}", ""],
         ["prediction error", f"{c.error_pct[0]:+.2f}%", f"{c.error_pct[1]:+.2f}%", "", ""]], align="<>>>>"))]
    (na, nb), (ba, bb), (ta, tb) = (c.collectives[k] for k in ("count", "bytes", "transfer_ms"))
    lines += ["", "collectives per step (rank 0)", indent(format_table(
        ["", "A", "B"], [["count", f"{na:.0f}", f"{nb:.0f}"], ["bytes", format_bytes(ba), format_bytes(bb)],
                         ["transfer ms (summed)", f"{ta:.2f}", f"{tb:.2f}"]], align="<>>"))]
    lines += ["", "where the step goes (replayed, median over ranks)", indent(format_table(
        ["part", "A ms", "B ms", "B - A ms"],
        [[p["part"].replace("_", " "), f"{p['a_ms']:.2f}", f"{p['b_ms']:.2f}", f"{p['delta_ms']:+.2f}"]
         for p in c.parts], align="<>>>"))]
    if c.differences:
        lines += ["", "what explains the difference (largest first; share of the measured change)", indent(
            format_table(["what", "B - A ms", "share"],
                         [[d["what"], f"{d['delta_ms']:+.3f}", f"{d['share_pct']:+.0f}%"] for d in c.differences],
                         align="<>>"))]
    if c.notes:
        lines += ["", "notes"] + [f"  - {n}" for n in c.notes]
    return "\n".join(lines)


def render_comparison(c: Comparison) -> str:
    """The comparison as one self-contained HTML page."""
    from dpro.report.html import page, table
    from dpro.report.svg import bar_chart, signed_bars

    (ma, mb), (pa, pb) = c.measured_step_ms, c.predicted_step_ms
    keys = [p["part"] for p in c.parts if p["part"] != "overlapped_communication"]
    parts = bar_chart(["A", "B"], [(k.replace("_", " "), [p["a_ms"], p["b_ms"]]) for k in keys for p in c.parts
                                   if p["part"] == k], title="where the replayed step goes (ms, median over ranks)")
    diffs = signed_bars([(d["what"], d["delta_ms"]) for d in c.differences],
                        title="B - A per part and op (ms; red: slower in B)") if c.differences else ""
    sections = [
        ("runs", "runs", "<h2>Runs</h2>" + table(
            ["", "run", "measured step ms", "predicted step ms", "error %"],
            [[label, path, (f"{m:.2f}", m), (f"{p:.2f}", p), (f"{e:+.2f}", e)]
             for label, path, m, p, e in (("A", c.a, ma, pa, c.error_pct[0]), ("B", c.b, mb, pb, c.error_pct[1]))],
            left=2)),
        ("knobs", "knobs", "<h2>Knobs that differ</h2>" + (table(["knob", "A", "B"], [
            [k["knob"], _value(k["a"]), _value(k["b"])] for k in c.knobs], left=3) if c.knobs else "<p>none</p>")),
        ("differences", "differences", f"<h2>What explains the difference</h2>{diffs}{parts}"),
        ("ops", "ops", "<h2>Ops</h2>" + table(["op", "category", "A ms", "B ms", "B - A ms"], [
            [o["op"], o["category"], (f"{o['a_ms']:.3f}", o["a_ms"]), (f"{o['b_ms']:.3f}", o["b_ms"]),
             (f"{o['delta_ms']:+.3f}", o["delta_ms"])] for o in c.ops[:200]], left=2)),
    ]
    sections = [(sid, label, f'<section id="{sid}">{body}</section>') for sid, label, body in sections]
    return page("dpro compare", f"A: {c.a}   B: {c.b}", sections,
                {"a": c.a, "b": c.b, "measured_step_ms": list(c.measured_step_ms), "knobs": c.knobs})
