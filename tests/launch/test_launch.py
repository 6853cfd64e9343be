"""dpro-launch: horovodrun's command line, the settings -> environment table, and real jobs it starts
(unmodified scripts recorded, --auto, a failing rank, Ctrl-C, a second host reached over a real sshd)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jobrunner import JOBS, job_env, run_job

from dpro.config import read_config
from dpro.engines import load_prepared
from dpro.errors import UsageError
from dpro.launch import horovod_run, process
from dpro.launch.cli import build_parser, config_from_args
from dpro.launch.env import AUTOATTACH_DIR
from dpro.launch.env import job_env as launch_env
from dpro.launch.horovod_run import HOROVOD_KNOBS, horovod_env, horovodrun_flags, options_of, settings_of
from dpro.launch.launchers import HorovodLauncher, TorchLauncher
from dpro.launch.settings import LaunchConfig, detect_engine, is_local_host, parse_hosts
from dpro.record.protocol import Window

VENV_BIN = str(Path(sys.executable).parent)


def parse(*argv: str, cwd: Path | None = None) -> LaunchConfig:
    return config_from_args(build_parser().parse_args(list(argv)), cwd=cwd)


def launcher(*argv: str) -> list[str]:
    return [sys.executable, "-m", "dpro.launch", *argv]


def env_for_jobs() -> dict[str, str]:
    """One thread per rank, and `python` in a command is this venv's."""
    return job_env(PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))


# ---- the command line ------------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "field", "value", "env"), [
    (["--fusion-threshold-mb", "32"], "fusion_threshold_mb", 32.0, {"HOROVOD_FUSION_THRESHOLD": "33554432"}),
    (["--fusion-threshold-mb", "0.5"], "fusion_threshold_mb", 0.5, {"HOROVOD_FUSION_THRESHOLD": "524288"}),
    (["--cycle-time-ms", "2.5"], "cycle_time_ms", 2.5, {"HOROVOD_CYCLE_TIME": "2.5"}),
    (["--cache-capacity", "512"], "cache_capacity", 512, {"HOROVOD_CACHE_CAPACITY": "512"}),
    (["--hierarchical-allreduce"], "hierarchical_allreduce", True, {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}),
    (["--no-hierarchical-allgather"], "hierarchical_allgather", False, {"HOROVOD_HIERARCHICAL_ALLGATHER": "0"}),
    (["--timeline-filename", "t.json"], "timeline_filename", "t.json", {"HOROVOD_TIMELINE": "t.json"}),
    (["--timeline-filename", "t.json", "--timeline-mark-cycles"], "timeline_mark_cycles", True,
     {"HOROVOD_TIMELINE": "t.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1"}),
    (["--autotune"], "autotune", True, {"HOROVOD_AUTOTUNE": "1"}),
    (["--autotune", "--autotune-log-file", "at.csv"], "autotune_log_file", "at.csv",
     {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "at.csv"}),
    (["--autotune", "--autotune-warmup-samples", "4"], "autotune_warmup_samples", 4,
     {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "4"}),
    (["--autotune", "--autotune-steps-per-sample", "7"], "autotune_steps_per_sample", 7,
     {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "7"}),
    (["--autotune", "--autotune-bayes-opt-max-samples", "9"], "autotune_bayes_opt_max_samples", 9,
     {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "9"}),
    (["--autotune", "--autotune-gaussian-process-noise", "0.3"], "autotune_gaussian_process_noise", 0.3,
     {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.3"}),
    (["--autotune-warmup-samples", "4"], "autotune_warmup_samples", 4, {}),  # as horovodrun: only with --autotune
    (["--no-stall-check"], "no_stall_check", True, {"HOROVOD_STALL_CHECK_DISABLE": "1"}),
    (["--stall-check-warning-time-seconds", "60"], "stall_check_warning_time_seconds", 60,
     {"HOROVOD_STALL_CHECK_TIME_SECONDS": "60"}),
    (["--log-level", "debug"], "log_level", "DEBUG", {"HOROVOD_LOG_LEVEL": "DEBUG"}),
])
def test_horovodrun_settings_become_fields_and_environment(flags, field, value, env):
    config = parse("-np", "2", *flags, "python", "train.py")
    assert getattr(settings_of(config), field) == value
    assert horovod_env(settings_of(config)) == env
    assert {k: v for k, v in launch_env(config).items() if k.startswith("HOROVOD_")} == env
    # the same table gives horovodrun's flags, which parse back to the same settings; a fraction of a MB,
    # which horovodrun's --fusion-threshold-mb (an int) refuses, is passed by the environment alone
    flags = horovodrun_flags(settings_of(config))
    again = parse("-np", "2", *flags, "python", "train.py")
    if field == "fusion_threshold_mb" and not float(value).is_integer():
        assert flags == [] and horovod_env(settings_of(again)) == {}
    else:
        assert horovod_env(settings_of(again)) == env


def test_backward_marks_reach_the_ranks_only_when_asked_for():
    assert "DPRO_BACKWARD_MARKS" not in launch_env(parse("-np", "2", "python", "train.py"))
    config = parse("-np", "2", "--backward-marks", "tensors", "python", "train.py")
    assert config.backward_marks == "tensors" and launch_env(config)["DPRO_BACKWARD_MARKS"] == "tensors"
    with pytest.raises(UsageError, match="backward-marks"):
        LaunchConfig(command=["python", "train.py"], np=2, backward_marks="hooks")


