"""Real 2-rank Lightning DDP jobs on CPU recorded by DproCallback, for both Lightning packages."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from jobrunner import JOBS, run_job

from dpro.load import load_run


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
