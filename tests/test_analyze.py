"""Alignment with an injected clock skew, and dpro analyze end to end on real 2-rank DDP runs."""

from __future__ import annotations

import json
import re
import sys

import pytest
from jobrunner import job_env, run_job, torchrun

pytest.importorskip("torch")

from dpro.analyze import analyze_path  # noqa: E402
from dpro.cli import main  # noqa: E402
from dpro.dag.align import align  # noqa: E402
from dpro.io.load import load_run  # noqa: E402

SKEW_US = 2_000_000.0


@pytest.mark.slow
def test_alignment_recovers_an_injected_two_second_skew(tmp_path):
    run_dir = tmp_path / "run"
    torchrun("ddp_job.py", "--model", "mlp", "--steps", "6", "--profile", "2:5", "--run-dir", str(run_dir),
             "--bucket-cap-mb", "0.25", env=job_env(DPRO_CLOCK_SKEW_US=f"1:{SKEW_US:.0f}"))
    run = load_run(run_dir)
    raw_gap = run.ranks[1].events[0]["ts"] - run.ranks[0].events[0]["ts"]
    assert raw_gap > SKEW_US / 2, "the skew is really in the recorded timestamps"
    alignment = align(run)
    assert alignment.offset_us[0] == 0.0
    assert abs(alignment.offset_us[1] - SKEW_US) < 100.0, alignment.offset_us
    assert any("rank 1" in note for note in alignment.notes)
    # analysis uses the aligned clocks: the measured timeline of rank 1 lands next to rank 0's
    assert main(["analyze", str(run_dir)]) == 0
    trace = json.loads((run_dir / "analysis" / "replay.json").read_text())
    starts = {e["pid"]: e["ts"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "STEP"}
    assert abs(starts[1] - starts[0]) < 50_000, starts


@pytest.mark.slow
def test_analyze_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    torchrun("ddp_job.py", "--model", "transformer", "--steps", "10", "--profile", "3:9", "--run-dir", str(run_dir),
             "--bucket-cap-mb", "1")
    proc = run_job([sys.executable, "-m", "dpro", "analyze", str(run_dir), "--json"])
    result = json.loads(proc.stdout)
    for key in ("measured_step_ms", "predicted_step_ms", "error_pct", "breakdown", "critical_path"):
        assert key in result
    assert result["measured_step_ms"] > 0 and result["predicted_step_ms"] > 0
    assert abs(result["error_pct"]) < 25, result["error_pct"]
    assert set(result["breakdown"]) == {"compute", "communication", "overlapped_communication", "idle"}
    assert result["critical_path"] and all(0 <= c["share_pct"] <= 100 for c in result["critical_path"])
    trace = json.loads((run_dir / "analysis" / "replay.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {0, 1, 1000, 1001} <= pids  # measured and replayed, both ranks
    text = run_job([sys.executable, "-m", "dpro", "analyze", str(run_dir)]).stdout
    assert "prediction error" in text and "critical path" in text


@pytest.mark.slow
def test_analyze_a_job_on_the_emulated_network(tmp_path):
    from dpro import testbed

    ok, why = testbed.testbed_available()
    if not ok:
        pytest.skip(why)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "dpro.plugins.torch.example", "--model", "wide_mlp", "--steps", "8",
            "--profile", "3:7", "--bucket-cap-mb", "25", "--run-dir", str(run_dir)]
    with testbed.emulated_cluster(2, testbed.NetworkSpec(rate="1gbit")) as cluster:
        results = testbed.run_ranks(cluster, lambda rank: argv, ranks_per_host=1, timeout=240,
                                    env_for_rank=lambda rank: testbed.torch_rank_env(cluster, rank, 2, 1, 29650))
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
    run = load_run(run_dir)
    assert run.meta["world_size"] == 2
    analysis = analyze_path(run_dir)
    # 42 MB of gradients over a 1 Gbit/s link: communication dominates the step
    assert analysis.breakdown["communication"] > analysis.breakdown["compute"]
    assert analysis.measured_step_ms > 300
    assert abs(analysis.error_pct) < 25


# ---- stragglers on hand-built steps (no job) -------------------------------------------------------


def _model_with_arrivals(arrivals: dict[tuple[str, int], dict[int, float]], spans: dict[tuple[int, int], tuple]):
    from dpro.dag.step_model import StepModel

    steps = sorted({s for _, s in arrivals})
    return StepModel(ops={}, transfer={}, measured_step_us=10_000.0, step_us_by_rank={}, steps=steps,
                     arrivals=arrivals, step_spans=spans)


def test_straggler_waiting_at_fused_collectives_is_counted_once_and_fits_in_the_step():
    from dpro.analyze import stragglers

    # one 10 ms step; four tensors fused into one buffer: rank 0 launches them at 1.0-1.3 ms, rank 1 at 9.0-9.3 ms.
    # Rank 0 waits from 1.0 to 9.3 ms: 8.3 ms, not 4 x 8 ms (the old sum per collective gave 32 ms on a 10 ms step)
    arrivals = {(f"COMM.t{i}.allreduce", 5): {0: 1000.0 + 100 * i, 1: 9000.0 + 100 * i} for i in range(4)}
    spans = {(0, 5): (0.0, 10_000.0), (1, 5): (0.0, 10_000.0)}
    rows = {r["rank"]: r for r in stragglers(_model_with_arrivals(arrivals, spans))}
    assert rows[1]["last_to_arrive"] == 4
    assert rows[1]["wait_caused_ms_per_step"] == pytest.approx(8.3)
    assert rows[0]["waits_ms_per_step"] == pytest.approx(8.3) and rows[0]["waits_pct_of_step"] == pytest.approx(83.0)
    assert rows[1]["share_pct"] == pytest.approx(100.0)


def test_straggler_figures_add_up_per_step_for_three_ranks():
    from dpro.analyze import stragglers

    spans = {(r, s): (s * 20_000.0, s * 20_000.0 + 10_000.0) for r in range(3) for s in (1, 2)}
    arrivals = {}
    for s in (1, 2):
        t0 = s * 20_000.0
        arrivals[("COMM.a.allreduce", s)] = {0: t0 + 1000, 1: t0 + 2000, 2: t0 + 6000}   # rank 2 late
        arrivals[("COMM.b.allreduce", s)] = {0: t0 + 7000, 1: t0 + 1500, 2: t0 + 6500}   # rank 0 late
        arrivals[("COMM.c.allreduce", s)] = {0: t0 - 5000, 1: t0 + 1000, 2: t0 + 9000}   # before the step: clipped
    rows = {r["rank"]: r for r in stragglers(_model_with_arrivals(arrivals, spans))}
    waits = sum(r["waits_ms_per_step"] for r in rows.values())
    caused = sum(r["wait_caused_ms_per_step"] for r in rows.values())
    assert caused * 2 == pytest.approx(waits)          # (ranks - 1) x what each caused = what all waited
    assert all(r["waits_ms_per_step"] <= 10.0 and r["waits_pct_of_step"] <= 100.0 for r in rows.values())
    # rank 1 waits 1.0..9.0 ms (a and c, then b): one union, charged to whoever holds each instant longest
    assert rows[1]["waits_ms_per_step"] == pytest.approx(8.0)
    assert rows[0]["waits_ms_per_step"] == pytest.approx(9.0)   # 0..9 ms within its step (c), not 14 ms


def test_nothing_is_written_through_a_linked_analysis_folder(run_dir, tmp_path, capsys):
    """``dpro analyze`` / ``optimize`` write only inside the run directory: an ``analysis`` link elsewhere is
    refused (naming it), and so is a folder where a file goes."""
    from dpro.errors import UsageError
    from dpro.record.trace import analysis_file

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_dir / "analysis").symlink_to(elsewhere)
    assert main(["analyze", str(run_dir)]) == 2
    assert re.search("is a link to .*elsewhere.*only inside the run directory", capsys.readouterr().err)
    assert not any(elsewhere.iterdir())
    (run_dir / "analysis").unlink()
    (run_dir / "analysis" / "replay.json").mkdir(parents=True)
    with pytest.raises(UsageError, match="replay.json is a folder"):
        analysis_file(run_dir, "replay.json")


def test_the_perfetto_trace_shows_the_last_steps_measured(tmp_path):
    from run_builder import make_run

    from dpro.report.perfetto import DEFAULT_MEASURED_STEPS

    run_dir = make_run(tmp_path / "run", steps=range(3, 43))
    analyze_path(run_dir)
    assert not (run_dir / "analysis").exists(), "the analysis API writes nothing: dpro analyze writes the file"
    assert main(["analyze", str(run_dir)]) == 0
    trace = json.loads((run_dir / "analysis" / "replay.json").read_text())
    measured = {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] < 1000}
    assert measured == set(range(43 - DEFAULT_MEASURED_STEPS, 43))
    assert any(e["pid"] >= 1000 for e in trace["traceEvents"] if e["ph"] == "X")


@pytest.mark.slow
def test_parallel_and_serial_analysis_agree_on_a_ddp_run(tmp_path):
    """The rank files read and the recorded steps modelled in worker processes give the analysis read here."""
    import numpy as np

    from dpro.analyze.run import analyze_run

    run_dir = tmp_path / "run"
    torchrun("ddp_job.py", "--model", "mlp", "--steps", "8", "--profile", "2:7", "--run-dir", str(run_dir),
             "--bucket-cap-mb", "0.25")
    serial, parallel = load_run(run_dir, jobs=1), load_run(run_dir, jobs=2)
    for rank, trace in serial.ranks.items():
        assert trace.events == parallel.ranks[rank].events
    here, workers = analyze_run(serial, jobs=1), analyze_run(parallel, jobs=2)
    assert here.analysis == workers.analysis
    for key in ("duration", "gap", "pred_idx"):
        assert np.array_equal(getattr(here.graph, key), getattr(workers.graph, key))
