"""dpro-launch with Horovod: an unmodified Horovod script recorded through ``hvd.DistributedOptimizer``
(auto-attach), horovodrun's knobs reaching the job, ``--auto`` end to end, a self-recording script left
alone, and the auto-attach patch in one process (step counting, the model search, a config's groups).

The real jobs are ``dpro-launch -np 2 -H localhost:2 --gloo ...`` (horovodrun underneath)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, run_job

from dpro.analyze import analyze_run
from dpro.engines import load_prepared
from dpro.engines.horovod.timeline import TIMELINE_FILE, timeline_file
from dpro.launch import horovod_run
from dpro.launch.cli import build_parser, config_from_args
from dpro.launch.env import AUTOATTACH_DIR

HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None and importlib.util.find_spec("horovod.torch") is not None
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not HAVE_HOROVOD, reason="horovod (with PyTorch) is not installed in this venv (make horovod / "
                             "scripts/build_horovod.sh)")]

VENV_BIN = str(Path(sys.executable).parent)
PLAIN = JOBS / "plain_hvd.py"


def env_for_jobs(**extra: str) -> dict[str, str]:
    """One thread per rank, `python` is this venv's, and no timeline named from outside."""
    env = job_env(PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""), **extra)
    env.pop("HOROVOD_TIMELINE", None)
    return env


def launcher(*argv: str) -> list[str]:
    return [sys.executable, "-m", "dpro.launch", "-np", "2", "-H", "localhost:2", "--gloo", *argv]


def _rank_events(run_dir: Path, rank: int) -> list[dict]:
    doc = json.loads((run_dir / f"rank-{rank}.json").read_text())
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


# ---- the environment horovodrun gets (no job) ----------------------------------------------------------


def test_horovodrun_gets_dpros_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HOROVOD_TIMELINE", raising=False)
    config = config_from_args(build_parser().parse_args(
        ["-np", "2", "-H", "localhost:2", "--gloo", "--profile", "2:8", "--run-dir", "run",
         "--fusion-threshold-mb", "0.5", "--cycle-time-ms", "2", "python", str(PLAIN)]), cwd=tmp_path)
    assert config.engine == "horovod"  # detected from the script
    seen = {}

    class Popen:
        stdin = None

        def __init__(self, argv, env, **kw):
            seen.update(argv=argv, env=env)
            self.pid = os.getpid()

        def wait(self):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(horovod_run, "find_horovodrun", lambda: "/opt/bin/horovodrun")
    monkeypatch.setattr(horovod_run.subprocess, "Popen", Popen)
    assert horovod_run.HorovodLauncher().launch(config) == 0
    env, argv = seen["env"], seen["argv"]
    assert env["DPRO_AUTO_RECORD"] == "1" and env["DPRO_PROFILE"] == "2:8"
    assert env["DPRO_RUN_DIR"] == str(config.run_dir)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(AUTOATTACH_DIR)
    assert "HOROVOD_TIMELINE" not in env  # once started it slows the rest of the job: asked for, not default
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(2**19) and env["HOROVOD_CYCLE_TIME"] == "2.0"
    # horovodrun's --fusion-threshold-mb takes whole MB: half a MB goes by the environment alone
    assert "--fusion-threshold-mb" not in argv and argv[argv.index("--cycle-time-ms") + 1] == "2.0"
    assert argv[-2:] == ["python", str(PLAIN)] and "--gloo" in argv


# ---- the patch in one process (Horovod runs alone without horovodrun) ------------------------------------

ONE_PROCESS = textwrap.dedent("""
    import sys
    import horovod.torch as hvd
    import torch
    from torch import nn

    hvd.init()
    torch.manual_seed(0)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
            self.head = nn.Linear(16, 4)
        def forward(self, x):
            return self.head(torch.relu(self.body(x)))
    model = Net()
    loss_fn = nn.Linear(4, 4)  # another module alive in the process, not trained
    names = None if "--no-names" in sys.argv else model.named_parameters()  # a generator, read once
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=names)
    assert hvd.DistributedOptimizer.__wrapped__.__module__ == "horovod.torch.optimizer"
    for _ in range(7):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    groups = getattr(opt, "_groups", None)
    print("GROUPS", sorted(len(g) for g in groups) if isinstance(groups, list) else groups)
""")


