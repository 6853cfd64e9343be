"""DDP bucket what-if on PyTorch profiler traces: gradients and buckets read from a real job's CPU traces, regrouped."""

from __future__ import annotations

import json

import pytest

from dpro.engines.torch_ddp.traces import _busy_periods, _partition, fit_transfer


def test_recorded_allreduces_partition_the_gradients_in_ready_order():
    assert _partition([4, 4, 8, 2], [8, 10]) == [[0, 1], [2, 3]]
    assert _partition([4, 4, 8, 2], [18]) == [[0, 1, 2, 3]]
    assert _partition([4, 4, 8, 2], [4, 10, 4]) is None  # 10 is not a run of consecutive gradients
    assert _partition([4, 4, 8, 2], [8, 8]) is None      # a gradient left over: not only DDP's buckets


def test_overlapping_allreduces_are_one_busy_period_of_the_link():
    # gloo runs two at once: a big one and a small one that shares the link with it for its whole life
    assert _busy_periods([(0.0, 250.0, 9000), (10.0, 100.0, 80), (300.0, 320.0, 500)]) == [(9080, 250.0), (500, 20.0)]


def test_the_transfer_fit_recovers_latency_and_bandwidth():
    fit = fit_transfer([(1000, 150.0), (3000, 350.0), (1000, 150.0)])
    assert fit.latency_us == pytest.approx(50.0) and fit.us_per_byte == pytest.approx(0.1)
    single = fit_transfer([(2000, 100.0), (2000, 120.0)])  # one size: all bandwidth, no latency assumed
    assert single.latency_us == 0.0 and single(1000) == pytest.approx(55.0)


@pytest.mark.slow
def test_bucket_whatif_on_cpu_traces_of_a_real_ddp_job(tmp_path, capsys):
    """torch.profiler CPU traces (record_shapes) of a 2-rank gloo DDP job at 25 MB buckets: the gradients are read
    from autograd's AccumulateGrad in the order they were ready, DDP's one bucket is recognised, and a 0.25 MB
    cap regroups them into DDP's buckets for that cap, each allreduce launched by its last gradient."""
    pytest.importorskip("torch")
    from jobrunner import torchrun

    from dpro.analyze.traces import whatif_traces
    from dpro.cli import main
    from dpro.dag.kineto import graph_from_kineto
    from dpro.engines.torch_ddp import ddp_buckets
    from dpro.engines.torch_ddp.traces import ddp_steps
    from dpro.errors import UsageError
    from dpro.io.kineto import load_traces

    torchrun("profiled_gloo_ddp.py", "--out", str(tmp_path), "--bucket-cap-mb", "25", "--record-shapes")
    paths = [tmp_path / f"rank{r}.pt.trace.json" for r in (0, 1)]
    traces = load_traces(paths)
    g, info = graph_from_kineto(traces)
    ddp = ddp_steps(traces, info)
    # the job's MLP: Linear(512, 1024), Linear(1024, 1024), Linear(1024, 10), float32, last layer's gradients first
    assert sum(b for _, b in ddp.gradients) == 4 * (512 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10)
    assert [b for _, b in ddp.gradients[:2]] in ([40, 40960], [40960, 40])
    assert len(ddp.groups) == 1 and len(ddp.transfers) == len(info.steps)
    result = whatif_traces(traces, {"torch.ddp.bucket_cap_mb": 0.25})
    assert result["recorded_buckets"] == 1
    assert result["buckets"] == len(ddp_buckets(ddp.gradients, 0.25)) > 1
    # the recorded grouping, allreduces priced by the fitted model, replays near the measured step (loopback on a
    # shared 2-core machine: the steps themselves vary by tens of %)
    assert 0.6 < result["recorded_buckets_modelled_step_ms"] / result["measured_step_ms"] < 1.5
    assert result["predicted_step_ms"] > 0
    names = [n for n, _ in ddp.gradients]
    same = whatif_traces(traces, {"tensor_groups": [names]})
    assert same["predicted_step_ms"] == pytest.approx(result["recorded_buckets_modelled_step_ms"], rel=1e-6)
    with pytest.raises(UsageError, match="name every gradient once"):
        whatif_traces(traces, {"tensor_groups": [names[:2]]})
    assert main(["whatif", *map(str, paths), "--set", "torch.ddp.bucket_cap_mb=0.25"]) == 0
    out = capsys.readouterr().out
    assert "1 -> " in out and "AccumulateGrad" in out and "Gbit/s" in out
    assert main(["whatif", *map(str, paths), "--set", "torch.ddp.bucket_cap_mb=0.25", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["buckets"] == result["buckets"]
    # dpro optimize on the traces: each distinct DDP grouping replayed, an applied config written
    from dpro.config import read_config

    assert main(["optimize", *map(str, paths), "-o", str(tmp_path / "config.json")]) == 0
    assert "bucket cap MB" in capsys.readouterr().out
    config = read_config(tmp_path / "config.json")
    assert config.fingerprint.engine == "torch-ddp" and config.fingerprint.model.startswith("gradient-shapes:")
    assert set(config.knobs) <= {"torch.ddp.bucket_cap_mb"} and config.explain
    assert main(["optimize", *map(str, paths), "--allow-compression"]) != 0
    assert "no --allow-compression" in capsys.readouterr().err
    # a budget is taken, and said not to bear on bucket caps (the buckets hold every gradient whatever their cap)
    assert main(["optimize", *map(str, paths), "--memory-budget", "1GiB", "-o", str(tmp_path / "c2.json")]) == 0
    assert "does not bear on it" in capsys.readouterr().out
