"""The compile knob in real 2-rank gloo DDP jobs: the compile probe after the window (written with the other probes,
shown by dpro info, left out of the model, pricing ``whatif --set compile=``), and a config's compile applied by
dpro-launch to an unmodified script."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, run_job, torchrun

torch = pytest.importorskip("torch")

from dpro.cli import main  # noqa: E402
from dpro.io.load import load_run  # noqa: E402
from dpro.io.probes import read_probes  # noqa: E402
from dpro.sim.probes import compile_ratios, with_compile  # noqa: E402
from dpro.sim.whatif import context, predict, replay_model  # noqa: E402

pytestmark = pytest.mark.slow  # every test here runs a real multi-process job

GLOO_EXIT_ABORT = "terminate called without an active exception"  # torch 2.13's gloo, now and then, at exit


def twice_if_gloo_aborts(argv_run) -> None:
    for attempt in range(3):
        proc = argv_run()
        if proc.returncode == 0:
            return
        if GLOO_EXIT_ABORT not in proc.stderr or attempt == 2:
            pytest.fail(f"job exited {proc.returncode}\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def compiled_probe_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("compile") / "run"
    env = job_env(DPRO_PROBE_COMPILE="<root>")
    twice_if_gloo_aborts(lambda: torchrun("ddp_job.py", "--model", "mlp", "--steps", "6", "--profile", "2:4",
                                          "--run-dir", str(run), env=env, check=False, timeout=240))
    return run


def test_the_compile_probe_times_the_model_compiled_and_eager(compiled_probe_run):
    probes = read_probes(compiled_probe_run)
    assert sorted(probes) == [0, 1]
    for rank_probes in probes.values():
        probe = rank_probes.compiled("<root>")
        assert probe is not None, rank_probes.skipped
        assert set(probe.ops) == set(probe.eager) == {"FW", "BW"} and all(v > 0 for v in probe.eager.values())
        assert set(compile_ratios(probe)) == {"FW", "BW"}
        assert rank_probes.find(None, 64).compile is None  # the hooked reference probe is there as before
    run = load_run(compiled_probe_run)
    assert all(e["args"]["step"] in (2, 3) for trace in run.ranks.values() for e in trace.events)
    assert "compile <root>" in run.meta["probes"]["probes"]


def test_dpro_info_and_whatif_use_the_compile_probe(compiled_probe_run, capsys):
    assert main(["info", str(compiled_probe_run)]) == 0
    assert "compiled <root>" in capsys.readouterr().out
    assert main(["whatif", str(compiled_probe_run), "--set", "compile=<root>", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ctx = context(load_run(compiled_probe_run))
    expected = replay_model(ctx, with_compile(ctx.base, ctx.probes, ["<root>"]), {"compile": ["<root>"]})
    assert out["predicted_step_ms"] == pytest.approx(expected.predicted_step_ms)
    assert out["predicted_step_ms"] != pytest.approx(predict(ctx, {}).predicted_step_ms, rel=1e-6)
    assert main(["whatif", str(compiled_probe_run), "--set", "compile=net.0"]) != 0  # not probed: refused
    assert "the probes timed compiled only <root>" in capsys.readouterr().err


def test_dpro_launch_applies_compile_to_an_unmodified_script(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"schema": "dpro.config/1", "knobs": {"compile": ["<root>"]}, "fingerprint": {
        "framework": "torch", "engine": "torch-ddp", "world_size": 2, "model": "another"}}))
    run = tmp_path / "run"
    env = job_env(PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    argv = [sys.executable, "-m", "dpro.launch", "-np", "2", "--profile", "2:4", "--run-dir", str(run), "--apply",
            str(config), "--force", "python", str(JOBS / "plain_ddp.py"), "--steps", "6"]
    twice_if_gloo_aborts(lambda: run_job(argv, env=env, cwd=tmp_path, timeout=240, check=False))
    recorded = load_run(run)
    assert recorded.meta["knobs"]["compile"] == ["<root>"]  # compiled in place, still running at the window
    names = {e["name"] for e in recorded.ranks[0].events}
    assert "STEP" in names and not any(n.startswith("FW.") for n in names)  # compiled: modules untimed
