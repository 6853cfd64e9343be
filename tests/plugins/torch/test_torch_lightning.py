"""Real 2-rank Lightning DDP jobs on CPU recorded by DproCallback, for both Lightning packages."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
from jobrunner import JOBS, run_job

from dpro.analyze import analyze_run
from dpro.io.load import load_run

pytestmark = pytest.mark.slow  # every test here runs a real multi-process job


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_ddp_job_is_recorded(tmp_path, package):
    if importlib.util.find_spec(package.split(".")[0]) is None:
        pytest.skip(f"{package} is not installed")
    run_dir = tmp_path / "run"
    run_job([sys.executable, str(JOBS / "lightning_job.py"), "--package", package, "--steps", "8",
             "--profile", "2:6", "--run-dir", str(run_dir)], timeout=240, cwd=tmp_path)
    run = load_run(run_dir)
    assert run.meta["engine"] == "torch-ddp" and run.meta["world_size"] == 2
    assert run.meta["knobs"]["lightning.strategy"] == "DDPStrategy"
    grad_bytes = run.model["param_bytes"]
    for rank, trace in run.ranks.items():
        assert trace.complete and trace.steps == [2, 3, 4, 5], rank
        for step in trace.steps:
            events = [e for e in trace.events if e["args"]["step"] == step]
            names = {e["name"] for e in events}
            assert {"FW.net.0", "FW.net.6", "BW.net.0", "BW.net.6", "UPDATE.optimizer", "STEP", "IO.batch"} <= names
            assert sum(e["args"]["bytes"] for e in events if e["cat"] == "COMM") == grad_bytes


def test_window_beyond_max_steps_is_refused_before_training(tmp_path):
    proc = run_job([sys.executable, str(JOBS / "lightning_job.py"), "--steps", "4", "--profile", "2:9",
                    "--run-dir", str(tmp_path / "run")], timeout=240, check=False, cwd=tmp_path)
    assert proc.returncode != 0 and "only 4 steps" in proc.stderr
    assert not (tmp_path / "run").exists()


def _steps_of(trace):
    for step in trace.steps:
        yield step, [e for e in trace.events if e["args"]["step"] == step]


def _end(e):
    return e["ts"] + e["dur"]


def test_automatic_optimization_update_is_the_optimizer_only(tmp_path):
    """Lightning runs training_step and backward inside optimizer.step(closure): UPDATE must not span them."""
    run_dir = tmp_path / "run"
    run_job([sys.executable, str(JOBS / "lightning_job.py"), "--package", "lightning.pytorch", "--steps", "8",
             "--profile", "2:6", "--run-dir", str(run_dir)], timeout=240, cwd=tmp_path)
    run = load_run(run_dir)
    for rank, trace in run.ranks.items():
        for step, events in _steps_of(trace):
            (update,) = [e for e in events if e["cat"] == "UPDATE"]
            work = [e for e in events if e["cat"] in ("FW", "BW", "COMM")]
            assert work, (rank, step)
            assert all(_end(e) <= update["ts"] + 1.0 for e in work), (rank, step, update)
            step_event = next(e for e in events if e["cat"] == "STEP")
            assert update["dur"] < 0.5 * step_event["dur"], (rank, step)
    analysis = analyze_run(run).analysis
    assert not any(row["op"] == "UPDATE.optimizer" and row["share_pct"] > 40 for row in analysis.critical_path)


def _assert_two_micro_batches_per_step(run) -> None:
    """Recorded steps 2-4, each with two forwards and backwards (the first micro-batch's before the second's), one
    allreduce of every gradient and one update, no recomputation."""
    grad_bytes = run.model["param_bytes"]
    for rank, trace in run.ranks.items():
        assert trace.steps == [2, 3, 4], rank
        for step, events in _steps_of(trace):
            names = [e["name"] for e in events]
            assert names.count("FW.net.0") == 2 and names.count("BW.net.0") == 2, (rank, step, names)
            assert names.count("UPDATE.optimizer") == 1, (rank, step)
            assert sum(e["args"]["bytes"] for e in events if e["cat"] == "COMM") == grad_bytes
            fws = sorted(e["ts"] for e in events if e["name"] == "FW.net.0")
            bws = sorted(e["ts"] for e in events if e["name"] == "BW.net.0")
            assert fws[0] < bws[0] < fws[1] < bws[1], (rank, step)  # micro-batch 1, then 2
            assert not any(e["cat"] == "RECOMPUTE" for e in events)


@pytest.mark.parametrize("optimization", ["automatic", "manual"])
def test_gradient_accumulation_step_holds_every_micro_batch(tmp_path, optimization):
    """Two batches per optimizer step: one recorded step holds two forwards and backwards, one allreduce
    of every gradient and one UPDATE; the graph keeps both micro-batches as nodes of their own."""
    run_dir = tmp_path / "run"
    run_job([sys.executable, str(JOBS / "lightning_job.py"), "--package", "lightning.pytorch", "--steps", "6",
             "--profile", "2:5", "--accumulate", "2", "--optimization", optimization, "--run-dir", str(run_dir)],
            timeout=240, cwd=tmp_path)
    run = load_run(run_dir)
    _assert_two_micro_batches_per_step(run)
    result = analyze_run(run)
    analysis, g = result.analysis, result.graph
    assert "FW.net.0#2" in g.names and "BW.net.0#2" in g.names
    assert analysis.predicted_step_ms > 0


def test_validation_inside_the_window_is_not_recorded(tmp_path):
    """Lightning validates every 2 batches here; the validation forwards are not training steps' FW events."""
    run_dir = tmp_path / "run"
    run_job([sys.executable, str(JOBS / "lightning_job.py"), "--package", "lightning.pytorch", "--steps", "8",
             "--profile", "2:7", "--val-every", "2", "--run-dir", str(run_dir)], timeout=240, cwd=tmp_path)
    run = load_run(run_dir)
    for rank, trace in run.ranks.items():
        assert trace.steps == [2, 3, 4, 5, 6], rank
        for step, events in _steps_of(trace):
            names = [e["name"] for e in events]
            assert names.count("FW.net.0") == 1 and names.count("BW.net.0") == 1, (rank, step, names)
    analysis = analyze_run(run).analysis
    assert analysis.predicted_step_ms > 0


