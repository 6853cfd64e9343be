"""torch.compile'd models under the Profiler and dpro-launch: the job runs as it does unrecorded, and is recorded at
the level of steps, collectives and the optimizer (per-module timing of compiled code is not attempted)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, run_job, torchrun

pytest.importorskip("torch")

from dpro.analyze import analyze_run  # noqa: E402
from dpro.io.load import load_run  # noqa: E402

pytestmark = pytest.mark.slow  # real 2-rank jobs, each compiling its model (about 20 s on a CPU)


def assert_recorded_without_modules(run_dir: Path, steps: list[int]) -> None:
    run = load_run(run_dir)
    assert not run.problems
    for rank in (0, 1):
        events = run.ranks[rank].events
        cats = {e["cat"] for e in events}
        assert {"STEP", "COMM", "UPDATE"} <= cats and not cats & {"FW", "BW", "IO"}, (rank, cats)
        assert sorted({e["args"]["step"] for e in events if e["cat"] == "STEP"}) == steps
    step_ms = sorted(e["dur"] / 1000 for e in run.ranks[0].events if e["cat"] == "STEP")
    # the window opens without making the job compile again (a compile takes seconds, a step milliseconds)
    assert step_ms[-1] < 500, step_ms
    assert analyze_run(run).analysis.predicted_step_ms > 0


def test_a_compiled_ddp_model_under_the_profiler(tmp_path):
    run_dir = tmp_path / "run"
    proc = torchrun("ddp_job.py", "--model", "mlp", "--steps", "8", "--profile", "2:7", "--compile",
                    "--run-dir", str(run_dir), timeout=300)
    assert "runs under torch.compile" in proc.stderr
    assert_recorded_without_modules(run_dir, [2, 3, 4, 5, 6])


@pytest.mark.parametrize("compiled", ["ddp", "block"])
def test_an_unmodified_compiled_script_under_dpro_launch(tmp_path, compiled):
    """torch.compile(DDP(model)) (Dynamo once traced dpro's forward hook and failed on FakeTensor.nbytes), and a
    model with one submodule compiled in place."""
    env = job_env(PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    run_job([sys.executable, "-m", "dpro.launch", "-np", "2", "--profile", "2:6", "--run-dir", "run", "python",
             str(JOBS / "compiled_ddp.py"), "--steps", "8", "--compile", compiled], env=env, cwd=tmp_path, timeout=300)
    assert_recorded_without_modules(tmp_path / "run", [2, 3, 4, 5])
