"""dpro compare: knobs that differ, what explains a slower step, refusal of runs of different models, and two real
DDP runs of one model with different bucket sizes."""

from __future__ import annotations

import json
import sys

import pytest
from jobrunner import run_job, torchrun
from run_builder import make_run, make_run_of, step_events

from dpro.cli import main
from dpro.errors import UsageError
from dpro.report.compare import compare_runs, format_comparison, render_comparison


def slower_backward(rank: int, step: int) -> list[dict]:
    """The hand-built step with BW.fc1 3 ms longer (and what follows it later)."""
    out = []
    for e in step_events(rank, step):
        e = dict(e)
        if e["name"] == "BW.fc1":
            e["dur"] += 3000.0
        elif e["name"] in ("COMM.bucket1.allreduce", "UPDATE.sgd"):
            e["ts"] += 3000.0
        elif e["name"] == "STEP":
            e["dur"] += 3000.0
        out.append(e)
    return out


def test_compare_names_the_op_that_made_the_step_slower(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run_of(tmp_path / "b", slower_backward)
    c = compare_runs(a, b)
    assert c.measured_step_ms[1] - c.measured_step_ms[0] == pytest.approx(3.0, abs=0.05)
    ops = [d for d in c.differences if d["what"].startswith("op ")]
    assert ops[0]["what"] == "op BW.fc1" and ops[0]["delta_ms"] == pytest.approx(3.0, abs=0.01)
    assert ops[0]["share_pct"] == pytest.approx(100, abs=3)
    assert not c.knobs and c.notes
    text = format_comparison(c)
    assert "op BW.fc1" in text and "knobs: the same" in text
    assert "BW.fc1" in render_comparison(c)


def test_compare_lists_changed_knobs_and_json(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    meta = json.loads((b / "run.json").read_text())
    meta["knobs"]["torch.ddp.bucket_cap_mb"] = 1.0
    (b / "run.json").write_text(json.dumps(meta))
    assert main(["compare", str(a), str(b), "--json", "-o", str(tmp_path / "c.html")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["knobs"] == [{"knob": "torch.ddp.bucket_cap_mb", "a": 25.0, "b": 1.0}]
    assert (tmp_path / "c.html").read_text().count("torch.ddp.bucket_cap_mb") >= 1


def test_compare_refuses_runs_of_different_models(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    meta = json.loads((b / "run.json").read_text())
    meta["model_fingerprint"] = "fedcba9876543210"
    (b / "run.json").write_text(json.dumps(meta))
    with pytest.raises(UsageError, match="not runs of one model: model fingerprints differ"):
        compare_runs(a, b)
    assert main(["compare", str(a), str(b)]) == 2
    assert "not runs of one model" in capsys.readouterr().err


def test_compare_without_fingerprints_looks_at_the_gradients(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    for run in (a, b):
        meta = json.loads((run / "run.json").read_text())
        del meta["model_fingerprint"]
        (run / "run.json").write_text(json.dumps(meta))
    compare_runs(a, b)
    model = json.loads((b / "model.json").read_text())
    model["gradients"][0]["name"] = "head.bias"
    model["buckets"][0]["tensors"] = ["fc2.weight", "head.bias"]
    (b / "model.json").write_text(json.dumps(model))
    with pytest.raises(UsageError, match="their gradients differ"):
        compare_runs(a, b)


@pytest.mark.slow
def test_compare_of_two_real_bucket_sizes_names_the_difference(tmp_path):
    runs = []
    for cap in ("25", "0.05"):
        run_dir = tmp_path / f"cap{cap}"
        torchrun("ddp_job.py", "--model", "mlp", "--steps", "10", "--profile", "3:9", "--run-dir", str(run_dir),
                 "--bucket-cap-mb", cap)
        runs.append(str(run_dir))
    out = run_job([sys.executable, "-m", "dpro", "compare", *runs, "--json"]).stdout
    doc = json.loads(out)
    cap = next(k for k in doc["knobs"] if k["knob"] == "torch.ddp.bucket_cap_mb")
    assert cap["a"] == 25.0 and cap["b"] == pytest.approx(0.05, rel=1e-4)  # DDP keeps the cap in whole bytes
    count_a, count_b = doc["collectives"]["count"]
    assert count_b > count_a, "smaller buckets, more collectives"
    assert any(d["what"].startswith(f"collectives per step {count_a:.0f} -> {count_b:.0f}")
               for d in doc["differences"])
    text = run_job([sys.executable, "-m", "dpro", "compare", *runs]).stdout
    assert "torch.ddp.bucket_cap_mb" in text and "what explains the difference" in text