def test_profiler_slot_records_every_rank_and_summarizes_the_run(tmp_path):
    """Trainer(profiler=DproProfiler(dirpath=..., steps=...)): both ranks recorded through the callback's recorder,
    the run replays within 5 %, and the profiler's summary (Lightning's report at the end of fit) is dpro's.
    (One package's job: the class is both packages' Profiler, the next test; the callback's tests run both.)"""
    run_dir = tmp_path / "run"
    proc = run_job([sys.executable, str(JOBS / "lightning_job.py"), "--package", "lightning.pytorch", "--slot",
                    "profiler", "--steps", "14", "--profile", "4:12", "--run-dir", str(run_dir)], timeout=240,
                   cwd=tmp_path)
    run = load_run(run_dir)
    assert run.meta["world_size"] == 2 and sorted(run.ranks) == [0, 1] and not run.problems
    for rank, trace in run.ranks.items():
        assert trace.complete and trace.steps == list(range(4, 12)), rank
        assert {"FW.net.0", "BW.net.0", "UPDATE.optimizer", "STEP"} <= {e["name"] for e in trace.events}
    analysis = analyze_run(run).analysis
    assert abs(analysis.error_pct) < 5.0, analysis.error_pct
    summary = proc.stdout.split("DPRO SUMMARY\n", 1)[1]
    assert summary.startswith(f"dpro: {run_dir}") and "prediction error" in summary
    assert f"measured step {analysis.measured_step_ms:.2f} ms" in summary
    assert "measured step" in (tmp_path / "fit-run-0.txt").read_text()  # Lightning wrote it (filename given)


def test_the_profiler_is_each_lightning_packages_profiler():
    from dpro.plugins.torch.lightning import DproProfiler

    for package in ("lightning.pytorch", "pytorch_lightning"):
        if importlib.util.find_spec(package.split(".")[0]) is not None:
            profilers = importlib.import_module(f"{package}.profilers")
            assert isinstance(DproProfiler(steps=range(2, 4)), profilers.Profiler), package


@pytest.mark.parametrize("accumulate", [1, 4])
def test_a_configs_micro_batches_run_each_step_as_micro_batches(tmp_path, accumulate):
    """A config's micro_batches=2 reaches a Lightning job with no change to it: accumulate_grad_batches 2 and the
    DataLoader's batches resized to half a step's samples (halved for a job that steps on each batch, doubled for one
    that accumulated 4), so a recorded step holds two forwards and backwards, one allreduce of every gradient and one
    update, and the job still ends after its max_steps."""
    from torch import nn

    from dpro.config import Config, write_config
    from dpro.plugins.torch.apply import fingerprint
    from dpro.plugins.torch.models import get_example

    class Module(nn.Module):  # the job's LightningModule: the same parameter names and shapes
        def __init__(self) -> None:
            super().__init__()
            self.net = get_example("mlp").build()

    config = write_config(tmp_path / "config.json", Config(
        fingerprint={"framework": "torch", "engine": "torch-ddp", "world_size": 2, "model": fingerprint(Module())},
        knobs={"micro_batches": 2}))
    run_dir = tmp_path / "run"
    proc = run_job([sys.executable, str(JOBS / "lightning_job.py"), "--package", "lightning.pytorch", "--steps", "6",
                    "--profile", "2:5", "--accumulate", str(accumulate), "--config", str(config),
                    "--run-dir", str(run_dir)], timeout=240, cwd=tmp_path)
    batch = get_example("mlp").batch_size
    rows = batch * accumulate // 2
    assert f"micro_batches=2: batch_size {batch} -> {rows}, accumulate_grad_batches {accumulate} -> 2" in proc.stderr
    _assert_two_micro_batches_per_step(load_run(run_dir))