def test_every_horovod_knob_has_a_flag():
    parser = build_parser()
    options = {opt for action in parser._actions for opt in action.option_strings}
    for knob in HOROVOD_KNOBS:
        assert knob.flag in options, knob
        assert knob.env.startswith("HOROVOD_")


def test_process_and_host_flags(tmp_path):
    key = tmp_path / "id_test"
    key.write_text("not a real key")
    config = parse("-np", "3", "-H", "a:2,b:2", "-p", "2222", "-i", str(key), "--gloo", "--start-timeout", "5",
                   "--network-interfaces", "lo", "--output-filename", "logs", "--verbose", "--engine", "torch",
                   "python", "train.py", "--lr", "0.1")
    assert config.command == ["python", "train.py", "--lr", "0.1"]
    assert [(h.name, h.slots) for h in config.hosts] == [("a", 2), ("b", 2)]
    assert [(h.name, n) for h, n in config.placement()] == [("a", 2), ("b", 1)]
    assert (config.ssh_port, config.ssh_identity_file, options_of(config).controller) == (
        2222, str(key.resolve()), "gloo")
    assert (config.start_timeout, config.output_filename, config.verbose) == (5.0, "logs", True)
    env = launch_env(config)
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env.get("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS")) == os.environ.get("OMP_NUM_THREADS", "1")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(AUTOATTACH_DIR)
    assert (AUTOATTACH_DIR / "sitecustomize.py").is_file()


