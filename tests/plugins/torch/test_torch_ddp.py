"""Real 2-rank gloo DDP jobs recorded by dpro.plugins.torch.Profiler."""

from __future__ import annotations

import json
import sys

import pytest
from jobrunner import run_job, torchrun

torch = pytest.importorskip("torch")

from dpro.io.load import load_run  # noqa: E402
from dpro.plugins.torch.models import get_example  # noqa: E402
from dpro.plugins.torch.recorder import recorded_modules  # noqa: E402

pytestmark = pytest.mark.slow  # every test here runs a real multi-process job

PROFILED = range(2, 6)


def expected_modules(model: torch.nn.Module) -> set[str]:
    """Modules that must have events: leaves and parameter owners, minus leaves their owner computes
    without calling them (nn.MultiheadAttention's out_proj)."""
    names = {n for n, _ in recorded_modules(model)}
    owners = {n for n, m in model.named_modules() if n and next(m.parameters(recurse=False), None) is not None
              and next(m.children(), None) is not None}
    return {n for n in names if not any(n.startswith(o + ".") for o in owners)}


def by_step(events: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in events:
        out.setdefault(e["args"]["step"], []).append(e)
    return out


@pytest.mark.parametrize("model_name", ["mlp", "transformer", "convnet"])
def test_ddp_job_records_every_rank_and_step(tmp_path, model_name):
    run_dir = tmp_path / "run"
    torchrun("ddp_job.py", "--model", model_name, "--steps", "8", "--profile", "2:6", "--run-dir", str(run_dir),
             "--bucket-cap-mb", "0.25")
    run = load_run(run_dir)
    assert run.meta["engine"] == "torch-ddp" and run.meta["world_size"] == 2
    assert run.meta["knobs"]["torch.ddp.bucket_cap_mb"] == 0.25
    assert sorted(run.ranks) == [0, 1] and not run.problems

    model = get_example(model_name).build()
    expected = expected_modules(model)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert run.model["param_bytes"] == grad_bytes
    assert {g["name"] for g in run.model["gradients"]} == {n for n, _ in model.named_parameters()}
    assert sum(b["bytes"] for b in run.model["buckets"]) == grad_bytes

    for rank, trace in run.ranks.items():
        assert trace.complete and trace.steps == list(PROFILED), rank
        steps = by_step(trace.events)
        assert sorted(steps) == list(PROFILED)
        for step, events in steps.items():
            names = {e["name"] for e in events}
            assert {f"FW.{m}" for m in expected} <= names, (rank, step, {f"FW.{m}" for m in expected} - names)
            assert {f"BW.{m}" for m in expected} <= names, (rank, step, {f"BW.{m}" for m in expected} - names)
            def cat(c: str, events: list[dict] = events) -> list[dict]:
                return [e for e in events if e["cat"] == c]

            assert len(cat("STEP")) == 1 and len(cat("UPDATE")) == 1 and len(cat("IO")) == 1
            comm = cat("COMM")
            assert sum(e["args"]["bytes"] for e in comm) == grad_bytes
            communicated = sorted(t for e in comm for t in e["args"]["tensors"])
            assert communicated == sorted(g["name"] for g in run.model["gradients"])
            end = lambda e: e["ts"] + e["dur"]  # noqa: E731
            fw_end = max(end(e) for e in cat("FW"))
            bw_start = min(e["ts"] for e in cat("BW"))
            update = cat("UPDATE")[0]
            step_ev = cat("STEP")[0]
            assert fw_end <= bw_start
            assert all(end(e) > bw_start for e in comm)
            assert max(end(e) for e in comm) <= update["ts"]
            assert max(end(e) for e in cat("BW")) <= update["ts"]
            assert step_ev["ts"] <= min(e["ts"] for e in events) and max(end(e) for e in events) <= end(step_ev) + 1


def test_transformer_attention_time_is_recorded_on_the_module_that_owns_it(tmp_path):
    run_dir = tmp_path / "run"
    torchrun("ddp_job.py", "--model", "transformer", "--steps", "4", "--profile", "1:3", "--run-dir", str(run_dir))
    run = load_run(run_dir)
    grads = {g["name"]: g for g in run.model["gradients"]}
    # out_proj is never called: its gradients are computed inside self_attn's backward.
    assert grads["encoder.0.self_attn.out_proj.weight"]["computed_by"] == "encoder.0.self_attn"
    names = {e["name"] for e in run.ranks[0].events}
    assert "FW.encoder.0.self_attn" in names and "FW.encoder.0.self_attn.out_proj" not in names


def test_killed_rank_leaves_finished_steps_readable(tmp_path):
    run_dir = tmp_path / "run"
    proc = torchrun("ddp_job.py", "--model", "mlp", "--steps", "40", "--profile", "2:38", "--run-dir", str(run_dir),
                    "--crash-rank", "1", "--crash-step", "30", check=False)
    assert proc.returncode != 0
    run = load_run(run_dir)
    assert sorted(run.ranks) == [0, 1]
    for rank in (0, 1):
        trace = run.ranks[rank]
        assert not trace.complete
        # Rank 1 died outright after finishing step 29; rank 0 waited in step 30's allreduce until torchrun stopped
        # it. The builder thread journals every BUILD_INTERVAL_S (50 ms): the steps finished before the last few are
        # there, in order, each whole, and nothing after step 29.
        assert trace.steps == list(range(2, 2 + len(trace.steps))), (rank, trace.steps)
        assert 15 <= len(trace.steps) <= 28, (rank, trace.steps)
        assert {e["args"]["step"] for e in trace.events} == set(trace.steps)
    assert any("rank 1" in p for p in run.problems)
    info = run_job([sys.executable, "-m", "dpro", "info", str(run_dir)])
    assert "did not finish" in info.stdout or "incomplete" in info.stdout


def test_existing_run_is_never_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    torchrun("ddp_job.py", "--steps", "3", "--profile", "1:2", "--run-dir", str(run_dir))
    before = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert "probes/rank-0.json" in before  # a folder of the run's own
    proc = torchrun("ddp_job.py", "--steps", "3", "--profile", "1:2", "--run-dir", str(run_dir), check=False)
    assert proc.returncode != 0 and "never overwrites" in proc.stderr
    assert proc.stderr.count("dpro: error:") == 1  # said once, by rank 0, not by every rank
    assert {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    json.loads((run_dir / "rank-0.json").read_text())


def test_a_rank_measures_what_recording_cost_it(tmp_path):
    """Steps before the window are timed (wall and training-thread CPU): each rank's trace says what recorded
    steps cost against them, and dpro info shows it."""
    run_dir = tmp_path / "run"
    torchrun("ddp_job.py", "--model", "mlp", "--steps", "14", "--profile", "8:13", "--run-dir", str(run_dir))
    run = load_run(run_dir)
    for trace in run.ranks.values():
        overhead = trace.header["recording_overhead"]
        assert overhead["unrecorded_steps"] >= 3 and overhead["recorded_steps"] == 4
        assert all(v > 0 for v in overhead["thread_cpu_ms"] + overhead["wall_ms"])
    info = run_job([sys.executable, "-m", "dpro", "info", str(run_dir)]).stdout
    assert "recording overhead" in info and "training thread CPU" in info