def _one_process(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "one.py"
    script.write_text(ONE_PROCESS)
    full = env_for_jobs(PYTHONPATH=str(AUTOATTACH_DIR), DPRO_AUTO_RECORD="1", DPRO_PROFILE="2:5", **env)
    proc = subprocess.run([sys.executable, str(script), *args], env=full, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.parametrize("names", [True, False])
def test_distributed_optimizer_gets_a_recorder_one_step_per_iteration(tmp_path, names):
    run_dir = tmp_path / "run"
    _one_process(tmp_path, *([] if names else ["--no-names"]), DPRO_RUN_DIR=str(run_dir))
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["engine"] == "horovod" and meta["knobs"]["dpro.launch"] == "autoattach"
    events = _rank_events(run_dir, 0)
    # torch's step hooks fire twice per Horovod step (the wrapper class and the wrapped optimizer's): counted once
    assert sorted(e["args"]["step"] for e in events if e["cat"] == "STEP") == [2, 3, 4]
    fw = {e["name"] for e in events if e["cat"] == "FW"}
    assert {"FW.body.0", "FW.body.2", "FW.head"} <= fw  # the model found is Net, not a part of it
    model = json.loads((run_dir / "model.json").read_text())
    assert sorted(g["name"] for g in model["gradients"]) == sorted(
        ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias", "head.weight", "head.bias"])


def test_the_step_horovod_runs_to_create_optimizer_state_is_not_an_iteration(tmp_path):
    """``hvd.broadcast_optimizer_state`` steps a stateless Adam once on zero gradients: counted, the recorder's
    iterations would run one ahead of the script's (and of the step clock's), and a window at the script's last
    steps would begin a step early. 7 iterations (0..6), window 7:9: nothing to record."""
    script = tmp_path / "one.py"
    script.write_text(ONE_PROCESS.replace("torch.optim.SGD(model.parameters(), lr=0.1)",
                                          "torch.optim.Adam(model.parameters(), lr=0.1)")
                      .replace("for _ in range(7):",
                               "hvd.broadcast_optimizer_state(opt, root_rank=0)\nfor _ in range(7):"))
    run_dir = tmp_path / "run"
    env = env_for_jobs(PYTHONPATH=str(AUTOATTACH_DIR), DPRO_AUTO_RECORD="1", DPRO_PROFILE="7:9",
                       DPRO_RUN_DIR=str(run_dir))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the window opens as iteration 7 would begin, which never comes: no step recorded (counted, the dummy step
    # made iteration 6 the recorder's 7)
    assert not [e for e in _rank_events(run_dir, 0) if e["cat"] == "STEP"]


def test_step_clock_times_an_unmodified_scripts_steps(tmp_path):
    times = tmp_path / "steps.json"
    script = tmp_path / "one.py"
    script.write_text(ONE_PROCESS)
    env = env_for_jobs(PYTHONPATH=str(AUTOATTACH_DIR), DPRO_STEP_TIMES=str(times))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ends = json.loads(times.read_text())["step_ends"]
    assert len(ends) == 7 and ends == sorted(ends)  # one per step() of the Horovod optimizer, not two
    assert not list(tmp_path.glob("dpro-runs*"))  # timed, not recorded


def test_a_horovod_config_applies_its_groups(tmp_path):
    from torch import nn

    from dpro.config import Config, write_config
    from dpro.plugins.torch.apply import fingerprint

    class Net(nn.Module):  # the same names and shapes as the script's model
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
            self.head = nn.Linear(16, 4)

    groups = [["head.bias", "head.weight", "body.2.bias", "body.2.weight"], ["body.0.bias", "body.0.weight"]]
    cfg = write_config(tmp_path / "config.json", Config(
        fingerprint={"framework": "torch", "engine": "horovod", "world_size": 1, "model": fingerprint(Net())},
        knobs={"tensor_groups": groups, "micro_batches": 2}))
    run_dir = tmp_path / "run"
    proc = _one_process(tmp_path, DPRO_RUN_DIR=str(run_dir), DPRO_CONFIG=str(cfg))
    assert "GROUPS [2, 4]" in proc.stdout  # hvd.DistributedOptimizer(groups=) got the config's groups
    # a plain loop's micro-batches are the script's to split: dpro says how, in Horovod's words, and goes on
    assert "backward_passes_per_step=2" in proc.stderr + proc.stdout
    knobs = json.loads((run_dir / "run.json").read_text())["knobs"]
    assert knobs["horovod.groups"] == "explicit" and knobs["dpro.config"] == str(cfg)


def test_owning_model_is_the_outermost_fully_trained_module():
    from torch import nn

    from dpro.plugins.torch.autoattach import owning_model

    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    wrapper = nn.ModuleDict({"net": net})
    teacher = nn.Linear(3, 3)
    both = nn.ModuleDict({"student": net, "teacher": teacher})  # holds parameters the optimizer does not train
    objects = [net, net[0], net[2], wrapper, teacher, both]
    params = list(net.parameters())
    assert owning_model(params, objects=objects) is wrapper
    assert owning_model(params, list(net.named_parameters()), objects=objects) is net  # the names decide
    assert owning_model(list(net[2].parameters()), objects=objects) is net[2]
    assert owning_model([nn.Parameter(net[0].weight.detach().clone())], objects=objects) is None
    assert owning_model(params) in (net, wrapper)  # the real gc search finds them too


# ---- real jobs ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The unmodified script, recorded, with horovodrun's knobs on the command line."""
    cwd = tmp_path_factory.mktemp("plain_hvd")
    proc = run_job(launcher("--profile", "2:8", "--run-dir", "run", "--fusion-threshold-mb", "4",
                            "--cycle-time-ms", "2", "--horovod-timeline", "python", str(PLAIN)),
                   env=env_for_jobs(), cwd=cwd, timeout=120)
    return cwd / "run", proc


def test_an_unmodified_horovod_script_is_recorded(plain_run):
    run_dir, proc = plain_run
    code = [line for line in PLAIN.read_text().splitlines() if line.lstrip().startswith(("import ", "from "))]
    assert code and not any("dpro" in line for line in code)  # the script never imports dpro
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["engine"] == "horovod" and meta["world_size"] == 2
    assert meta["knobs"]["dpro.launch"] == "autoattach" and meta["knobs"]["backend"] == "gloo"
    model = json.loads((run_dir / "model.json").read_text())
    for rank in (0, 1):
        events = _rank_events(run_dir, rank)
        assert sorted({e["args"]["step"] for e in events if e["cat"] == "STEP"}) == list(range(2, 8))
        for cat in ("FW", "BW", "COMM", "UPDATE"):
            assert any(e["cat"] == cat for e in events), (rank, cat)
        for step in range(2, 8):  # one COMM per gradient per step before the timeline is merged
            comm = [e for e in events if e["cat"] == "COMM" and e["args"]["step"] == step]
            assert sum(e["args"]["bytes"] for e in comm) == model["param_bytes"]
    launched = json.loads((run_dir / "launch.json").read_text())
    assert launched["engine"] == "horovod" and launched["exit_status"] == 0


def test_the_horovod_timeline_is_captured_and_merged(plain_run):
    run_dir, _ = plain_run
    if not (run_dir / TIMELINE_FILE).is_file():
        pytest.skip("Horovod wrote no timeline (HOROVOD_TIMELINE=DYNAMIC not honoured)")
    run = load_prepared(run_dir)
    merged = run.meta["horovod"]["merged"]
    assert merged["steps"] == list(range(2, 8))
    names = sorted(g["name"] for g in run.model["gradients"])
    for rank in (0, 1):
        for step in merged["steps"]:
            comm = [e for e in run.ranks[rank].events if e["cat"] == "COMM" and e["args"]["step"] == step]
            assert comm and all("buffer" in e["args"] for e in comm)
            assert sorted(n for e in comm for n in e["args"]["tensors"]) == names


def test_horovodrun_knobs_reach_the_job(plain_run):
    run_dir, proc = plain_run
    assert "HVD size=2 fusion=4194304 cycle=2.0" in proc.stdout  # what the ranks see
    knobs = json.loads((run_dir / "run.json").read_text())["knobs"]
    assert knobs["HOROVOD_FUSION_THRESHOLD"] == 4 * 2**20 and knobs["HOROVOD_CYCLE_TIME"] == 2.0


def test_the_default_window_records_horovod_in_blocks_without_a_timeline(tmp_path):
    """No --profile: blocks 10..14, 20..24, 30..34, each allreduce timed from its launch to its completion (no
    Horovod timeline, which would slow the rest of the job), the recording overhead measured against the gaps."""
    # --width 512: steps of several ms, which a 5% bound can hold to (2 ms steps move by more than that here)
    proc = run_job(launcher("--run-dir", "run", "python", str(PLAIN), "--steps", "38", "--width", "512"),
                   env=env_for_jobs(), cwd=tmp_path, timeout=180)
    assert "recording steps 10..14, 20..24, 30..34" in proc.stderr
    run_dir = tmp_path / "run"
    assert not (run_dir / TIMELINE_FILE).exists()
    run = load_prepared(run_dir)
    assert not run.problems and "merged" not in run.meta["horovod"]
    for rank in (0, 1):
        overhead = run.ranks[rank].header["recording_overhead"]
        # 16..18 and 26..28: each gap less its first step (another rank may still be closing its block) and its
        # last (it installs the next block's hooks)
        assert overhead["baseline"] == "gaps" and overhead["unrecorded_steps"] == 6
        assert {e["args"]["step"] for e in run.ranks[rank].events if e["cat"] == "COMM"} == \
            {*range(10, 15), *range(20, 25), *range(30, 35)}
    info = run_job([sys.executable, "-m", "dpro", "info", str(run_dir)], timeout=60).stdout
    assert "recorded vs the unrecorded steps between its blocks" in info
    analysis = analyze_run(run).analysis  # and the analysis says what the job would take unrecorded
    assert any("against the unrecorded steps between the window's blocks" in n for n in analysis.notes)
    assert abs(analysis.error_pct) < 5.0, analysis.error_pct


def test_horovod_timeline_runs_in_the_last_block_and_the_step_model_is_the_others(tmp_path):
    # --width 512: steps of several ms, which the 5% bound below can hold to under the suite's load
    proc = run_job(launcher("--run-dir", "run", "--horovod-timeline", "python", str(PLAIN), "--steps", "38",
                            "--width", "512"),
                   env=env_for_jobs(), cwd=tmp_path, timeout=180)
    assert "recording steps 10..14, 20..24, 30..34" in proc.stderr
    run_dir = tmp_path / "run"
    if not (run_dir / TIMELINE_FILE).is_file():
        pytest.skip("Horovod wrote no timeline (HOROVOD_TIMELINE=DYNAMIC not honoured)")
    assert not (run_dir / timeline_file(2)).exists()
    run = load_prepared(run_dir)
    merged = run.meta["horovod"]["merged"]
    assert merged["steps"] == list(range(30, 35)) and not run.problems
    assert merged["steps_without_timeline"] == [*range(10, 15), *range(20, 25)]
    assert sorted(run.set_aside) == list(range(30, 35))
    for rank in (0, 1):
        comm = [e for e in run.ranks[rank].events if e["cat"] == "COMM" and e["args"]["step"] < 30]
        assert comm and all("buffer" not in e["args"] for e in comm)  # as the recorder saw them
    analyzed = analyze_run(run)
    # the steps without the timeline, less any far outside the others (left out, and named, as always)
    assert sorted([*analyzed.model.steps, *analyzed.model.left_out_steps]) == [*range(10, 15), *range(20, 25)]
    assert any("timeline ran in 5 of the recorded steps" in n and "built from the others" in n
               for n in analyzed.analysis.notes), analyzed.analysis.notes
    assert abs(analyzed.analysis.error_pct) < 5.0, analyzed.analysis.error_pct


def test_a_script_recording_itself_is_recorded_once(tmp_path):
    run_job(launcher("--profile", "2:6", "--run-dir", "run", "python", str(JOBS / "hvd_job.py"), "--steps", "8",
                     "--profile", "3:6"), env=env_for_jobs(), cwd=tmp_path, timeout=120)
    runs = sorted(p.parent for p in tmp_path.rglob("run.json"))
    assert len(runs) == 1, runs
    (recorded,) = runs
    assert recorded.parent == tmp_path / "run"  # record_horovod(run_dir=None) went under $DPRO_RUN_DIR
    meta = json.loads((recorded / "run.json").read_text())
    assert "dpro.launch" not in meta["knobs"] and meta["profiled_steps"] == [3, 4, 5]


def test_auto_on_a_horovod_job(tmp_path):
    proc = run_job(launcher("--auto", "--profile", "2:8", "--run-dir", "runs/a", "python", str(PLAIN)),
                   env=env_for_jobs(), cwd=tmp_path, timeout=180)
    before, after = tmp_path / "runs" / "a", tmp_path / "runs" / "a-applied"
    verdict = json.loads((after / "analysis" / "auto.json").read_text())  # kept where --apply auto finds it, or not
    config = json.loads(Path(verdict["config"]).read_text())
    assert Path(verdict["config"]).name == ("config.json" if verdict["kept"] == "config" or verdict["change"] is None
                                           else "config.not-kept.json")
    assert config["fingerprint"]["engine"] == "horovod" and config["fingerprint"]["world_size"] == 2
    env = config["knobs"]["env"]
    assert int(env["HOROVOD_FUSION_THRESHOLD"]) >= 0 and float(env["HOROVOD_CYCLE_TIME"]) > 0
    for row in ("before (measured)", "before (replayed)", "predicted with the config", "after (measured)",
                "knobs applied:", "HOROVOD_FUSION_THRESHOLD"):
        assert row in proc.stdout, proc.stdout
    applied = json.loads((after / "run.json").read_text())
    assert applied["engine"] == "horovod" and applied["world_size"] == 2
    knobs = applied["knobs"]
    assert knobs["dpro.config"] == str(before / "analysis" / "config.json")
    assert knobs["HOROVOD_FUSION_THRESHOLD"] == int(env["HOROVOD_FUSION_THRESHOLD"])
    assert knobs["HOROVOD_CYCLE_TIME"] == float(env["HOROVOD_CYCLE_TIME"])
    assert f"fusion={env['HOROVOD_FUSION_THRESHOLD']} cycle={env['HOROVOD_CYCLE_TIME']}" in proc.stdout


# ---- replay fidelity of an unmodified Horovod script (fusion varies from step to step) --------------------

CONV1D = JOBS / "conv1d_hvd.py"


@pytest.fixture(scope="module")
def conv1d_runs(tmp_path_factory) -> list[Path]:
    """The conv1d script recorded twice with Horovod's timeline (20 steps, Horovod's default fusion)."""
    cwd = tmp_path_factory.mktemp("conv1d")
    runs = []
    for i in range(2):
        run_job(launcher("--profile", "6:26", "--run-dir", f"run{i}", "--horovod-timeline", "python", str(CONV1D),
                         "--steps", "30"),
                env=env_for_jobs(), cwd=cwd, timeout=180)
        runs.append(cwd / f"run{i}")
    return runs


@pytest.mark.slow
def test_horovod_recordings_replay_within_five_percent(conv1d_runs):
    from dpro.analyze import analyze_run

    for run_dir in conv1d_runs:
        run = load_prepared(run_dir)
        merged = run.meta["horovod"]["merged"]
        assert merged["steps"] == list(range(6, 26)) == run.ranks[0].steps  # every step, whatever its fusion
        analysis = analyze_run(run).analysis
        # bench/accuracy.py measures the figure (within 5%); this bound only has to catch the old model's misses
        # (17-36% on such runs) without failing on a busy CI machine
        assert abs(analysis.error_pct) < 10.0, (run_dir, analysis.measured_step_ms, analysis.predicted_step_ms,
                                                merged["distinct_fusions"])


@pytest.mark.slow
def test_horovod_tensors_end_with_their_buffer_not_at_the_late_poll(conv1d_runs):
    run = load_prepared(conv1d_runs[0])
    late = 0
    for rank in (0, 1):
        for e in run.ranks[rank].events:
            if e["cat"] == "COMM":
                # never after the poll that saw it (seen_done_us is rounded to the ns, dur is not)
                assert e["dur"] <= e["args"]["seen_done_us"] + 1e-3
                late += e["args"]["seen_done_us"] - e["dur"] > 1000.0
        by_buffer: dict[tuple[int, int], list[float]] = {}
        for e in run.ranks[rank].events:
            if e["cat"] == "COMM" and rank == 0:
                by_buffer.setdefault((e["args"]["step"], e["args"]["buffer"]), []).append(e["ts"] + e["dur"])
        # one buffer, one end (rank 0's timeline; a poll may see it a few µs before the placed end)
        assert all(max(ends) - min(ends) < 100.0 for ends in by_buffer.values())
    assert late > 0  # the recorder's polls saw some completions more than a millisecond late


@pytest.mark.slow
def test_horovod_straggler_waiting_fits_in_the_step(conv1d_runs):
    from dpro.analyze import analyze_run

    for run_dir in conv1d_runs:
        analysis = analyze_run(load_prepared(run_dir)).analysis
        rows = analysis.stragglers
        assert rows
        mean_step = {r["rank"]: r["waits_ms_per_step"] / (r["waits_pct_of_step"] / 100.0)
                     for r in rows if r["waits_pct_of_step"] > 0}
        for row in rows:
            assert 0.0 <= row["waits_pct_of_step"] <= 100.0
            assert row["wait_caused_ms_per_step"] <= max(mean_step.values(), default=float("inf")) + 1e-6
        assert sum(r["wait_caused_ms_per_step"] for r in rows) == pytest.approx(
            sum(r["waits_ms_per_step"] for r in rows))  # two ranks: what one causes, the other waits


HAVE_HVD_KERAS = HAVE_HOROVOD and importlib.util.find_spec("tf_keras") is not None and \
    importlib.util.find_spec("horovod.tensorflow") is not None


@pytest.mark.skipif(not HAVE_HVD_KERAS, reason="this Horovod wheel was built without TensorFlow")
def test_an_unmodified_hvd_keras_job_is_recorded_through_the_horovod_engine(tmp_path):
    proc = run_job(launcher("--profile", "4:9", "--run-dir", "run", "--horovod-timeline", "python",
                            str(JOBS / "hvd_keras_job.py"), "--steps", "12"),
                   env=env_for_jobs(TF_CPP_MIN_LOG_LEVEL="2"), cwd=tmp_path, timeout=240)
    assert "hvd.keras rank 0 of 2 done" in proc.stdout and "hvd.keras rank 1 of 2 done" in proc.stdout
    run_dir = tmp_path / "run"
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["framework"] == "tf" and meta["engine"] == "horovod" and meta["world_size"] == 2
    assert meta["knobs"]["HOROVOD_FUSION_THRESHOLD"] > 0
    # the interference probe after the window: a fixed kernel alone and beside an allreduce
    probe = meta["interference_probe"]
    assert len(probe["compute_alone_us"]) == len(probe["compute_overlapped_us"]) > 0
    assert all(t > 0 for t in probe["compute_alone_us"] + probe["compute_overlapped_us"])
    model = json.loads((run_dir / "model.json").read_text())
    grad_bytes = {g["name"]: g["bytes"] for g in model["gradients"]}
    for rank in (0, 1):
        events = [e for e in json.loads((run_dir / f"rank-{rank}.json").read_text())["traceEvents"]
                  if e.get("ph") == "X"]
        for step in range(4, 9):
            comm = [e for e in events if e["cat"] == "COMM" and e["args"]["step"] == step]
            # one allreduce per gradient (launched as soon as the graph has it), with the gradient's bytes
            assert {tuple(e["args"]["tensors"]) for e in comm} == {(g,) for g in grad_bytes}, (rank, step)
            assert all(e["args"]["bytes"] == grad_bytes[e["args"]["tensors"][0]] for e in comm)
            first_fw = min(e["ts"] for e in events if e["cat"] == "FW" and e["args"]["step"] == step)
            assert all(e["ts"] > first_fw for e in comm)
    run = load_prepared(run_dir)
    merged = run.meta["horovod"]["merged"]
    assert merged["buffers"] and all(b["allreduce_us"] is not None for b in merged["buffers"])
    out = subprocess.run([sys.executable, "-m", "dpro", "analyze", str(run_dir), "--json"], capture_output=True,
                         text=True, timeout=120, env=env_for_jobs())
    assert out.returncode == 0, out.stderr
    assert abs(json.loads(out.stdout)["error_pct"]) < 50
    config = tmp_path / "config.json"
    out = subprocess.run([sys.executable, "-m", "dpro", "optimize", str(run_dir), "-o", str(config)],
                         capture_output=True, text=True, timeout=300, env=env_for_jobs())
    assert out.returncode == 0, out.stderr
    assert "HOROVOD_FUSION_THRESHOLD" in json.loads(config.read_text())["knobs"]["env"]
    applied = run_job(launcher("--apply", str(config), "--profile", "4:9", "--run-dir", "applied", "python",
                               str(JOBS / "hvd_keras_job.py"), "--steps", "12"),
                      env=env_for_jobs(TF_CPP_MIN_LOG_LEVEL="2"), cwd=tmp_path, timeout=240)
    assert "hvd.keras rank 1 of 2 done" in applied.stdout  # the config was made for this job: accepted
    assert applied.stderr.count("[dpro] applying") == 1    # said once, by rank 0
    env = json.loads(config.read_text())["knobs"]["env"]
    knobs = json.loads((tmp_path / "applied" / "run.json").read_text())["knobs"]
    assert knobs["HOROVOD_FUSION_THRESHOLD"] == int(env["HOROVOD_FUSION_THRESHOLD"])


@pytest.mark.skipif(not HAVE_HVD_KERAS, reason="this Horovod wheel was built without TensorFlow")
def test_a_hvd_keras_window_in_blocks_profiles_each_block_and_runs_the_timeline_in_the_last(tmp_path):
    """--profile 4:16:3: blocks 4..6 and 10..12, each with its own TensorFlow profile; the gaps run unrecorded (the
    overhead's baseline), and Horovod's timeline (asked for) runs in the last block only."""
    proc = run_job(launcher("--profile", "4:16:3", "--run-dir", "run", "--horovod-timeline", "python",
                            str(JOBS / "hvd_keras_job.py"),
                            "--steps", "18"), env=env_for_jobs(TF_CPP_MIN_LOG_LEVEL="2"), cwd=tmp_path, timeout=240)
    assert "hvd.keras rank 1 of 2 done" in proc.stdout
    run_dir = tmp_path / "run"
    assert (run_dir / "xplane-rank0").is_dir() and (run_dir / "xplane-rank0.2").is_dir()
    assert not (run_dir / "xplane-rank0.3").exists()
    run = load_prepared(run_dir)
    for rank in (0, 1):
        trace = run.ranks[rank]
        for step in (4, 5, 6, 10, 11, 12):  # every recorded step has its layers' times, from its block's profile
            assert any(e["cat"] == "FW" and e["args"]["step"] == step for e in trace.events), (rank, step)
        assert not any(e["args"].get("step") in (7, 8, 9) for e in trace.events)
        overhead = trace.header["recording_overhead"]
        assert overhead["baseline"] == "gaps" and overhead["unrecorded_steps"] == 1  # 8 (7 follows a block)
    merged = run.meta["horovod"]["merged"]
    if merged.get("steps"):  # Horovod wrote the timeline (DYNAMIC honoured)
        assert merged["steps"] == [10, 11, 12] and merged["steps_without_timeline"] == [4, 5, 6]


@pytest.mark.skipif(not HAVE_HVD_KERAS, reason="this Horovod wheel was built without TensorFlow")
def test_a_keras_window_beyond_the_fit_is_said_and_the_job_runs_on(tmp_path):
    proc = run_job(launcher("--profile", "20:30", "--run-dir", "run", "python", str(JOBS / "hvd_keras_job.py"),
                            "--steps", "6"), env=env_for_jobs(TF_CPP_MIN_LOG_LEVEL="2"), cwd=tmp_path, timeout=240)
    assert "hvd.keras rank 0 of 2 done" in proc.stdout and "hvd.keras rank 1 of 2 done" in proc.stdout
    assert "not recording this fit" in proc.stderr and "only 6 steps" in proc.stderr


# ---- dpro optimize's horovodrun.yaml, read by horovodrun --config-file and dpro-launch --config-file ---------


def _seen_knobs(stdout: str) -> tuple[float, float]:
    """The fusion threshold and cycle time rank 0 of plain_hvd.py saw in its environment."""
    line = next(x for x in stdout.splitlines() if "HVD size=2 " in x)  # horovodrun prefixes "[0]<stdout>:"
    seen = dict(part.split("=", 1) for part in line.split("HVD ", 1)[1].split())
    return float(seen["fusion"]), float(seen["cycle"])


def test_optimize_writes_a_horovodrun_config_file_both_launchers_apply(tmp_path):
    from run_builder import horovod_timeline_events, horovod_timeline_text, make_horovod_run

    from dpro.cli import main

    run_dir = make_horovod_run(tmp_path / "run", horovod_timeline_text(horovod_timeline_events([3, 4])))
    assert main(["optimize", str(run_dir)]) == 0
    env = json.loads((run_dir / "analysis" / "config.json").read_text())["knobs"]["env"]
    yaml_file = run_dir / "analysis" / "horovodrun.yaml"
    import yaml

    params = yaml.safe_load(yaml_file.read_text())["params"]
    assert params["fusion_threshold_mb"] * 2**20 == int(env["HOROVOD_FUSION_THRESHOLD"])
    assert params["cycle_time_ms"] == float(env["HOROVOD_CYCLE_TIME"])
    wanted = (float(env["HOROVOD_FUSION_THRESHOLD"]), float(env["HOROVOD_CYCLE_TIME"]))
    horovodrun = [str(Path(VENV_BIN) / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", "--config-file",
                  str(yaml_file), sys.executable, str(PLAIN), "--steps", "3"]
    assert _seen_knobs(run_job(horovodrun, env=env_for_jobs(), cwd=tmp_path, timeout=180).stdout) == wanted
    launched = launcher("--config-file", str(yaml_file), "--no-profile", "python", str(PLAIN), "--steps", "3")
    assert _seen_knobs(run_job(launched, env=env_for_jobs(), cwd=tmp_path, timeout=180).stdout) == wanted