def test_hostfile_and_defaults(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=2\nnode2:3\nnode3\n")
    config = parse("-np", "6", "--hostfile", str(hostfile), "--engine", "torch", "python", "x.py")
    assert [(h.name, h.slots) for h in config.hosts] == [("node1", 2), ("node2", 3), ("node3", 1)]
    single = parse("-np", "2", "python", "x.py")
    assert [(h.name, h.slots) for h in single.hosts] == [("localhost", 2)] and not single.multi_host
    assert single.profile == Window(10, 20) and single.engine == "torch"


def test_torchruns_flags_give_the_processes_and_the_command():
    config = parse("--nproc-per-node", "2", "--standalone", "train.py", "--lr", "0.1")
    assert config.np == 2 and [(h.name, h.slots) for h in config.hosts] == [("localhost", 2)]
    assert config.command == [sys.executable, "train.py", "--lr", "0.1"]  # torchrun runs the script with python
    module = parse("--nproc_per_node", "2", "--nnodes", "1:1", "--rdzv-backend", "c10d", "-m", "pkg.train", "-x")
    assert module.command == [sys.executable, "-m", "pkg.train", "-x"]
    nodes = parse("--nproc-per-node", "2", "--nnodes", "2", "-H", "a,b", "--engine", "torch", "train.py")
    assert nodes.np == 4 and [(h.name, h.slots) for h in nodes.hosts] == [("a", 2), ("b", 2)]
    assert parse("--nproc-per-node", "2", "--no-python", "./run.sh").command == ["./run.sh"]


@pytest.mark.parametrize(("argv", "message"), [
    (("x.py",), "give the number of processes: -np N"),
    (("-np", "2", "--nproc-per-node", "2", "x.py"), "not both"),
    (("--nproc-per-node", "2", "--node-rank", "1", "x.py"), "starts every node itself"),
    (("--nproc-per-node", "2", "--nnodes", "2", "x.py"), "name the nodes with -H"),
    (("--nproc-per-node", "gpu", "x.py"), "positive integer"),
    (("--nproc-per-node", "2", "--nnodes", "1:4", "x.py"), "elastic ranges"),
    (("--nproc-per-node", "2", "--max-restarts", "3", "x.py"), "not supported"),
    (("-np", "2", "-m", "pkg"), "go with --nproc-per-node"),
])
def test_what_one_launcher_cannot_do_with_torchruns_flags_is_said(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(*argv)


def test_unknown_flag_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["-np", "2", "--min-np", "1", "python", "train.py"])
    assert exc.value.code == 2
    assert "--min-np" in capsys.readouterr().err


def test_console_script_and_manual():
    script = Path(sys.executable).parent / "dpro-launch"
    if not script.is_file():
        pytest.skip("dpro-launch is not installed as a console script (pip install -e .)")
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--fusion-threshold-mb" in out.stdout and "--auto" in out.stdout
    import dpro.launch.cli as cli

    for topic in ("--engine", "--apply FILE|auto", "Faults", "sitecustomize", "HOROVOD_FUSION_THRESHOLD"):
        assert topic in cli.__doc__


def test_auto_refuses_a_used_applied_directory(tmp_path):
    (tmp_path / "r-applied").mkdir()
    (tmp_path / "r-applied" / "run.json").write_text("{}")
    with pytest.raises(UsageError, match="already holds a run"):
        parse("-np", "2", "--auto", "--run-dir", "r", "python", "x.py", cwd=tmp_path)


def test_unknown_flag_from_the_command_line(tmp_path):
    proc = run_job(launcher("-np", "2", "--bogus-flag", "python", "x.py"), check=False, timeout=60)
    assert proc.returncode == 2 and "--bogus-flag" in proc.stderr


@pytest.mark.parametrize(("hosts", "message"), [
    ("a:x", "--hosts 'a:x': slots must be an integer, e.g. a:4"),
    ("a:0", "slots must be at least 1"),
    (":4", "the host name is missing"),
    ("a:1,a:2", "listed twice"),
    (",", "no hosts given"),
])
def test_bad_hosts_are_explained(hosts, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_hosts(hosts)


def test_bad_hosts_on_the_command_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        from dpro.launch.cli import main

        main(["-np", "2", "-H", "a:x", "python", "x.py"])
    assert exc.value.code == 2
    assert "slots must be an integer, e.g. a:4" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["-np", "4", "-H", "a:1,b:2"], "more processes than the hosts have slots"),
    (["-np", "0"], "positive integer"),
    (["-np", "2", "--profile", "0:5"], "starts at 1 or later"),
    (["-np", "2", "--profile", "6:2"], "STOP must be greater than START"),
    (["-np", "2", "--profile", "ten"], "expected START:STOP"),
    (["-np", "2", "--profile", "10:40:1"], "BLOCK must be 2 or more"),
    (["-np", "2", "--profile", "10:40:5:2"], "START:STOP:BLOCK"),
    (["-np", "2", "--fusion-threshold-mb", "-1"], "must be >= 0"),
    (["-np", "2", "--autotune-gaussian-process-noise", "2"], r"must be in \[0, 1\]"),
    (["-np", "2", "--mpi", "--engine", "torch"], "--engine horovod"),
    (["-np", "2", "--auto", "--no-profile"], "cannot be combined with --no-profile"),
    (["-np", "2", "--optimize", "--no-profile"], "cannot be combined with --no-profile"),
    (["-np", "2", "--apply", "missing.json"], "no such file"),
    (["-np", "2", "--memory-budget", "lots"], "expected a size"),
])
def test_bad_values_are_explained(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(*argv, "python", "x.py")


def test_horovod_records_in_blocks_by_default(tmp_path):
    """Horovod's default window alternates recorded and unrecorded blocks (the overhead's baseline is the gaps);
    the other engines record ten steps; --profile wins, and the window reaches the ranks as it was given."""
    horovod = parse("-np", "2", "--engine", "horovod", "python", "x.py")
    assert horovod.profile == Window(10, 40, 5)
    assert horovod.profile.steps == [*range(10, 15), *range(20, 25), *range(30, 35)]
    assert parse("-np", "2", "--engine", "torch", "python", "x.py").profile == Window(10, 20)
    given = parse("-np", "2", "--engine", "horovod", "--profile", "5:25:4", "python", "x.py")
    assert given.profile.steps == [5, 6, 7, 8, 13, 14, 15, 16, 21, 22, 23, 24]
    assert launch_env(given)["DPRO_PROFILE"] == "5:25:4"


def test_no_command_is_explained():
    with pytest.raises(UsageError, match="no command given"):
        parse("-np", "2")


def test_config_file_loses_to_the_command_line(tmp_path):
    yaml_file = tmp_path / "hvd.yaml"
    yaml_file.write_text("params:\n  fusion_threshold_mb: 8\n  cycle_time_ms: 3\nautotune:\n  enabled: true\n"
                         "logging:\n  level: warning\ncontroller: gloo\n")
    config = parse("-np", "2", "--config-file", str(yaml_file), "--fusion-threshold-mb", "16", "python", "x.py")
    env = horovod_env(settings_of(config))
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(16 * 2**20) and env["HOROVOD_CYCLE_TIME"] == "3"
    assert env["HOROVOD_AUTOTUNE"] == "1" and env["HOROVOD_LOG_LEVEL"] == "WARNING"
    assert options_of(config).controller == "gloo"


def test_engine_auto_detects_horovod(tmp_path):
    hvd = tmp_path / "hvd_train.py"
    hvd.write_text("import torch\nimport horovod.torch as hvd\nhvd.init()\n")
    assert detect_engine(["python", str(hvd)]) == "horovod"
    assert detect_engine(["python", str(JOBS / "plain_ddp.py")]) == "torch"
    assert parse("-np", "2", "python", "hvd_train.py", cwd=tmp_path).engine == "horovod"


def test_local_host_names_are_exact():
    assert is_local_host("localhost") and is_local_host("127.0.0.1") and is_local_host(socket.gethostname())
    assert not is_local_host("127.0.0.2") and not is_local_host("localhost.example")


def test_remote_command_is_quoted_word_by_word(tmp_path):
    config = parse("-np", "2", "-H", "127.0.0.2:1,localhost:1", "-p", "2200", "--engine", "torch",
                   "python", "train.py", "--name", "a b; rm -rf /", "--q", "it's", cwd=tmp_path)
    remote, local = TorchLauncher().command(config, master_port=1234)
    assert local[:3] == [sys.executable, "-m", "dpro.launch.node"]
    assert remote[0] == "ssh" and remote[remote.index("--") + 1] == "127.0.0.2" and "2200" in remote
    words = shlex.split(remote[-1])
    assert words[:4] == ["cd", str(tmp_path.resolve()), "&&", "exec"]
    assert words[words.index("--") + 1:] == ["python", "train.py", "--name", "a b; rm -rf /", "--q", "it's"]
    assert sys.executable in words and "--node-rank" in words and "DPRO_AUTO_RECORD=1" in words
    assert f"PYTHONPATH={AUTOATTACH_DIR}" in [w.split(os.pathsep)[0] for w in words]
    assert local[local.index("--master-port") + 1] == "1234"


def test_horovod_engine_passes_flags_or_says_how_to_install(tmp_path, monkeypatch):
    config = parse("-np", "2", "-H", "a:1,b:1", "-p", "2222", "--engine", "horovod", "--fusion-threshold-mb", "32",
                   "--cycle-time-ms", "2", "--autotune", "--log-level", "INFO", "python", "t.py", cwd=tmp_path)
    monkeypatch.setattr(horovod_run, "find_horovodrun", lambda: None)
    with pytest.raises(UsageError, match="horovodrun is not installed.*pip install"):
        HorovodLauncher().command(config)
    monkeypatch.setattr(horovod_run, "find_horovodrun", lambda: "/opt/bin/horovodrun")
    (argv,) = HorovodLauncher().command(config)
    assert argv[:3] == ["/opt/bin/horovodrun", "-np", "2"] and argv[-2:] == ["python", "t.py"]
    assert argv[argv.index("-H") + 1] == "a:1,b:1" and argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("--fusion-threshold-mb") + 1] == "32"  # horovodrun's option takes whole MB
    assert "--autotune" in argv and argv[argv.index("--log-level") + 1] == "INFO"


