"""dpro report on every source the core reads: the page's data, its headline against dpro analyze --json, the
parts of a step adding up, hostile names escaped, a missing rank said, and the size of a big run's page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from run_builder import make_horovod_run, make_run, make_wide_run, x_event

from dpro.analyze import analyze_run
from dpro.cli import main
from dpro.engines import load_prepared
from dpro.report.collect import collect_run, collect_traces
from dpro.report.html import render_report

DATA = Path(__file__).resolve().parents[1] / "data"
KINETO = DATA / "kineto" / "ddp2_rank0_nccl.json.gz"


def embedded_headline(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="dpro-headline">(.*?)</script>', page, re.S)
    assert found, "the page embeds its headline"
    return json.loads(found.group(1).replace("<\\/", "</"))


def test_report_headline_is_what_analyze_prints(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    assert main(["analyze", str(run), "--json"]) == 0
    analyzed = json.loads(capsys.readouterr().out)
    assert main(["-q", "report", str(run)]) == 0
    page = (run / "analysis" / "report.html").read_text()
    head = embedded_headline(page)
    for key in ("measured_step_ms", "predicted_step_ms", "error_pct"):
        assert head[key] == pytest.approx(analyzed[key], abs=1e-9)
    assert head["engine"] == "torch-ddp" and head["world_size"] == 2
    assert f'id="measured-step" data-value="{analyzed["measured_step_ms"]!r}"' in page


def test_report_sections_charts_and_curves(tmp_path):
    data = collect_run(make_run(tmp_path / "run"), quiet=True)
    knobs = [c.knob for c in data.curves]
    assert knobs[0] == "torch.ddp.bucket_cap_mb" and "bandwidth_scale" in knobs and "world_size" in knobs
    for curve in data.curves:
        assert len(curve.points) >= 3 and all(y > 0 for _, y in curve.points)
    world = next(c for c in data.curves if c.knob == "world_size")
    assert world.points[-1][1] > world.points[0][1], "more ranks to reduce over cost more"
    assert data.memory and data.memory[0]["recompute"] == "(none)"
    assert data.recommendation is not None and data.recommendation["config"]["schema"] == "dpro.config/1"
    page = render_report(data)
    assert page.count('<svg class="chart"') >= 5
    for section in ("headline", "timeline", "breakdown", "communication", "whatif", "recommendations"):
        assert f'<section id="{section}">' in page
    assert "<script src" not in page and "<link" not in page and "http://" not in page.replace(
        "http://www.w3.org/2000/svg", ""), "the page needs nothing from elsewhere"


def test_timeline_holds_measured_and_replayed_lanes_with_the_critical_path(tmp_path):
    data = collect_run(make_run(tmp_path / "run"), whatif=False, recommend=False)
    measured = [lane for lane in data.lanes if not lane.replayed]
    replayed = [lane for lane in data.lanes if lane.replayed]
    assert {lane.label.split()[0] for lane in measured} == {"r0", "r1"}
    assert data.lanes.index(measured[-1]) < data.lanes.index(replayed[0]), "measured above replayed"
    names = {s.name for lane in measured for s in lane.spans}
    assert {"FW.fc1", "BW.fc2", "COMM.bucket1.allreduce", "UPDATE.sgd"} <= names
    assert any(s.critical for lane in replayed for s in lane.spans)
    assert not any(s.critical for lane in measured for s in lane.spans)
    step = data.analysis.measured_step_ms * 1000
    assert max(s.end for lane in measured for s in lane.spans) <= step * 1.01


def test_parts_of_the_step_add_up_to_the_replayed_step(tmp_path):
    run = load_prepared(make_wide_run(tmp_path / "wide", world_size=3, layers=40, per_bucket=8))
    data = collect_run(run.path, whatif=False, recommend=False)
    for row in data.analysis.per_rank:
        parts = data.step_parts[row["rank"]]
        total = sum(v for k, v in parts.items() if k != "overlapped_communication")
        assert total == pytest.approx(row["predicted_step_ms"], rel=1e-9)
        assert parts["FW"] > 0 and parts["BW"] > 0 and parts["UPDATE"] > 0
        assert parts.get("overlapped_communication", 0) <= parts["BW"] + 1e-9


def test_horovod_run_report(tmp_path):
    from run_builder import horovod_timeline_events, horovod_timeline_text

    run = make_horovod_run(tmp_path / "hvd", horovod_timeline_text(horovod_timeline_events([3, 4])))
    data = collect_run(run, quiet=True)
    assert data.engine == "horovod"
    assert any(c.knob == "HOROVOD_FUSION_THRESHOLD" for c in data.curves)
    assert {c["name"] for c in data.comm} >= {"COMM.fc1.weight.allreduce"}
    assert "HOROVOD_FUSION_THRESHOLD" in render_report(data)


def test_kineto_trace_report(tmp_path):
    data = collect_traces([KINETO])
    assert data.kind == "kineto" and data.analysis.measured_step_ms > 0
    assert any(not lane.replayed for lane in data.lanes) and any(lane.replayed for lane in data.lanes)
    assert data.comm and all(c["bytes"] for c in data.comm if c["name"] == "allreduce")
    page = render_report(data)
    assert "profiler traces carry no gradient list" in page
    assert page.count('<svg class="chart"') >= 3
    out = tmp_path / "k.html"
    assert main(["-q", "report", str(KINETO), "-o", str(out)]) == 0 and out.stat().st_size > 10_000


def test_a_run_with_a_missing_rank_gets_a_report_that_says_so(tmp_path):
    run = make_run(tmp_path / "run", world_size=3, ranks=[0, 2])
    assert main(["-q", "report", str(run), "--no-whatif", "--no-optimize"]) == 0
    page = (run / "analysis" / "report.html").read_text()
    assert 'id="missing-ranks"' in page and "ranks [1] of 3 have no trace" in page
    assert embedded_headline(page)["missing_ranks"] == [1]


def test_names_from_traces_are_escaped(tmp_path):
    evil = '<script>alert("x")</script>'

    def events(rank: int, step: int) -> list[dict]:
        from run_builder import step_events

        out = step_events(rank, step)
        out.append(x_event(f"FW.{evil}", "FW", out[0]["ts"] + 8500, 100.0, rank=rank, queue="compute", step=step))
        return out

    from run_builder import make_run_of

    data = collect_run(make_run_of(tmp_path / "run", events), whatif=False, recommend=False)
    page = render_report(data)
    assert evil not in page and "&lt;script&gt;" in page


def test_report_without_model_json_says_why_there_is_no_whatif(tmp_path):
    data = collect_run(make_run(tmp_path / "run", model=False), quiet=True)
    assert not data.curves and data.recommendation is None
    assert any("model.json is missing" in u for u in data.unavailable)
    assert "model.json is missing" in render_report(data)


def test_a_big_run_page_stays_small(tmp_path):
    """1,000 ops per rank on 8 ranks: the page stays well under 5 MB (time to render: bench/report_page.py)."""
    run = make_wide_run(tmp_path / "wide", world_size=8, layers=500)
    data = collect_run(run, whatif=False, recommend=False)
    ops = sum(1 for lane in data.lanes if not lane.replayed and lane.label.startswith("r0 ") for _ in lane.spans)
    assert ops >= 1000
    page = render_report(data)
    assert len(page.encode()) < 5_000_000


def test_report_refuses_a_linked_analysis_folder(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    (run / "analysis").symlink_to(tmp_path)
    assert main(["-q", "report", str(run), "--no-whatif", "--no-optimize"]) == 2
    assert "writes only inside the run directory" in capsys.readouterr().err
    assert main(["-q", "report", str(run), "--no-whatif", "--no-optimize", "-o", str(tmp_path / "r.html")]) == 0


def test_report_of_an_analyzed_run_matches_analyze_run(tmp_path):
    run = make_run(tmp_path / "run")
    data = collect_run(run, whatif=False, recommend=False)
    assert data.analysis.predicted_step_ms == analyze_run(load_prepared(run)).analysis.predicted_step_ms


def test_mxnet_parameter_server_run_report(tmp_path):
    import shutil

    run = tmp_path / "mxnet"
    shutil.copytree(DATA / "mxnet" / "mlp-2workers-2servers", run)
    data = collect_run(run, quiet=True)
    assert data.engine == "mxnet-ps"
    assert {c.knob for c in data.curves} >= {"num_servers", "mxnet.kvstore.bigarray_bound"}
    assert any(lane.label.startswith("transfers") for lane in data.lanes if lane.replayed)
    page = render_report(data)
    assert page.count('<svg class="chart"') >= 5


def test_the_recorders_own_overhead_figure_is_a_headline_card(tmp_path):
    run = make_run(tmp_path / "run")
    for rank, pct in ((0, 2.0), (1, 4.0)):
        path = run / f"rank-{rank}.json"
        doc = json.loads(path.read_text())
        doc["recording_overhead"] = {"wall_pct": 1.0, "thread_cpu_pct": pct, "unrecorded_steps": 5,
                                     "recorded_steps": 4}
        path.write_text(json.dumps(doc))
    data = collect_run(run, whatif=False, recommend=False)
    assert sorted(data.recording_overhead) == [0, 1]
    assert 'id="recording-overhead" data-value="3.0"' in render_report(data)
