"""dpro-launch --engine tf: the TF_CONFIG each worker gets (rank order, ports, local hosts only), the environment
it shares with the torch engine, and real 2-worker tf.distribute.MultiWorkerMirroredStrategy jobs on loopback
(a Keras fit that runs, a failing worker that stops the job, Ctrl-C)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, run_job, run_recorded

from dpro.errors import UsageError
from dpro.launch import process
from dpro.launch.cli import build_parser, config_from_args
from dpro.launch.env import AUTOATTACH_DIR
from dpro.launch.env import job_env as launch_env
from dpro.launch.launchers import LAUNCHERS, TFLauncher
from dpro.launch.process import free_ports
from dpro.launch.settings import LaunchConfig

VENV_BIN = str(Path(sys.executable).parent)
SCRIPT = JOBS / "tf_mwms_fit.py"
HAVE_TF = all(importlib.util.find_spec(name) is not None for name in ("tensorflow", "tf_keras"))
needs_tf = pytest.mark.skipif(not HAVE_TF, reason="tensorflow-cpu and tf_keras are not installed (make venv)")


def parse(*argv: str, cwd: Path | None = None) -> LaunchConfig:
    return config_from_args(build_parser().parse_args(list(argv)), cwd=cwd)


def launcher(*argv: str) -> list[str]:
    return [sys.executable, "-m", "dpro.launch", "--engine", "tf", *argv]


def env_for_jobs(**extra: str) -> dict[str, str]:
    """One thread per worker, `python` is this venv's, TensorFlow's C++ logging quiet."""
    return job_env(PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""), TF_CPP_MIN_LOG_LEVEL="2", **extra)


def tf_configs(argvs: list[list[str]]) -> list[dict]:
    """The TF_CONFIG of each ``env TF_CONFIG=... COMMAND`` argv."""
    out = []
    for argv in argvs:
        assert argv[0] == "env" and argv[1].startswith("TF_CONFIG=")
        out.append(json.loads(argv[1][len("TF_CONFIG="):]))
    return out


# ---- what the engine runs (no job) ----------------------------------------------------------------------------


def test_the_engine_is_offered_and_registered():
    assert LAUNCHERS["tf"] is TFLauncher
    assert parse("-np", "2", "--engine", "tf", "python", "t.py").engine == "tf"
    assert "tf" in build_parser().format_help()
    import dpro.launch.cli as cli

    assert "--engine {auto,torch,horovod,tf,mxnet}" in cli.__doc__ and "TF_CONFIG" in cli.__doc__


def test_command_gives_each_worker_its_tf_config_in_rank_order(tmp_path):
    config = parse("-np", "3", "-H", "localhost:1,127.0.0.1:4", "--engine", "tf", "python", "train.py", "--lr", "0.1",
                   cwd=tmp_path)
    argvs = TFLauncher().command(config, ports=[1111, 2222, 3333])
    assert len(argvs) == 3 and all(argv[2:] == ["python", "train.py", "--lr", "0.1"] for argv in argvs)
    cluster = ["localhost:1111", "127.0.0.1:2222", "127.0.0.1:3333"]  # host 1's slots after host 0's
    assert tf_configs(argvs) == [{"cluster": {"worker": cluster}, "task": {"type": "worker", "index": i}}
                                 for i in range(3)]
    argvs = TFLauncher().command(config)  # free ports of this machine, one per worker and one for dpro's channel
    picked = tf_configs(argvs)
    ports = [int(a.rsplit(":", 1)[1]) for a in picked[0]["cluster"]["worker"]]
    assert len(set(ports)) == 3 and all(p["cluster"] == picked[0]["cluster"] for p in picked)
    sides = {argv[2] for argv in argvs}
    assert len(sides) == 1 and sides.pop().startswith("DPRO_TF_PORT=")
    assert int(argvs[0][2].split("=")[1]) not in ports
    with pytest.raises(UsageError, match="3 workers need 3 ports"):
        TFLauncher().command(config, ports=[1, 2])


def test_free_ports_are_distinct():
    ports = free_ports(4)
    assert len(set(ports)) == 4 and all(0 < p < 65536 for p in ports)


@pytest.mark.parametrize(("argv", "message"), [
    (["-np", "2", "-H", "node7:2"], r"--engine tf: host 'node7' is not this machine; only local hosts .* supported"),
    (["-np", "3", "-H", "localhost:2,127.0.0.2:1"], "host '127.0.0.2' is not this machine"),
    (["-np", "2", "--mpi"], "the tf engine starts its processes itself"),
])
def test_remote_hosts_and_mpi_are_refused(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(*argv, "--engine", "tf", "python", "t.py")
    parse("-np", "2", "-H", "localhost:2,node7:1", "--engine", "tf", "python", "t.py")  # node7 gets no worker


def test_a_remote_host_exits_2_naming_it():
    proc = run_job(launcher("-np", "2", "-H", "node7:2", "python", "t.py"), check=False, timeout=60)
    assert proc.returncode == 2 and "node7" in proc.stderr and "only local hosts" in proc.stderr


@pytest.mark.parametrize("flags", [
    ["--profile", "2:6", "--run-dir", "run"],
    ["--no-profile", "--apply", "auto"],
    ["--auto", "--run-dir", "run", "--force"],
])
def test_tf_workers_get_the_environment_torch_ranks_get(tmp_path, flags):
    tf, torch = (parse("-np", "2", "--engine", name, *flags, "python", "t.py", cwd=tmp_path)
                 for name in ("tf", "torch"))
    env = launch_env(tf)
    assert env == launch_env(torch)
    assert env["DPRO_LAUNCH"] == "1" and env["PYTHONPATH"].split(os.pathsep)[0] == str(AUTOATTACH_DIR)
    assert env["DPRO_AUTO_RECORD"] == ("0" if "--no-profile" in flags else "1")


class _FakeProc:
    stdin = None
    pid = 0

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv, self.env = argv, env

    def wait(self) -> int:
        return 0

    def poll(self) -> int:
        return 0


def test_launch_runs_the_command_with_dpros_environment(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["stale:1"]}, "task": {"index": 0}}')
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config = parse("-np", "2", "--engine", "tf", "--profile", "2:6", "--run-dir", "run", "python", "t.py",
                   cwd=tmp_path)
    started: list[_FakeProc] = []

    def start_worker(argv, env, output_dir=None, cwd=None):
        started.append(_FakeProc(argv, env))
        return started[-1], []

    monkeypatch.setattr(process, "start_worker", start_worker)
    with caplog.at_level("INFO", logger="dpro.launch"):
        assert TFLauncher().launch(config) == 0
    assert "TF_CONFIG is set in this environment" in caplog.text
    configs = tf_configs([p.argv for p in started])
    assert [c["task"]["index"] for c in configs] == [0, 1] and configs[0]["cluster"] == configs[1]["cluster"]
    for proc in started:
        assert "TF_CONFIG" not in proc.env  # the argv's TF_CONFIG is the only one
        assert proc.env["DPRO_AUTO_RECORD"] == "1" and proc.env["DPRO_PROFILE"] == "2:6"
        assert proc.env["DPRO_RUN_DIR"] == str(tmp_path / "run") and proc.env["OMP_NUM_THREADS"] == "1"
        assert proc.env["PYTHONPATH"].split(os.pathsep)[0] == str(AUTOATTACH_DIR)


# ---- real jobs ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_tf
def test_two_mwms_workers_fit_with_one_cluster(tmp_path):
    env = env_for_jobs(TF_CONFIG='{"cluster": {"worker": ["stale:1"]}, "task": {"type": "worker", "index": 5}}')
    proc = run_recorded(launcher("-np", "2", "-H", "localhost:2", "--profile", "2:6", "--run-dir", "run", "python",
                                 str(SCRIPT), "--out", "workers"), tmp_path / "run", env=env, cwd=tmp_path,
                        timeout=240)
    docs = [json.loads((tmp_path / "workers" / f"worker-{i}.json").read_text()) for i in (0, 1)]
    cluster = docs[0]["cluster"]["worker"]
    assert len(cluster) == 2 and len(set(cluster)) == 2 and all(a.startswith("localhost:") for a in cluster)
    for i, doc in enumerate(docs):
        assert doc["index"] == i and doc["task"] == {"type": "worker", "index": i}
        assert doc["cluster"] == {"worker": cluster} and doc["omp_num_threads"] == "1"
        assert f"worker {i} done: 12 steps on 2 replicas" in proc.stdout
    assert sorted(printed_workers(proc.stdout), key=lambda d: d["index"]) == docs
    assert "TF_CONFIG is set in this environment" in proc.stderr  # the stale one was replaced
    launched = json.loads((tmp_path / "run" / "launch.json").read_text())
    assert launched["exit_status"] == 0 and launched["engine"] == "tf"


def printed_workers(stdout: str) -> list[dict]:
    """Each ``TF_WORKER <json>`` record; two workers print to one pipe, so a record may not start a line."""
    decoder, out, at = json.JSONDecoder(), [], stdout.find("TF_WORKER ")
    while at >= 0:
        doc, end = decoder.raw_decode(stdout, at + len("TF_WORKER "))
        out.append(doc)
        at = stdout.find("TF_WORKER ", end)
    return out


def _left(tag: str) -> str:
    if not shutil.which("pgrep"):
        return ""
    return subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout.strip()


@pytest.mark.slow
@needs_tf
@pytest.mark.parametrize("fail_step", [-1, 3], ids=["before-joining", "mid-training"])
def test_a_failing_worker_stops_the_job(tmp_path, fail_step):
    tag = uuid.uuid4().hex
    began = time.monotonic()
    proc = run_job(launcher("-np", "2", "-H", "localhost:2", "--no-profile", "python", str(SCRIPT), "--steps",
                            "100000", "--fail-worker", "1", "--fail-step", str(fail_step), "--tag", tag),
                   env=env_for_jobs(), cwd=tmp_path, timeout=150, check=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert time.monotonic() - began < 120  # worker 0 alone would wait for worker 1 or train 100000 steps
    assert "worker 0 done" not in proc.stdout and not _left(tag), "a worker outlived the launcher"
    if fail_step < 0:  # worker 0 waits for worker 1 until dpro-launch stops it: the status is worker 1's
        assert proc.returncode == 3, proc.stderr[-3000:]
        assert "worker 1 exited with status 3; stopping the others" in proc.stderr


@pytest.mark.slow
@needs_tf
def test_ctrl_c_stops_every_worker(tmp_path):
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(launcher("-np", "2", "--no-profile", "--output-filename", "logs", "python", str(SCRIPT),
                                     "--steps", "1000000", "--out", "workers", "--tag", tag),
                            env=env_for_jobs(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while len(list((tmp_path / "workers").glob("worker-*.json"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(5.0)  # into model.fit
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert not _left(tag), "a worker outlived the launcher"
    for rank in (0, 1):  # --output-filename: each worker's output in logs/rank.<r>/
        assert f'"index": {rank}' in (tmp_path / "logs" / f"rank.{rank}" / "stdout").read_text()


def _comm_packs(run_dir: Path, rank: int = 0) -> set[str]:
    doc = json.loads((run_dir / f"rank-{rank}.json").read_text())
    return {e["name"] for e in doc["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("COMM.pack")}


def _config_for(run_dir: Path, path: Path, **fingerprint: object) -> Path:
    """A config made for the job recorded in ``run_dir`` (its fingerprint, changed by ``fingerprint``) that sets
    64-byte packs."""
    made = json.loads((run_dir / "run.json").read_text())
    fp = {"framework": made["framework"], "engine": made["engine"], "world_size": made["world_size"],
          "model": made["model_fingerprint"], **fingerprint}
    path.write_text(json.dumps({"schema": "dpro.config/1", "fingerprint": fp,
                                "knobs": {"tf.mwms.bytes_per_pack": 64}}))
    return path


@pytest.mark.slow
@needs_tf
def test_a_config_is_applied_to_an_unmodified_script_and_refused_for_another_model(tmp_path):
    env = env_for_jobs()
    job = ("python", str(SCRIPT), "--steps", "10")
    run_recorded(launcher("-np", "2", "--profile", "4:7", "--run-dir", "rec", *job), tmp_path / "rec", env=env,
                 cwd=tmp_path, timeout=240)
    assert len(_comm_packs(tmp_path / "rec")) == 1  # MWMS's default: one pack
    config = _config_for(tmp_path / "rec", tmp_path / "small-packs.json")
    proc = run_recorded(launcher("-np", "2", "--profile", "4:7", "--run-dir", "applied", "--apply", str(config),
                                 *job), tmp_path / "applied", env=env, cwd=tmp_path, timeout=240)
    assert proc.stderr.count("tf.mwms.bytes_per_pack=64") == 1  # said once, by worker 0
    meta = json.loads((tmp_path / "applied" / "run.json").read_text())
    assert meta["knobs"]["tf.mwms.bytes_per_pack"] == 64
    assert len(_comm_packs(tmp_path / "applied")) > 1 and _comm_packs(tmp_path / "applied", 1) == _comm_packs(
        tmp_path / "applied")
    other = _config_for(tmp_path / "rec", tmp_path / "other.json", model="0123456789abcdef")
    refused = run_job(launcher("-np", "2", "--no-profile", "--apply", str(other), *job), env=env, cwd=tmp_path,
                      timeout=240, check=False)
    assert refused.returncode != 0 and "config was made for model 0123456789abcdef" in refused.stderr