def test_horovod_engine_gets_a_dynamic_timeline_when_asked_for(tmp_path, monkeypatch):
    monkeypatch.delenv("HOROVOD_TIMELINE", raising=False)
    config = parse("-np", "2", "--engine", "horovod", "python", "t.py", cwd=tmp_path)
    assert "HOROVOD_TIMELINE" not in launch_env(config)
    asked = parse("-np", "2", "--engine", "horovod", "--horovod-timeline", "python", "t.py", cwd=tmp_path)
    assert launch_env(asked)["HOROVOD_TIMELINE"] == "DYNAMIC"
    named = parse("-np", "2", "--engine", "horovod", "--timeline-filename", "tl.json", "python", "t.py", cwd=tmp_path)
    assert launch_env(named)["HOROVOD_TIMELINE"] == "tl.json"
    quiet = parse("-np", "2", "--engine", "horovod", "--no-profile", "python", "t.py", cwd=tmp_path)
    assert "HOROVOD_TIMELINE" not in launch_env(quiet) and launch_env(quiet)["DPRO_AUTO_RECORD"] == "0"


def test_an_applied_config_env_wins_over_flags(tmp_path):
    from dpro.config import Config, write_config

    cfg = write_config(tmp_path / "c.json", Config(
        fingerprint={"framework": "torch", "engine": "horovod", "world_size": 2, "model": "x"},
        knobs={"env": {"HOROVOD_FUSION_THRESHOLD": "8388608"}}))
    config = parse("-np", "2", "--engine", "horovod", "--fusion-threshold-mb", "32", "--apply", str(cfg),
                   "python", "t.py", cwd=tmp_path)
    env = launch_env(config)
    assert env["HOROVOD_FUSION_THRESHOLD"] == "8388608" and env["DPRO_CONFIG"] == str(cfg)
    assert horovodrun_flags(settings_of(config), skip_env=env) == []


