"""Shared helpers: run real multi-process jobs with a timeout and one thread per rank."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

JOBS = Path(__file__).parent / "jobs"
ATTEMPTS = 5  # a recorded MWMS job crashes in TensorFlow's profiler stop in 1 run in 8 to 1 in 3 (docs/guide/)
T = TypeVar("T")


def job_env(**extra: str) -> dict[str, str]:
    # DPRO_PROBE_COMPILE=0: the compile probe (tens of seconds of inductor builds) only where a test asks for it
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", DPRO_PROBE_COMPILE="0")
    env.update(extra)
    return env


def _fail(argv: list[str], proc: subprocess.CompletedProcess) -> None:
    pytest.fail(f"{' '.join(argv)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                f"--- stderr\n{proc.stderr[-8000:]}")


def run_job(argv: list[str], *, timeout: float = 180, check: bool = True, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a real job; on failure show its output."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env or job_env(), cwd=cwd)
    if check and proc.returncode != 0:
        _fail(argv, proc)
    return proc


def rerun_if_killed_in_framework(job: Callable[[], T], run_dir: Path, failed: Callable[[T], bool]) -> T:
    """Run a recorded job; run it again (``ATTEMPTS`` in all) only when it failed and a rank's recorder says it
    died inside a framework call known to kill processes (``rank-<r>.busy.txt``: TensorFlow 2.21's profiler stop
    aborts a worker in 1 recorded 2-worker job in 8 to 1 in 3). Any other failure is the caller's to report."""
    from dpro.io.load import interrupted_calls

    for attempt in range(1, ATTEMPTS + 1):
        result = job()
        if not failed(result) or attempt == ATTEMPTS or not interrupted_calls(run_dir):
            return result
        print(f"attempt {attempt}: {interrupted_calls(run_dir)}; recording again", file=sys.stderr)
        shutil.rmtree(run_dir, ignore_errors=True)
    raise AssertionError("unreachable")


def run_recorded(argv: list[str], run_dir: Path, **kw) -> subprocess.CompletedProcess:
    """``run_job`` of a job that records into ``run_dir``, again when TensorFlow's profiler killed a worker."""
    proc = rerun_if_killed_in_framework(lambda: run_job(argv, check=False, **kw), run_dir,
                                        lambda p: p.returncode != 0)
    if kw.get("check", True) and proc.returncode != 0:
        _fail(argv, proc)
    return proc


def torchrun(script: str, *args: str, nproc: int = 2, **kw) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N tests/jobs/<script> args...``"""
    return run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    str(JOBS / script), *args], **kw)
