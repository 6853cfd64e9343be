"""The probe passes after the window in real 2-rank gloo DDP jobs: written apart from the trace, shown by dpro info,
left out of the model of the recorded run, pricing amp and micro_batches, and leaving training as it was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, run_job, torchrun

torch = pytest.importorskip("torch")

from dpro.cli import main  # noqa: E402
from dpro.io.load import load_run  # noqa: E402
from dpro.io.probes import read_probes  # noqa: E402
from dpro.sim.whatif import context, predict  # noqa: E402

pytestmark = pytest.mark.slow  # every test here runs a real multi-process job

GLOO_EXIT_ABORT = "terminate called without an active exception"  # torch 2.13's gloo, now and then, at exit


def ddp_job(*argv: str, probes: bool = True) -> None:
    """tests/jobs/ddp_job.py on 2 ranks, again when torch's gloo aborted a rank at exit (it does so without dpro)."""
    env = job_env() if probes else job_env(DPRO_PROBES="0")
    for attempt in range(3):
        proc = torchrun("ddp_job.py", *argv, env=env, check=False, timeout=120)
        if proc.returncode == 0:
            return
        if GLOO_EXIT_ABORT not in proc.stderr or attempt == 2:
            pytest.fail(f"ddp_job.py {' '.join(argv)} exited {proc.returncode}\n{proc.stderr[-6000:]}")
        for path in argv[argv.index("--run-dir") + 1:argv.index("--run-dir") + 2]:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("probes") / "run"
    ddp_job("--model", "transformer", "--steps", "8", "--profile", "2:6", "--run-dir", str(run))
    return run


def test_probes_are_written_apart_from_the_trace(probed_run):
    probes = read_probes(probed_run)
    assert sorted(probes) == [0, 1]
    for rank_probes in probes.values():
        assert rank_probes.batch == 16  # the transformer example's batch
        reference = rank_probes.find(None, 16)
        assert reference is not None and rank_probes.find(None, 8) is not None and rank_probes.find(None, 4)
        assert {"FW.embed", "BW.embed"} <= set(reference.ops) and reference.passes == 3
        probed = {p.amp for p in rank_probes.probes} | {s["probe"].split(" ")[0] for s in rank_probes.skipped}
        assert {"bf16", "fp16"} <= probed  # each precision either probed or skipped with a note
    run = load_run(probed_run)
    assert all(e["args"]["step"] in range(2, 6) for trace in run.ranks.values() for e in trace.events)
    assert run.meta["probes"]["in_model"] is False and run.meta["probes"]["batch"] == 16


def test_dpro_info_flags_the_probes(probed_run, capsys):
    assert main(["info", str(probed_run)]) == 0
    out = capsys.readouterr().out
    assert "probe passes after the window" in out and "left out of the model of this run" in out


def test_the_model_of_the_recorded_run_ignores_the_probes(probed_run, tmp_path):
    without = tmp_path / "without"
    shutil.copytree(probed_run, without)
    shutil.rmtree(without / "probes")
    with_probes, bare = context(load_run(probed_run)), context(load_run(without))
    assert with_probes.probes and not bare.probes
    assert predict(with_probes, {}).predicted_step_ms == predict(bare, {}).predicted_step_ms


def test_whatif_prices_amp_and_micro_batches(probed_run, capsys):
    assert main(["whatif", str(probed_run), "--set", "micro_batches=2", "--json"]) == 0
    split = json.loads(capsys.readouterr().out)
    ctx = context(load_run(probed_run))
    recorded = predict(ctx, {})
    assert split["predicted_peak_memory_bytes"] < split["baseline_peak_memory_bytes"]
    assert split["predicted_step_ms"] > 0 and split["predicted_step_ms"] != split["baseline_predicted_step_ms"]
    if ctx.probes[0].find("bf16", 16) is not None:
        amp = predict(ctx, {"amp": "bf16"})
        assert amp.predicted_step_ms > 0 and amp.predicted_step_ms != recorded.predicted_step_ms


def test_optimize_without_allow_precision_never_picks_amp(probed_run, tmp_path, capsys):
    for extra in ([], ["--memory-budget", "1MiB"]):
        out = tmp_path / "config.json"
        assert main(["optimize", str(probed_run), "-o", str(out), *extra]) == 0
        config = json.loads(out.read_text())
        assert "amp" not in config["knobs"]
        assert any(e["knob"] == "amp" for e in config["explain"])
    capsys.readouterr()


@pytest.mark.parametrize("model", ["transformer", "convnet"])  # dropout's RNG; BatchNorm's running statistics
def test_probes_leave_training_as_it_was(tmp_path, model):
    digests = []
    for probes in (False, True):
        digest = tmp_path / f"params-{probes}.json"
        ddp_job("--model", model, "--steps", "7", "--profile", "2:4", "--run-dir", str(tmp_path / f"run-{probes}"),
                "--params-digest", str(digest), probes=probes)
        digests.append(json.loads(digest.read_text()))
    assert (tmp_path / "run-True" / "probes" / "rank-0.json").exists()
    assert not (tmp_path / "run-False" / "probes").exists()
    assert digests[0] == digests[1]  # training went on after the probes exactly as without them


def launch_applying(tmp_path: Path, knobs: dict, script: str, *script_args: str) -> subprocess.CompletedProcess:
    """``dpro-launch -np 2 --no-profile --apply CONFIG --force`` of a test job (a config made for another model:
    the knobs are what is checked), again when torch's gloo aborted a rank at exit."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"schema": "dpro.config/1", "knobs": knobs, "fingerprint": {
        "framework": "torch", "engine": "torch-ddp", "world_size": 2, "model": "another"}}))
    env = job_env(PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    argv = [sys.executable, "-m", "dpro.launch", "-np", "2", "--no-profile", "--apply", str(config), "--force",
            "python", str(JOBS / script), *script_args]
    for _ in range(3):
        proc = run_job(argv, env=env, cwd=tmp_path, timeout=180, check=False)
        if proc.returncode == 0 or GLOO_EXIT_ABORT not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def test_a_trainer_gets_micro_batches_and_amp_from_a_config(tmp_path):
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    launch_applying(tmp_path, {"micro_batches": 2, "amp": "bf16"}, "hf_trainer_job.py", str(run), "--steps", "6",
                    "--window", "2:4")
    recorded = load_run(run)
    assert recorded.meta["knobs"]["amp"] == "bf16"
    names = [e["name"] for e in recorded.ranks[0].events if e["args"]["step"] == 3]
    assert names.count("FW.bert.embeddings.word_embeddings") == 2  # two micro-batches a step
    assert read_probes(run)[0].batch == 4  # the per-device batch of 8 as two of 4


def test_a_plain_ddp_loop_is_told_the_change_micro_batches_need(tmp_path):
    proc = launch_applying(tmp_path, {"micro_batches": 2}, "plain_ddp.py", "--steps", "3")
    assert "micro_batches=2 needs a code change in a plain training loop" in proc.stderr
