"""``DproTrainerCallback``: a real 2-rank ``transformers.Trainer`` job (gloo DDP on CPU) records itself from the
callback, both ranks, with DDP's flags as the Trainer set them."""

from __future__ import annotations

import pytest
from jobrunner import torchrun

pytest.importorskip("transformers")

from dpro.analyze import analyze_run  # noqa: E402
from dpro.io.load import load_run  # noqa: E402

pytestmark = pytest.mark.slow  # a real 2-rank job (transformers takes seconds to import)


def test_a_trainer_job_records_itself_from_the_callback(tmp_path):
    run_dir = tmp_path / "run"
    torchrun("hf_trainer_job.py", str(run_dir), "--steps", "12", "--window", "3:9", timeout=300)
    run = load_run(run_dir)
    assert sorted(run.ranks) == [0, 1] and run.meta["engine"] == "torch-ddp" and not run.problems
    assert run.meta["knobs"]["torch.ddp.find_unused_parameters"] is True  # the Trainer's default
    for rank in (0, 1):
        events = run.ranks[rank].events
        assert sorted({e["args"]["step"] for e in events if e["cat"] == "STEP"}) == list(range(3, 9))
        assert {"FW", "BW", "COMM", "UPDATE"} <= {e["cat"] for e in events}
        assert any(e["name"] == "FW.ddp.post_forward" for e in events)
    assert analyze_run(run).analysis.predicted_step_ms > 0  # the benches measure accuracy
