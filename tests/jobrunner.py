"""Shared helpers: run real multi-process jobs with a timeout and one thread per rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).parent / "jobs"


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_job(argv: list[str], *, timeout: float = 180, check: bool = True, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a real job; on failure show its output."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env or job_env(), cwd=cwd)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-8000:]}")
    return proc


def torchrun(script: str, *args: str, nproc: int = 2, **kw) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N tests/jobs/<script> args...``"""
    return run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    str(JOBS / script), *args], **kw)
