"""dpro-launch --engine mxnet: MXNet's parameter server (ps-lite) started the way MXNet's own launcher does — a
scheduler, servers and workers, each running the job's command with DMLC_* — on real dist_sync jobs of an
unmodified Gluon script (``tests/jobs/mxnet_gluon_job.py``), run by the MXNet venv's interpreter (``make mxnet``:
MXNet 1.9.1 needs numpy < 1.24, so it has a venv of its own)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, run_job

from dpro.errors import UsageError
from dpro.launch.cli import build_parser, config_from_args
from dpro.launch.launchers import MXNetLauncher

ROOT = Path(__file__).resolve().parents[2]
MXNET_PYTHON = ROOT / ".venv-mxnet" / "bin" / "python"
JOB = JOBS / "mxnet_gluon_job.py"
needs_mxnet = pytest.mark.skipif(not MXNET_PYTHON.exists(), reason="no MXNet venv here (make mxnet builds it)")


def config(*argv: str, cwd: Path | None = None):
    return config_from_args(build_parser().parse_args(list(argv)), cwd=cwd)


def launcher(*argv: str) -> list[str]:
    return [sys.executable, "-m", "dpro.launch", "--engine", "mxnet", "-np", "2", "-H", "localhost:2", *argv]


# ---- the processes and their environment (no job) ------------------------------------------------------

def test_a_scheduler_servers_and_workers_with_the_ps_lite_environment(tmp_path):
    roles = MXNetLauncher().roles(config("--engine", "mxnet", "-np", "3", "--num-servers", "2", "python", "t.py",
                                       cwd=tmp_path), port=9123)
    assert [label for label, _ in roles] == ["scheduler", "server 0", "server 1", "worker 0", "worker 1", "worker 2"]
    assert [env["DMLC_ROLE"] for _, env in roles] == ["scheduler", "server", "server", "worker", "worker", "worker"]
    for _, env in roles:
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1" and env["DMLC_PS_ROOT_PORT"] == "9123"
        assert env["DMLC_NUM_SERVER"] == "2" and env["DMLC_NUM_WORKER"] == "3"
    default = MXNetLauncher().roles(config("--engine", "mxnet", "-np", "2", "python", "t.py", cwd=tmp_path), port=1)
    assert sum(env["DMLC_ROLE"] == "server" for _, env in default) == 2  # one per worker, as MXNet's launcher


def test_an_applied_config_chooses_the_number_of_servers(tmp_path):
    made = tmp_path / "config.json"
    made.write_text(json.dumps({"schema": "dpro.config/1",
                                "fingerprint": {"framework": "mxnet", "engine": "mxnet-ps", "world_size": 2,
                                                "model": "0" * 16},
                                "knobs": {"env": {"DMLC_NUM_SERVER": "3", "MXNET_KVSTORE_BIGARRAY_BOUND": "5000"}}}))
    roles = MXNetLauncher().roles(config("--engine", "mxnet", "-np", "2", "--num-servers", "1", "--apply", str(made),
                                       "python", "t.py", cwd=tmp_path), port=9123)
    assert sum(env["DMLC_ROLE"] == "server" for _, env in roles) == 3
    assert {env["DMLC_NUM_SERVER"] for _, env in roles} == {"3"}


@pytest.mark.parametrize(("argv", "says"), [
    (["--num-servers", "2", "-np", "2", "python", "t.py"], "--num-servers starts MXNet parameter servers"),
    (["--engine", "mxnet", "--num-servers", "0", "-np", "2", "python", "t.py"], "positive number of servers"),
    (["--engine", "mxnet", "-np", "2", "-H", "node7:2", "python", "t.py"], "not this machine"),
    (["--engine", "mxnet", "--gloo", "-np", "2", "python", "t.py"], "Horovod's controller"),
])
def test_wrong_mxnet_options_are_refused_with_the_fix(tmp_path, argv, says):
    with pytest.raises(UsageError, match=says):
        config(*argv, cwd=tmp_path)


# ---- real jobs -----------------------------------------------------------------------------------------

@pytest.mark.slow
@needs_mxnet
def test_an_unmodified_gluon_job_runs_on_two_servers(tmp_path):
    proc = run_job(launcher("--num-servers", "2", str(MXNET_PYTHON), str(JOB), "--steps", "6"), cwd=tmp_path,
                   timeout=120)
    assert "mxnet worker 0 of 2 done" in proc.stdout and "mxnet worker 1 of 2 done" in proc.stdout
    assert "ended before iteration 10" in proc.stderr  # --profile's default window is never reached: said so


@pytest.mark.slow
@needs_mxnet
def test_a_dead_worker_stops_the_job_with_its_status(tmp_path):
    began = time.monotonic()
    proc = run_job(launcher("--no-profile", str(MXNET_PYTHON), str(JOB), "--steps", "500", "--fail-at", "2"),
                   cwd=tmp_path, timeout=120, check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    # ps-lite numbers the workers as they connect (kv.rank), so the one that died may be dpro's worker 0 or 1
    assert re.search(r"worker [01] exited with status 3; stopping the others", proc.stderr), proc.stderr
    assert time.monotonic() - began < 60  # the servers and the other worker, which would wait forever, are stopped


def _servers_of(root: int) -> list[int]:
    """The pids under ``root`` whose environment says DMLC_ROLE=server."""
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        queue += [int(c) for c in children]
        if b"DMLC_ROLE=server" in environ:
            found.append(pid)
    return found


@pytest.mark.slow
@needs_mxnet
def test_a_killed_server_stops_the_job(tmp_path):
    proc = subprocess.Popen(launcher("--no-profile", str(MXNET_PYTHON), str(JOB), "--steps", "100000"),
                            cwd=tmp_path, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        servers: list[int] = []
        while not servers and time.monotonic() < deadline:
            time.sleep(0.5)
            servers = _servers_of(proc.pid)
        assert servers, "no server process appeared"
        time.sleep(2)  # the job is training
        os.kill(servers[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "server" in err and "stopping the others" in err