def test_autoattach_is_lazy_and_chains_the_users_sitecustomize(tmp_path):
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
    code = ("import os, sys; print(os.environ.get('USER_SITECUSTOMIZE_RAN'), 'torch' in sys.modules, "
            "'dpro.plugins.torch.autoattach' in sys.modules)")
    env = job_env(PYTHONPATH=os.pathsep.join([str(AUTOATTACH_DIR), str(user)]), DPRO_AUTO_RECORD="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "False", "True"], out.stderr


# ---- real jobs ---------------------------------------------------------------------------------------------


def _events(run, rank: int, cat: str) -> list[dict]:
    return [e for e in run.ranks[rank].events if e["cat"] == cat]


@pytest.mark.slow
def test_unmodified_script_is_recorded(tmp_path):
    script = JOBS / "plain_ddp.py"
    code = [line for line in script.read_text().splitlines() if line.lstrip().startswith(("import ", "from "))]
    assert code and not any("dpro" in line for line in code)  # the script never imports dpro
    with socket.socket() as taken:  # a MASTER_PORT in the environment that is in use does not matter
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {**env_for_jobs(), "MASTER_PORT": str(taken.getsockname()[1])}
        proc = run_job(launcher("-np", "2", "--profile", "2:6", "--run-dir", "run", "python", str(script),
                                "--print-env"), env=env, cwd=tmp_path, timeout=180)
    run = load_prepared(tmp_path / "run")
    assert run.meta["world_size"] == 2 and run.meta["engine"] == "torch-ddp" and not run.problems
    assert run.meta["knobs"]["dpro.launch"] == "autoattach"
    for rank in (0, 1):
        assert (tmp_path / "run" / f"rank-{rank}.json").is_file()
        steps = [e["args"]["step"] for e in _events(run, rank, "STEP")]
        assert steps == [2, 3, 4, 5]
        assert _events(run, rank, "COMM") and _events(run, rank, "UPDATE")
        # BW from the gradient marks: the ReLUs, which have no gradients of their own, share a span (estimated)
        assert {e["name"] for e in _events(run, rank, "BW") if "estimated" in e["args"]} >= {"BW.1", "BW.3"}
    # two ranks print to one pipe: their lines can interleave, so find each record by its shape
    env_lines = sorted(re.findall(r"ENV RANK=\d .*?OMP_NUM_THREADS=\d+", proc.stdout))
    assert env_lines == [f"ENV RANK={r} LOCAL_RANK={r} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 "
                         f"OMP_NUM_THREADS=1" for r in (0, 1)]
    launched = json.loads((tmp_path / "run" / "launch.json").read_text())
    assert launched["exit_status"] == 0 and launched["engine"] == "torch"


@pytest.mark.slow
def test_a_script_with_its_own_profiler_is_recorded_once(tmp_path):
    run_job(launcher("-np", "2", "--run-dir", "run", "--profile", "2:6", "python", str(JOBS / "self_profiled_ddp.py")),
            env=env_for_jobs(), cwd=tmp_path, timeout=180)
    runs = sorted(p.parent for p in tmp_path.rglob("run.json"))
    assert len(runs) == 1, runs
    (recorded,) = runs
    assert recorded.parent == tmp_path / "run"  # its Profiler(run_dir=None) went under $DPRO_RUN_DIR
    run = load_prepared(recorded)
    assert "dpro.launch" not in run.meta["knobs"] and sorted(run.ranks) == [0, 1]


@pytest.mark.slow
def test_an_unmodified_lightning_script_gets_the_callback(tmp_path):
    pytest.importorskip("lightning")
    run_job(launcher("-np", "2", "--profile", "2:6", "--run-dir", "run", "python", str(JOBS / "plain_lightning.py")),
            env=env_for_jobs(), cwd=tmp_path, timeout=300)
    run = load_prepared(tmp_path / "run")
    assert run.meta["knobs"]["lightning.strategy"] == "DDPStrategy" and sorted(run.ranks) == [0, 1]
    assert [e["args"]["step"] for e in _events(run, 0, "STEP")] == [2, 3, 4, 5]


@pytest.mark.slow
def test_auto_profiles_optimizes_reruns_and_compares(tmp_path):
    proc = run_job(launcher("-np", "2", "--auto", "--profile", "3:9", "--run-dir", "runs/a", "python",
                            str(JOBS / "plain_ddp.py"), "--steps", "10", "--width", "512"),
                   env=env_for_jobs(), cwd=tmp_path, timeout=300)
    before, after = tmp_path / "runs" / "a", tmp_path / "runs" / "a-applied"
    verdict = json.loads((after / "analysis" / "auto.json").read_text())
    kept = verdict["kept"] == "config"
    assert kept == (verdict["change"] is not None and verdict["change"]["verdict"] == "faster"), verdict
    path = before / "analysis" / ("config.json" if kept else "config.not-kept.json")
    config = read_config(path) if path.exists() else read_config(before / "analysis" / "config.json")
    assert load_prepared(before).ranks and load_prepared(after).ranks
    for row in ("before (measured)", "predicted with the config", "after (measured)", "knobs applied:",
                "predicted gain"):
        assert row in proc.stdout, proc.stdout
    assert ("--auto: kept the config" in proc.stderr) == kept
    applied = json.loads((after / "run.json").read_text())["knobs"]
    assert applied["dpro.config"] == str(before / "analysis" / "config.json")  # where it was when the re-run began
    if "torch.ddp.bucket_cap_mb" in config.knobs:
        assert applied["torch.ddp.bucket_cap_mb"] == config.knobs["torch.ddp.bucket_cap_mb"]

    # --apply auto: the ranks pick the newest config made for their model under the run root, if --auto kept it
    run_job(launcher("-np", "2", "--apply", "auto", "--profile", "2:4", "--run-dir", "runs/c", "python",
                     str(JOBS / "plain_ddp.py"), "--steps", "6", "--width", "512"),
            env=env_for_jobs(), cwd=tmp_path, timeout=180)
    found = json.loads((tmp_path / "runs" / "c" / "run.json").read_text())["knobs"].get("dpro.config")
    # a config that changes nothing stays where it is; one that changes something only if it measured faster
    assert found == (str(before / "analysis" / "config.json") if kept or not config.knobs else None)


@pytest.mark.slow
def test_a_failing_rank_stops_the_job_with_its_status(tmp_path):
    began = time.monotonic()
    proc = run_job(launcher("-np", "2", "--profile", "1:400", "--run-dir", "run", "python", str(JOBS / "plain_ddp.py"),
                            "--steps", "100000", "--crash-rank", "1", "--crash-step", "150"),
                   env=env_for_jobs(), cwd=tmp_path, timeout=120, check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert time.monotonic() - began < 60  # a surviving rank would train 100000 steps
    assert "rank 1 exited with status 3" in proc.stderr
    run = load_prepared(tmp_path / "run")
    # Rank 1 died outright after finishing step 149; rank 0 waited in step 150 until the launcher stopped it. The
    # recorder's builder thread journals every 50 ms: each rank's finished steps are readable but for its last 50 ms,
    # in order, each whole
    for rank in (0, 1):
        steps = run.ranks[rank].steps
        assert steps == list(range(1, 1 + len(steps))) and 20 <= len(steps) <= 149, (rank, steps)


def test_a_rank_killed_inside_a_framework_call_is_reported_with_what_it_was_doing(tmp_path):
    script = tmp_path / "aborts.py"  # what a recorder leaves when the framework kills it (RankTraceWriter.inside)
    script.write_text("import os, pathlib\n"
                      "pathlib.Path(os.environ['DPRO_RUN_DIR'], 'rank-0.busy.txt').write_text('stopping a profiler')\n"
                      "os.abort()\n")
    proc = run_job(launcher("-np", "1", "--profile", "1:2", "--run-dir", "run", "python", str(script)),
                   env=env_for_jobs(), cwd=tmp_path, timeout=60, check=False)
    assert proc.returncode == 134, proc.stderr[-3000:]
    assert "rank 0 died while stopping a profiler" in proc.stderr


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_and_keeps_their_steps(tmp_path):
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(launcher("-np", "2", "--profile", "1:100000", "--run-dir", "run", "python",
                                     str(JOBS / "plain_ddp.py"), "--steps", "1000000", "--tag", tag),
                            env=env_for_jobs(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "run").glob("rank-1.partial.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    if shutil.which("pgrep"):
        left = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True)
        assert left.stdout.strip() == "", "ranks outlived the launcher"
    run = load_prepared(tmp_path / "run")
    for rank in (0, 1):
        assert run.ranks[rank].steps, rank  # KeyboardInterrupt let each rank write what it finished


# ---- a second host over ssh (a real sshd on loopback) --------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return s.getsockname()[1]


@pytest.fixture
def sshd(tmp_path_factory):
    """A real sshd on 127.0.0.2 with a generated host key; yields (port, client key)."""
    sshd_bin = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd_bin).is_file() or not shutil.which("ssh-keygen") or not shutil.which("ssh"):
        pytest.skip("no sshd/ssh/ssh-keygen here (apt-get install -y openssh-server openssh-client)")
    home = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / name)], check=True)
    (home / "authorized_keys").write_text((home / "client_key.pub").read_text())
    (home / "authorized_keys").chmod(0o600)
    port = _free_port()
    (home / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.2\nHostKey {home / 'host_key'}\n"
        f"AuthorizedKeysFile {home / 'authorized_keys'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\nPermitRootLogin prohibit-password\n"
        f"PidFile {home / 'sshd.pid'}\nSubsystem sftp internal-sftp\n")
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)
    daemon = subprocess.Popen([sshd_bin, "-D", "-e", "-f", str(home / "sshd_config")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        probe = ["ssh", "-p", str(port), "-i", str(home / "client_key"), "-o", "StrictHostKeyChecking=no",
                 "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
                 "127.0.0.2", "true"]
        for _ in range(50):
            if daemon.poll() is not None:
                pytest.skip(f"sshd did not start: {daemon.stdout.read()[-500:]}")
            if subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
                break
            time.sleep(0.2)
        else:
            pytest.skip("could not log in to the test sshd")
        yield port, home / "client_key"
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)


@pytest.mark.slow
def test_a_host_over_ssh_records_and_is_collected(tmp_path, sshd):
    port, key = sshd
    proc = run_job(launcher("-np", "2", "-H", "127.0.0.2:1,localhost:1", "-p", str(port), "-i", str(key),
                            "--ssh-known-hosts", str(tmp_path / "known_hosts"), "--profile", "2:6", "--run-dir", "run",
                            "--optimize", "--verbose", "python",
                            str(JOBS / "plain_ddp.py"), "--print-env"),
                   env=env_for_jobs(), cwd=tmp_path, timeout=240)
    assert "ssh -p" in proc.stderr and "127.0.0.2" in proc.stderr  # rank 0 went through ssh
    assert "could not copy" not in proc.stderr
    assert _known(tmp_path / "known_hosts", port)  # the host key was checked and written down
    run = load_prepared(tmp_path / "run")
    assert run.meta["world_size"] == 2 and sorted(run.ranks) == [0, 1] and not run.problems
    for rank in (0, 1):
        assert [e["args"]["step"] for e in _events(run, rank, "STEP")] == [2, 3, 4, 5]
    assert "MASTER_ADDR=127.0.0.2" in proc.stdout
    assert (tmp_path / "run" / "analysis" / "config.json").is_file()


# ---- ssh: host keys, hostfile messages, remote copy ------------------------------------------------------------


def _options(config: LaunchConfig) -> dict[str, str]:
    opts = process.ssh_options(config)
    return dict(opts[i + 1].split("=", 1) for i in range(len(opts) - 1) if opts[i] == "-o")


def test_ssh_checks_host_keys_unless_told_not_to(tmp_path):
    default = _options(parse("-np", "2", "-H", "a:1,b:1", "--engine", "torch", "python", "x.py"))
    assert default["StrictHostKeyChecking"] == "accept-new" and "UserKnownHostsFile" not in default
    assert default["BatchMode"] == "yes" and default["PasswordAuthentication"] == "no"
    known = tmp_path / "my hosts"
    own = _options(parse("-np", "2", "-H", "a:1,b:1", "--ssh-known-hosts", str(known), "python", "x.py"))
    assert own["StrictHostKeyChecking"] == "accept-new" and own["UserKnownHostsFile"] == f'"{known}"'
    off = _options(parse("-np", "2", "-H", "a:1,b:1", "--ssh-no-host-key-check", "python", "x.py"))
    assert off["StrictHostKeyChecking"] == "no" and off["UserKnownHostsFile"] == "/dev/null"


@pytest.mark.parametrize(("argv", "message"), [
    (["--ssh-known-hosts", "k", "--ssh-no-host-key-check"], "give one of them"),
    (["--ssh-known-hosts", "no/such/folder/k"], "does not exist"),
    (["--ssh-known-hosts", "."], "a directory, not a known-hosts file"),
])
def test_bad_ssh_options_are_explained(tmp_path, argv, message):
    with pytest.raises(UsageError, match=message):
        parse("-np", "2", *argv, "python", "x.py", cwd=tmp_path)


@pytest.mark.parametrize(("line", "message"), [
    ("-oProxyCommand=x slots=2", r"line 2: host name '-oProxyCommand=x' is not valid"),
    ("-oProxyCommand=x", r"line 2: host name '-oProxyCommand=x' is not valid"),
    ("node2 slots=many", r"line 2: 'node2 slots=many': slots must be an integer"),
    ("node2 slots=0", r"line 2: host 'node2': slots must be a positive integer"),
    ("node2 cores=2", r"line 2: 'node2 cores=2': expected 'HOST slots=N'"),
    ("node1 slots=1", r"listed twice"),
])
def test_hostfile_lines_are_explained_exactly(tmp_path, line, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"node1 slots=2\n{line}\n")
    with pytest.raises(UsageError, match=message) as exc:
        parse("-np", "2", "--hostfile", str(hostfile), "python", "x.py")
    assert str(hostfile) in str(exc.value)


def _known(known_hosts: Path, port: int) -> bool:
    """Whether the known-hosts file holds 127.0.0.2 on ``port`` (ssh may store the name hashed)."""
    found = subprocess.run(["ssh-keygen", "-F", f"[127.0.0.2]:{port}", "-f", str(known_hosts)], capture_output=True)
    return found.returncode == 0


def test_a_new_host_key_is_recorded_and_a_changed_one_refused(tmp_path, sshd):
    port, key = sshd
    known = tmp_path / "known_hosts"
    config = parse("-np", "2", "-H", "127.0.0.2:1,localhost:1", "-p", str(port), "-i", str(key),
                   "--ssh-known-hosts", str(known), "python", "x.py")
    process.check_host_keys(config)  # first contact: accepted and written down
    assert (key.parent / "host_key.pub").read_text().split()[1] in known.read_text() and _known(known, port)
    process.check_host_keys(config)  # the same key again: fine
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known.write_text(f"[127.0.0.2]:{port} {' '.join(other.with_suffix('.pub').read_text().split()[:2])}\n")
    with pytest.raises(UsageError, match=r"host 127\.0\.0\.2: ssh refused .*ssh-keygen -R 127\.0\.0\.2"):
        process.check_host_keys(config)
    unchecked = parse("-np", "2", "-H", "127.0.0.2:1,localhost:1", "-p", str(port), "-i", str(key),
                      "--ssh-no-host-key-check", "python", "x.py")
    process.check_host_keys(unchecked)  # checking off: nothing is asked
    assert process.ssh_options(unchecked)  # and the job's own ssh would log in
    probe = ["ssh", "-p", str(port), *process.ssh_options(unchecked), "--", "127.0.0.2", "true"]
    assert subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


def test_a_remote_directory_is_copied_as_a_tar_stream(tmp_path, sshd):
    from dpro.launch.pipeline import fetch_remote_dir

    port, key = sshd
    remote = tmp_path / "remote run"  # a blank in the path: no shell glob or word splitting on the way
    (remote / "rank1").mkdir(parents=True)
    (remote / "rank1" / "journal.jsonl").write_text('{"step": 1}\n')
    (remote / "run.json").write_text("{}")
    config = parse("-np", "2", "-H", "127.0.0.2:1,localhost:1", "-p", str(port), "-i", str(key),
                   "--ssh-known-hosts", str(tmp_path / "known_hosts"), "python", "x.py")
    into = tmp_path / "here"
    into.mkdir()
    assert fetch_remote_dir(config, "127.0.0.2", remote, into) is None
    assert (into / "rank1" / "journal.jsonl").read_text() == '{"step": 1}\n' and (into / "run.json").is_file()
    problem = fetch_remote_dir(config, "127.0.0.2", tmp_path / "missing", tmp_path / "empty")
    assert problem and "missing" in problem


@pytest.mark.parametrize("member", ["../outside", "rank0/../../outside", "link-out"])
def test_a_tar_stream_cannot_write_outside_the_run(tmp_path, member):
    import io
    import tarfile

    from dpro.launch.pipeline import unpack_tar_stream

    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as archive:
        archive.addfile(_tar_member("rank0/ok.jsonl", b"{}"), io.BytesIO(b"{}"))
        info = _tar_member(member, b"evil")
        if member == "link-out":
            info.type, info.linkname, info.size = tarfile.SYMTYPE, "../../outside", 0
        archive.addfile(info, io.BytesIO(b"evil"))
        archive.addfile(_tar_member("/abs/file", b"abs"), io.BytesIO(b"abs"))
    payload.seek(0)
    into = tmp_path / "run" / "copy"
    into.mkdir(parents=True)
    with pytest.raises(tarfile.TarError):
        unpack_tar_stream(payload, into)
    assert (into / "rank0" / "ok.jsonl").read_bytes() == b"{}"  # what came before the bad member is kept
    assert not (tmp_path / "run" / "outside").exists() and not (tmp_path / "outside").exists()
    assert not (into / "link-out").exists()


def test_a_tar_stream_with_absolute_names_stays_inside(tmp_path):
    import io
    import tarfile

    from dpro.launch.pipeline import unpack_tar_stream

    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as archive:
        archive.addfile(_tar_member("/abs/file", b"abs"), io.BytesIO(b"abs"))
    payload.seek(0)
    unpack_tar_stream(payload, tmp_path)
    assert (tmp_path / "abs" / "file").read_bytes() == b"abs"


def _tar_member(name: str, data: bytes):
    import tarfile

    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info


# ---- horovodrun's --config-file and the hostfile, as files from elsewhere ----------------------------------


@pytest.mark.parametrize(("text", "message"), [
    ("params: {fusion_threshold_mb: abc}", r"params.fusion_threshold_mb must be a finite number, found 'abc'"),
    ("params: {fusion_threshold_mb: .nan}", r"params.fusion_threshold_mb must be a finite number, found nan"),
    ("params: {cycle_time_ms: [1, 2]}", r"params.cycle_time_ms must be a finite number"),
    ("params: {cache_capacity: 99999999999999999999999999}", r"params.cache_capacity must be a whole number"),
    ("autotune: {enabled: 7}", r"autotune.enabled must be true or false, found 7"),
    ("timeline: {filename: [1]}", r"timeline.filename must be text"),
    ("stall_check: {enabled: maybe}", r"stall_check.enabled must be true or false"),
    ("[" * 5000 + "]" * 5000, r"nested deeper than the parser goes"),
    ("params: [1", r"not valid YAML"),
])
def test_a_bad_horovod_config_file_is_explained(tmp_path, text, message):
    path = tmp_path / "hvd.yaml"
    path.write_text(text + "\n")
    with pytest.raises(UsageError, match=message) as err:
        parse("-np", "2", "--config-file", str(path), "python", "x.py")
    assert str(path) in str(err.value)


def test_an_endless_horovod_config_file_stops_at_its_limit():
    with pytest.raises(UsageError, match=r"/dev/zero: larger than 1 MB"):
        parse("-np", "2", "--config-file", "/dev/zero", "python", "x.py")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300))
