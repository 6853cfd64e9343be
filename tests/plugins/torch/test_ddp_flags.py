"""DDP's own flags: ``find_unused_parameters`` is timed in a real job (DDP's search after the forward), priced by
what-if, weighed by the search (never turned off while a parameter goes without a gradient) and applied."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, run_job

pytest.importorskip("torch")

from dpro.io.load import load_run  # noqa: E402
from dpro.optimize import optimize  # noqa: E402
from dpro.sim.whatif import context, predict  # noqa: E402

pytestmark = pytest.mark.slow  # real 2-rank jobs

FIND_UNUSED = "torch.ddp.find_unused_parameters"


def launch(tmp_path: Path, name: str, *script_args: str, apply: Path | None = None) -> Path:
    env = job_env(PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    run_job([sys.executable, "-m", "dpro.launch", "-np", "2", "--profile", "3:11", "--run-dir", name,
             *(["--apply", str(apply)] if apply else []), "python", str(JOBS / "plain_ddp.py"), "--steps", "14",
             *script_args], env=env, cwd=tmp_path, timeout=240)
    return tmp_path / name


def post_forwards(run: Path) -> list[dict]:
    return [e for e in load_run(run).ranks[0].events if e["name"] == "FW.ddp.post_forward"]


def test_find_unused_parameters_is_timed_priced_and_applied(tmp_path):
    run = launch(tmp_path, "on", "--find-unused")
    ctx = context(load_run(run))
    assert ctx.knobs[FIND_UNUSED] is True
    searched = post_forwards(run)
    assert len(searched) == 8 and all(e["args"]["find_unused_parameters"] and e["dur"] > 0 for e in searched)
    base, off = predict(ctx, {}), predict(ctx, {FIND_UNUSED: False})
    assert off.predicted_step_ms < base.predicted_step_ms  # the search's time goes
    line = next(e for e in optimize(ctx).explain if e["knob"] == FIND_UNUSED)
    assert "every parameter got a gradient" in line["why"]
    config = tmp_path / "config.json"
    meta = load_run(run).meta
    config.write_text(json.dumps({
        "schema": "dpro.config/1",
        "fingerprint": {"framework": "torch", "engine": "torch-ddp", "world_size": 2,
                        "model": meta["model_fingerprint"]},
        "knobs": {FIND_UNUSED: False}, "explain": []}))
    applied = launch(tmp_path, "off", "--find-unused", apply=config)
    assert load_run(applied).meta["knobs"][FIND_UNUSED] is False  # DDP was built without it
    assert not any(e["args"]["find_unused_parameters"] for e in post_forwards(applied))


def test_it_stays_on_while_a_parameter_gets_no_gradient(tmp_path):
    ctx = context(load_run(launch(tmp_path, "spare", "--find-unused", "--unused-layer")))
    line = next(e for e in optimize(ctx).explain if e["knob"] == FIND_UNUSED)
    assert line["why"].startswith("kept on") and "spare.weight" in line["why"]
    assert FIND_UNUSED not in optimize(ctx).knobs
