"""Interference: compute that overlaps communication runs slower, fitted and used by what-ifs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, run_job
from run_builder import make_run_of, x_event

from dpro.io.load import load_run
from dpro.record.protocol import INTERFERENCE_PAIRS, TRANSFER_PAIRS
from dpro.sim.interference import NONE, TransferSlowdown, fit_interference
from dpro.sim.whatif import context, predict

SLOWDOWN = 0.6


def _overlapping_steps(rank: int, step: int, share: float | None = None) -> list[dict]:
    """A step whose bucket allreduce overlaps ``share`` of BW.fc1 (by default a different share each step), BW.fc1
    lasting 2000 µs * (1 + SLOWDOWN * share)."""
    t0 = 1_000_000.0 + step * 20_000 + rank * 50
    share = (step % 5) / 4.0 if share is None else share  # 0, 0.25, ... 1
    bw = 2000.0 * (1.0 + SLOWDOWN * share)
    comm_start = t0 + 4100 + (1.0 - share) * bw
    return [
        x_event("STEP", "STEP", t0, 12_000.0, rank=rank, queue="host", step=step),
        x_event("FW.fc1", "FW", t0 + 100, 1000.0, rank=rank, queue="compute", step=step, bytes=2048),
        x_event("FW.fc2", "FW", t0 + 1100, 1000.0, rank=rank, queue="compute", step=step, bytes=1024),
        x_event("BW.fc2", "BW", t0 + 2100, 2000.0, rank=rank, queue="compute", step=step),
        x_event("BW.fc1", "BW", t0 + 4100, bw, rank=rank, queue="compute", step=step),
        x_event("COMM.bucket0.allreduce", "COMM", comm_start, 4000.0, rank=rank, queue="comm", step=step,
                bytes=12288, tensors=["fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias"], op="allreduce",
                phase="allreduce"),
        x_event("UPDATE.sgd", "UPDATE", comm_start + 4000, 500.0, rank=rank, queue="compute", step=step),
    ]


def test_the_steps_slowdown_is_read_off_but_only_the_probe_is_applied(tmp_path: Path) -> None:
    root = make_run_of(tmp_path / "run", _overlapping_steps, steps=range(3, 13))
    fitted = fit_interference(load_run(root))
    # d / mean(d) - 1 against f - mean(f): the slope is k / (1 + k * mean f), a little under k
    assert 0.4 < fitted.slowdown < SLOWDOWN + 0.05 and not fitted.applies, fitted
    assert "shown, not applied" in fitted.describe()
    meta = json.loads((root / "run.json").read_text())
    meta["interference_probe"] = {"slowdown": 0.5, "stderr": 0.05, "compute_overlapped_us": [1.0] * 5}
    (root / "run.json").write_text(json.dumps(meta))
    probed = fit_interference(load_run(root))
    assert probed.probed and probed.applies and probed.slowdown == 0.5
    assert "applied in what-ifs" in probed.describe()


def test_steps_that_overlap_alike_tell_nothing(tmp_path: Path) -> None:
    run = load_run(make_run_of(tmp_path / "run", lambda rank, step: _overlapping_steps(rank, step, 0.5),
                               steps=range(3, 9)))
    assert fit_interference(run) == NONE and not NONE.applies
    assert "not measurable" in NONE.describe()


@pytest.mark.slow
def test_a_real_ddp_job_measures_its_interference_and_the_what_if_uses_it(tmp_path: Path) -> None:
    """2 gloo ranks on this machine's cores: gloo's threads take CPU from compute while an allreduce is in flight;
    the recorder's probe after the window measures it, and a bucket what-if that overlaps less predicts a faster
    compute than one that prices overlap as free."""
    venv = str(Path(sys.executable).parent)
    run_job([sys.executable, "-m", "dpro.launch", "-np", "2", "--profile", "4:14", "--run-dir", "run", "python",
             str(JOBS / "plain_ddp.py"), "--steps", "16", "--width", "1024"],
            env=job_env(PATH=venv + os.pathsep + os.environ.get("PATH", "")), cwd=tmp_path, timeout=240)
    run = load_run(tmp_path / "run")
    probe = run.meta["interference_probe"]
    assert len(probe["compute_alone_us"]) == len(probe["compute_overlapped_us"]) == INTERFERENCE_PAIRS
    assert math.isfinite(probe["slowdown"]), probe  # the job's own pass beside an allreduce: may read ~0 here
    # the transfer side: allreduces at two sizes alone and beside the job's own passes
    transfer = run.meta["transfer_probe"]
    assert len(transfer["bytes"]) == 2 and transfer["bytes"][0] < transfer["bytes"][1]
    assert all(len(times) == TRANSFER_PAIRS for times in transfer["alone_us"] + transfer["under_compute_us"])
    assert transfer["excess_us"] > 0, transfer
    ctx = context(run)
    if not ctx.interference.applies and not ctx.interference.stretches_transfers:
        pytest.skip(f"the probes could not tell a slowdown from noise here: {ctx.interference.describe()}")
    one_bucket = {"torch.ddp.bucket_cap_mb": 100}
    with_it = predict(ctx, one_bucket).predicted_step_ms
    same = predict(ctx, {}).predicted_step_ms
    run.meta.pop("interference_probe")
    run.meta.pop("transfer_probe")
    free = context(run)  # the same recording modelled as if overlap were free
    assert predict(free, {}).predicted_step_ms == pytest.approx(same)  # the recorded setting replays alike
    # the what-if prices the overlap it changes
    assert with_it != pytest.approx(predict(free, one_bucket).predicted_step_ms, rel=1e-6)


def _two_buckets(rank: int, step: int) -> list[dict]:
    """Buckets of fc2 (4096 B) and fc1 (8192 B), 1000 µs per 4096 B; fc2's overlaps half of BW.fc1 in every step
    alike (the steps tell nothing of interference)."""
    t0 = 1_000_000.0 + step * 20_000 + rank * 50
    return [
        x_event("STEP", "STEP", t0, 8700.0, rank=rank, queue="host", step=step),
        x_event("FW.fc1", "FW", t0 + 100, 1000.0, rank=rank, queue="compute", step=step, bytes=2048),
        x_event("FW.fc2", "FW", t0 + 1100, 1000.0, rank=rank, queue="compute", step=step, bytes=1024),
        x_event("BW.fc2", "BW", t0 + 2100, 2000.0, rank=rank, queue="compute", step=step, grads=["fc2.weight",
                                                                                              "fc2.bias"]),
        x_event("BW.fc1", "BW", t0 + 4100, 2000.0, rank=rank, queue="compute", step=step, grads=["fc1.weight",
                                                                                              "fc1.bias"]),
        x_event("COMM.bucket0.allreduce", "COMM", t0 + 4100, 1000.0, rank=rank, queue="comm", step=step,
                bytes=4096, tensors=["fc2.weight", "fc2.bias"], op="allreduce", phase="allreduce"),
        x_event("COMM.bucket1.allreduce", "COMM", t0 + 6100, 2000.0, rank=rank, queue="comm", step=step,
                bytes=8192, tensors=["fc1.weight", "fc1.bias"], op="allreduce", phase="allreduce"),
        x_event("UPDATE.sgd", "UPDATE", t0 + 8150, 500.0, rank=rank, queue="compute", step=step),
    ]


def test_a_change_that_adds_overlap_must_gain_across_the_interference_the_probe_cannot_rule_out(tmp_path: Path) -> None:
    """A probe of +30% +/- 20% is not applied (within two standard errors of zero), yet it cannot rule out 70%: two
    buckets against one (fc2's allreduce overlapping BW.fc1) gain at 0 and less at 70%, and are judged by the
    smaller."""
    from dpro.sim.choices import clears, worst_gain_ms

    root = make_run_of(tmp_path / "run", _two_buckets, steps=range(3, 13))
    meta = json.loads((root / "run.json").read_text())
    meta["interference_probe"] = {"slowdown": 0.3, "stderr": 0.2, "compute_overlapped_us": [1.0] * 5}
    (root / "run.json").write_text(json.dumps(meta))
    ctx = context(load_run(root))
    assert ctx.interference.probed and not ctx.interference.applies
    assert ctx.interference.plausible() == pytest.approx((0.0, 0.7))
    one_bucket = {"torch.ddp.bucket_cap_mb": 100}
    gain = predict(ctx, one_bucket).predicted_step_ms - predict(ctx, {}).predicted_step_ms
    worst, at = worst_gain_ms(ctx, one_bucket, {})
    assert gain > 0 and worst < gain and at.slowdown == pytest.approx(0.7)
    _, shown = clears(ctx, gain, predict(ctx, one_bucket).predicted_step_ms, floor=0.0, change=(one_bucket, {}))
    assert "70% slower" in shown
    assert worst_gain_ms(dataclasses.replace(ctx, interference=NONE), one_bucket, {}) == (math.inf, None)


def test_a_transfer_beside_compute_stalls_then_moves_slower() -> None:
    slow = TransferSlowdown(stall_us=300.0, slowdown=1.0, stall_stderr=10.0, stderr=0.1, excess_us=800.0,
                            excess_stderr=50.0)
    assert slow.applies
    assert slow.end(0.0, 500.0, []) == pytest.approx(500.0)  # no compute: its time alone
    # under compute from 0 to 2000: waits 300, then 500 µs of work at half pace
    assert slow.end(0.0, 500.0, [(0.0, 2000.0)]) == pytest.approx(1300.0)
    # compute ends at 800: 300 stalled, 250 of work in 500 µs, the other 250 at full pace
    assert slow.end(0.0, 500.0, [(0.0, 800.0)]) == pytest.approx(1050.0)
    # starts with no compute: no stall; meets compute at 100, moves at half pace until 400, then alone
    assert slow.end(0.0, 500.0, [(100.0, 400.0)]) == pytest.approx(100.0 + 300.0 + 250.0)
    noisy = TransferSlowdown(300.0, 1.0, 10.0, 0.1, 80.0, 50.0)
    assert noisy.applies and not noisy.clear  # within the probe's noise: used as measured, said so
    assert "within twice its error" in noisy.describe()
    assert not TransferSlowdown(0.0, 0.0, 10.0, 0.1, -5.0, 50.0).applies  # compute lengthened nothing
    assert not TransferSlowdown(100.0, 50.0, 1.0, 0.1, 8000.0, 50.0).applies  # beyond belief


def test_the_transfer_probe_slows_the_transfers_a_what_if_overlaps(tmp_path: Path) -> None:
    """Two buckets (fc2's overlapping BW.fc1) against one after the backward: with the transfer probe, the recorded
    buckets, priced alone and stretched beside the compute, still replay to the recorded step (the calibration
    finds a lower price alone), and one bucket, which overlaps nothing, gains against the two."""
    root = make_run_of(tmp_path / "run", _two_buckets, steps=range(3, 13))
    meta = json.loads((root / "run.json").read_text())
    plain = context(load_run(root))
    meta["transfer_probe"] = {"stall_us": 300.0, "stall_stderr": 20.0, "slowdown": 1.0, "stderr": 0.1,
                              "excess_us": 800.0, "excess_stderr": 50.0}
    (root / "run.json").write_text(json.dumps(meta))
    ctx = context(load_run(root))
    assert ctx.interference.stretches_transfers and "transfer probe" in ctx.interference.describe()
    assert not plain.interference.stretches_transfers
    groups = {"tensor_groups": [["fc2.weight", "fc2.bias"], ["fc1.weight", "fc1.bias"]]}
    assert predict(ctx, groups).predicted_step_ms == pytest.approx(predict(ctx, {}).predicted_step_ms, rel=0.01)
    assert ctx.comm.us_per_byte < plain.comm.us_per_byte  # the recorded transfers held the stretch
    one_bucket = {"torch.ddp.bucket_cap_mb": 100}
    gain = predict(ctx, {}).predicted_step_ms - predict(ctx, one_bucket).predicted_step_ms
    plain_gain = predict(plain, {}).predicted_step_ms - predict(plain, one_bucket).predicted_step_ms
    assert gain > plain_gain


def test_a_change_that_moves_overlap_must_gain_across_the_transfer_stretch_the_probe_cannot_rule_out(
        tmp_path: Path) -> None:
    """The transfer probe's ends (stall and slowdown +/- twice their errors) price the change again, the comm model
    calibrated again at each: one bucket after the backward against two gains less where the stretch of the
    overlapped bucket is smaller, least where there is none, and is judged there."""
    from dpro.sim.choices import clears, worst_gain_ms

    root = make_run_of(tmp_path / "run", _two_buckets, steps=range(3, 13))
    meta = json.loads((root / "run.json").read_text())
    meta["transfer_probe"] = {"stall_us": 300.0, "stall_stderr": 150.0, "slowdown": 1.0, "stderr": 0.5,
                              "excess_us": 800.0, "excess_stderr": 100.0}
    (root / "run.json").write_text(json.dumps(meta))
    ctx = context(load_run(root))
    low, high = ctx.interference.ends()
    assert low.transfer.stall_us == pytest.approx(0.0) and low.transfer.slowdown == pytest.approx(0.0)
    assert high.transfer.stall_us == pytest.approx(600.0) and high.transfer.slowdown == pytest.approx(2.0)
    one_bucket = {"torch.ddp.bucket_cap_mb": 100}
    gain = predict(ctx, {}).predicted_step_ms - predict(ctx, one_bucket).predicted_step_ms
    worst, at = worst_gain_ms(ctx, {}, one_bucket)
    assert worst < gain and at == low  # no stretch: one bucket gains least
    _, shown = clears(ctx, gain, predict(ctx, one_bucket).predicted_step_ms, floor=0.0, change=({}, one_bucket))
    assert "a transfer beside compute waits 0.0 ms, then takes 1.0x as long" in shown