def test_any_text_as_a_hostfile_or_horovod_config_is_read_or_refused(tmp_path, text):
    from dpro.launch.horovod_run import read_horovod_config_file
    from dpro.launch.settings import parse_hostfile

    path = tmp_path / "input"
    path.write_text(text, encoding="utf-8")
    for read in (parse_hostfile, read_horovod_config_file):
        try:
            read(path)
        except UsageError as err:
            assert str(path) in str(err)


@pytest.mark.slow
def test_auto_keeps_the_original_when_the_config_measures_slower(tmp_path):
    """The script sleeps 15 ms a step whenever a dpro config is applied (here fp16 gradient compression, which the
    replay prices as a gain on this wide model): the re-run is slower beyond its spread, so
    --auto says so, keeps the original settings and sets the config aside where --apply auto does not find it."""
    proc = run_job(launcher("-np", "2", "--auto", "--allow-compression", "--profile", "3:15", "--run-dir", "runs/a",
                            "python", str(JOBS / "plain_ddp.py"), "--steps", "16", "--width", "2048",
                            "--slower-with-config", "15"),
                   env=env_for_jobs(), cwd=tmp_path, timeout=300)
    before, after = tmp_path / "runs" / "a", tmp_path / "runs" / "a-applied"
    verdict = json.loads((after / "analysis" / "auto.json").read_text())
    if verdict.get("why") == "the config changes nothing":
        pytest.skip("dpro optimize changed nothing for this job, so there was nothing to measure against")
    assert verdict["kept"] == "original" and verdict["change"]["verdict"] == "slower", verdict
    assert verdict["change"]["ratio"] > 1.0
    assert "kept the original settings, the config measured slower" in proc.stderr
    assert not (before / "analysis" / "config.json").exists()
    assert (before / "analysis" / "config.not-kept.json").is_file()
    assert read_config(before / "analysis" / "config.not-kept.json").knobs  # still a config --apply FILE takes
