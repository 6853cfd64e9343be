"""Pricing amp and micro_batches from probe passes (dpro.sim.probes), on hand-written probe files and the hand-built
two-layer run of run_builder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_builder import make_run

from dpro.cli import main
from dpro.errors import TraceError, UsageError
from dpro.io.load import load_run
from dpro.io.probes import Probe, RankProbes, read_probes
from dpro.sim.probes import (
    activation_scale,
    amp_ratios,
    batch_ratios,
    compile_ratios,
    fit_line,
    pass_starts,
    step_passes,
    with_amp,
    with_compile,
    with_micro_batches,
)
from dpro.sim.whatif import context, parse_settings, peak_memory, predict, transformed_model

OPS = ("FW.fc1", "FW.fc2", "BW.fc2", "BW.fc1")


def probe_doc(rank: int, times: dict[tuple[str | None, int], dict[str, float]], *, batch: int = 16,
              activations: dict[tuple[str | None, int], int] | None = None,
              skipped: list[dict[str, str]] | None = None) -> dict:
    """A ``probes/rank-<r>.json`` as the torch recorder writes it."""
    activations = activations or {}
    return {"schema": "dpro.probes/1", "rank": rank, "batch": batch, "skipped": skipped or [],
            "probes": [{"amp": amp, "batch": rows, "passes": 3, "pass_us": sum(ops.values()),
                        "activation_bytes": activations.get((amp, rows), 3072 * rows // batch), "ops": ops}
                       for (amp, rows), ops in times.items()]}


def linear(intercept: float, slope: float, rows: int) -> dict[str, float]:
    return {op: intercept + slope * rows for op in OPS}


def write_probes(run: Path, docs: list[dict]) -> None:
    (run / "probes").mkdir()
    for doc in docs:
        (run / "probes" / f"rank-{doc['rank']}.json").write_text(json.dumps(doc))


def rank_probes(times: dict[tuple[str | None, int], dict[str, float]], **kw) -> RankProbes:
    probes = [Probe(amp, rows, 3, ops, sum(ops.values()), 100 * rows) for (amp, rows), ops in times.items()]
    return RankProbes(0, 16, probes, kw.get("skipped", []))


def test_fit_line_is_exact_through_two_points_and_least_squares_through_more():
    assert fit_line([(16, 260.0), (8, 180.0)]) == pytest.approx((100.0, 10.0))
    a, s = fit_line([(16, 260.0), (8, 180.0), (4, 150.0)])  # 4 rows: 10 us above the line
    assert s == pytest.approx(9.2857, rel=1e-4) and a == pytest.approx(110.0)
    assert fit_line([(16, 320.0)]) == (0.0, 20.0)  # one batch: proportional


def test_batch_ratios_follow_the_fitted_line_not_the_batch():
    probes = rank_probes({(None, 16): linear(100, 10, 16), (None, 8): linear(100, 10, 8),
                          (None, 4): linear(100, 10, 4)})
    ratios = batch_ratios(probes, 2)
    assert ratios["FW.fc1"] == pytest.approx(180 / 260)  # not 0.5: the fixed 100 us stays per micro-batch
    assert batch_ratios(probes, 4)["BW.fc2"] == pytest.approx(140 / 260)


def test_batch_ratio_has_a_floor_where_the_line_crosses_zero():
    probes = rank_probes({(None, 16): {"FW.fc1": 1000.0}, (None, 8): {"FW.fc1": 100.0}})
    assert batch_ratios(probes, 4)["FW.fc1"] == pytest.approx(0.02)


def test_batch_ratios_need_a_smaller_batch():
    with pytest.raises(UsageError, match="ran no smaller batch than the recorded 16 rows"):
        batch_ratios(rank_probes({(None, 16): linear(0, 10, 16)}), 2)


def test_amp_ratios_are_measured_and_a_skipped_precision_says_why():
    probes = rank_probes({(None, 16): linear(0, 10, 16), ("bf16", 16): linear(0, 100, 16)},
                         skipped=[{"probe": "fp16 at batch 16", "why": "RuntimeError: not supported"}])
    assert amp_ratios(probes, "bf16") == {op: pytest.approx(10.0) for op in OPS}  # slower: measured, not assumed
    with pytest.raises(UsageError, match=r"no fp16 pass \(RuntimeError: not supported\)"):
        amp_ratios(probes, "fp16")


def test_activation_scale_uses_the_kept_bytes_the_probes_measured():
    probes = rank_probes({(None, 16): linear(0, 1, 16), (None, 8): linear(0, 1, 8), ("bf16", 16): linear(0, 1, 16)})
    probes.probes[2] = Probe("bf16", 16, 3, probes.probes[2].ops, 1.0, 600)  # 600 of 1600 bytes
    assert activation_scale(probes, "bf16", 1) == pytest.approx(600 / 1600)
    assert activation_scale(probes, None, 2) == pytest.approx(800 / 1600)
    assert activation_scale(probes, None, 8) == pytest.approx(1 / 8)  # not probed: 1/k


@pytest.fixture
def run_with_probes(tmp_path):
    run = make_run(tmp_path / "run")
    times = {(None, 16): linear(0, 50, 16), (None, 8): linear(0, 50, 8), ("bf16", 16): linear(0, 100, 16)}
    write_probes(run, [probe_doc(r, times) for r in (0, 1)])
    return run


def test_micro_batches_run_every_pass_and_communicate_after_the_last(run_with_probes):
    ctx = context(load_run(run_with_probes))
    model = with_micro_batches(ctx.base, ctx.probes, 2)
    names = [op.name for op in model.ops[0]]
    assert names.index("BW.fc1") < names.index("FW.fc1#2")  # the first pass ends before the second begins
    comm = [i for i, n in enumerate(names) if n.startswith("COMM")]
    assert len(comm) == 2 and min(comm) > names.index("BW.fc2#2")  # once, in the last pass's backward
    base = {op.name: op.duration for op in ctx.base.ops[0]}
    durations = {op.name: op.duration for op in model.ops[0]}
    # proportional probes: each micro-batch takes half, the two together what the one pass took
    assert durations["FW.fc1"] + durations["FW.fc1#2"] == pytest.approx(base["FW.fc1"])
    assert durations["UPDATE.sgd"] == base["UPDATE.sgd"]
    orders = [op.order for op in model.ops[0]]
    assert orders == sorted(orders)


def test_amp_scales_the_probed_ops_only(run_with_probes):
    ctx = context(load_run(run_with_probes))
    model = with_amp(ctx.base, ctx.probes, "bf16")
    base = {op.name: op.duration for op in ctx.base.ops[0]}
    for op in model.ops[0]:
        assert op.duration == pytest.approx(base[op.name] * (2.0 if op.name in OPS else 1.0)), op.name


def test_whatif_prices_both_knobs_and_their_memory(run_with_probes):
    ctx = context(load_run(run_with_probes))
    recorded = predict(ctx, {})
    slower = predict(ctx, {"amp": "bf16"})
    assert slower.predicted_step_ms > recorded.predicted_step_ms + 5.0  # 6 ms of FW/BW twice as long
    # the probes kept as many activation bytes under bf16; autocast adds a cast copy of the weights
    assert peak_memory(ctx, {"amp": "bf16"}) == ctx.memory.peak_bytes() + ctx.memory.param_bytes // 2
    split = predict(ctx, {"micro_batches": 2})
    assert split.predicted_peak_memory_bytes < recorded.predicted_peak_memory_bytes


def test_cli_whatif_takes_the_knobs(run_with_probes, capsys):
    assert main(["whatif", str(run_with_probes), "--set", "amp=bf16", "--set", "micro_batches=2"]) == 0
    assert "amp=bf16 micro_batches=2" in capsys.readouterr().out


def test_whatif_without_probes_says_how_to_get_them(tmp_path):
    ctx = context(load_run(make_run(tmp_path / "run")))
    with pytest.raises(UsageError, match=r"amp=bf16: this run has no probe passes"):
        predict(ctx, {"amp": "bf16"})


def test_a_run_that_already_accumulates_is_priced_from_its_last_pass(run_with_probes):
    ctx = context(load_run(run_with_probes))
    twice = with_micro_batches(ctx.base, ctx.probes, 2)
    assert step_passes(ctx.base) == 1 and step_passes(twice) == 2
    assert with_micro_batches(twice, ctx.probes, 2).ops == twice.ops  # already so: left as it is
    # proportional probes: one pass of both micro-batches' rows takes what the recorded pass took
    once = with_micro_batches(twice, ctx.probes, 1)
    base = {op.name: op.duration for op in ctx.base.ops[0]}
    assert {op.name: pytest.approx(op.duration) for op in once.ops[0]} == base
    four = {op.name: op.duration for op in with_micro_batches(twice, ctx.probes, 4).ops[0]}
    assert four == pytest.approx({op.name: op.duration for op in with_micro_batches(ctx.base, ctx.probes, 4).ops[0]})
    names = list(four)
    assert sum(n.startswith("COMM") for n in names) == 2
    assert names.index("COMM.bucket0.allreduce") > names.index("BW.fc2#4")


def test_a_forward_op_run_twice_in_one_pass_is_one_pass(run_with_probes):
    ctx = context(load_run(run_with_probes))
    ops = ctx.base.ops[0]
    first = next(i for i, op in enumerate(ops) if op.category == "FW")
    assert pass_starts(ops[:first + 1] + ops[first:]) == [first]  # a shared layer called again before backward


def test_whatif_from_an_accumulating_run_counts_its_passes(run_with_probes):
    ctx = context(load_run(run_with_probes))
    split = predict(ctx, {"micro_batches": 2})
    assert split.predicted_step_ms > predict(ctx, {"micro_batches": 1}).predicted_step_ms
    assert peak_memory(ctx, {"micro_batches": 1}) == ctx.memory.peak_bytes()


@pytest.mark.parametrize(("change", "problem"), [
    ({"schema": "dpro.trace/1"}, "not a probe file"),
    ({"rank": 3}, "says rank 3, its name rank 0"),
    ({"probes": [{"amp": "int8", "batch": 4, "passes": 1, "ops": {}, "pass_us": 1, "activation_bytes": 0}]},
     "amp must be null"),
    ({"probes": [{"amp": None, "batch": 0, "passes": 1, "ops": {}, "pass_us": 1, "activation_bytes": 0}]},
     "must be a positive whole number"),
])
def test_reader_refuses_what_the_recorder_does_not_write(tmp_path, change, problem):
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "rank-0.json").write_text(json.dumps({**probe_doc(0, {(None, 16): linear(0, 1, 16)}),
                                                                **change}))
    with pytest.raises(TraceError, match=problem):
        read_probes(tmp_path)


def test_each_micro_batch_recomputes_its_own_forward(run_with_probes):
    ctx = context(load_run(run_with_probes))
    names = [op.name for op in transformed_model(ctx, {"micro_batches": 2, "recompute": ["fc1"]}).ops[0]]
    assert names.index("RECOMPUTE.fc1") == names.index("BW.fc1") - 1
    assert names.index("RECOMPUTE.fc1#2") == names.index("BW.fc1#2") - 1


def test_work_between_modules_scales_the_gaps_inside_the_pass(tmp_path):
    run = make_run(tmp_path / "run")
    docs = [probe_doc(r, {(None, 16): linear(0, 50, 16), (None, 8): linear(0, 50, 8),
                          ("bf16", 16): linear(0, 50, 16)}) for r in (0, 1)]
    for doc in docs:
        for probe in doc["probes"]:  # outside the modules: 1 ms as recorded, 3 ms under bf16
            probe["pass_us"] = sum(probe["ops"].values()) + (3000.0 if probe["amp"] else 1000.0)
    write_probes(run, docs)
    ctx = context(load_run(run))
    for op in ctx.base.ops[0]:
        if op.name in ("FW.fc1", "FW.fc2"):
            op.gap = 100.0
    gaps = {op.name: op.gap for op in with_amp(ctx.base, ctx.probes, "bf16").ops[0]}
    assert gaps["FW.fc2"] == pytest.approx(300.0)
    assert gaps["FW.fc1"] == 100.0  # the gap before the pass: the loop's own work


def probed_run(tmp_path: Path, bf16_slope: float) -> Path:
    """The hand-built run with probes: fixed 200 us plus 50 us a row per op as recorded, bf16 at ``bf16_slope``."""
    run = make_run(tmp_path / "run")
    times = {(None, 16): linear(200, 50, 16), (None, 8): linear(200, 50, 8), ("bf16", 16): linear(0, bf16_slope, 16)}
    write_probes(run, [probe_doc(r, times) for r in (0, 1)])
    return run


@pytest.mark.parametrize(("bf16_slope", "allowed", "picked"), [
    (10.0, True, True),    # measured much faster, allowed
    (10.0, False, False),  # faster, but numerics change: only with --allow-precision
    (200.0, True, False),  # measured slower: never
])
def test_optimize_takes_autocast_only_allowed_and_measured_faster(tmp_path, bf16_slope, allowed, picked):
    from dpro.optimize import optimize

    result = optimize(context(load_run(probed_run(tmp_path, bf16_slope))), allow_precision=allowed)
    assert (result.knobs.get("amp") == "bf16") is picked
    note = next(e for e in result.explain if e["knob"] == "amp")
    if bf16_slope > 50:
        assert "measured slower" in note["why"]
    elif not allowed:
        assert "--allow-precision" in note["why"]


def test_micro_batches_meet_a_budget_no_recomputation_can(tmp_path):
    from dpro.optimize import optimize

    ctx = context(load_run(probed_run(tmp_path, 100.0)))
    budget = predict(ctx, {"micro_batches": 2}).predicted_peak_memory_bytes
    result = optimize(ctx, memory_budget_bytes=budget)
    # the two layers are leaves: checkpointing one frees nothing, so only micro-batches fit the budget
    assert result.knobs.get("micro_batches") == 2 and "recompute" not in result.knobs
    assert result.predicted.predicted_peak_memory_bytes <= budget
    note = next(e for e in result.explain if e["knob"] == "micro_batches")
    assert "where nothing else fit" in note["why"] and "plain training loop" in note["why"]
    assert optimize(ctx).knobs.get("micro_batches") is None  # no budget: nothing to trade the step for


def test_the_report_shows_the_probed_choices(run_with_probes):
    from dpro.report.collect import collect_run
    from dpro.report.html import render_report

    data = collect_run(run_with_probes, recommend=False, quiet=True)
    choices = [m.get("choice") for m in data.memory]
    assert {"micro_batches=2", "micro_batches=4", "amp=bf16"} <= set(choices)
    assert "amp=fp16" not in choices  # not probed: left off
    assert "micro_batches=2" in render_report(data)


def test_reader_bounds_what_it_reads(tmp_path, monkeypatch):
    (tmp_path / "probes").mkdir()
    doc = probe_doc(0, {(None, 16): {f"FW.m{i}": 1.0 for i in range(100_000)}})
    (tmp_path / "probes" / "rank-0.json").write_text(json.dumps(doc))
    monkeypatch.setenv("DPRO_MAX_FILE_MB", "1")
    with pytest.raises(TraceError, match="larger than 1 MB"):
        read_probes(tmp_path)
    monkeypatch.delenv("DPRO_MAX_FILE_MB")
    assert len(read_probes(tmp_path)[0].probes[0].ops) == 100_000


def test_a_linked_probes_folder_is_not_read(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_probes(elsewhere, [probe_doc(0, {(None, 16): linear(0, 1, 16)})])
    run = tmp_path / "run"
    run.mkdir()
    (run / "probes").symlink_to(elsewhere / "probes")
    assert read_probes(run) == {} and read_probes(elsewhere)[0].batch == 16


def test_a_whatif_says_why_the_probes_were_skipped(tmp_path):
    run = make_run(tmp_path / "run")
    write_probes(run, [{"schema": "dpro.probes/1", "rank": r, "batch": None, "probes": [],
                        "skipped": [{"probe": "all", "why": "no forward of the model was seen"}]} for r in (0, 1)])
    with pytest.raises(UsageError, match="were skipped: no forward of the model was seen"):
        predict(context(load_run(run)), {"micro_batches": 2})


# ---- compile -------------------------------------------------------------------------------------------------


def compile_entry(region: str, compiled: tuple[float, float], eager: tuple[float, float]) -> dict:
    """A compile probe as the torch recorder writes it: the region's forward and backward, compiled and eager."""
    return {"amp": None, "batch": 16, "passes": 15, "compile": region, "pass_us": sum(compiled),
            "activation_bytes": 0, "ops": {"FW": compiled[0], "BW": compiled[1]},
            "eager": {"FW": eager[0], "BW": eager[1]}}


def compiled_run(tmp_path: Path, *entries: dict) -> Path:
    run = make_run(tmp_path / "run")
    docs = [probe_doc(r, {(None, 16): linear(0, 50, 16)}) for r in (0, 1)]
    for doc in docs:
        doc["probes"] += list(entries)
    write_probes(run, docs)
    return run


def test_compile_scales_the_regions_forward_and_backward_by_their_measured_ratios(tmp_path):
    ctx = context(load_run(compiled_run(tmp_path, compile_entry("<root>", (50.0, 150.0), (100.0, 200.0)),
                                        compile_entry("fc1", (10.0, 10.0), (100.0, 100.0)))))
    base = {op.name: op for op in ctx.base.ops[0]}
    whole = {op.name: op for op in with_compile(ctx.base, ctx.probes, ["<root>"]).ops[0]}
    assert whole["FW.fc1"].duration == pytest.approx(base["FW.fc1"].duration * 0.5)
    assert whole["BW.fc2"].duration == pytest.approx(base["BW.fc2"].duration * 0.75)
    for name in ("COMM.bucket0.allreduce", "UPDATE.sgd"):  # communication and the optimizer: as recorded
        assert whole[name].duration == base[name].duration
    one = {op.name: op for op in with_compile(ctx.base, ctx.probes, ["fc1"]).ops[0]}
    assert one["FW.fc1"].duration == pytest.approx(base["FW.fc1"].duration * 0.1)
    assert one["FW.fc2"].duration == base["FW.fc2"].duration and one["BW.fc2"].duration == base["BW.fc2"].duration
    recorded, faster = predict(ctx, {}), predict(ctx, {"compile": ["<root>"]})
    assert faster.predicted_step_ms < recorded.predicted_step_ms - 1.0  # 3 ms of the 6 ms FW/BW saved, at least


def test_compile_scales_the_gaps_inside_a_region_only(tmp_path):
    ctx = context(load_run(compiled_run(tmp_path, compile_entry("<root>", (50.0, 100.0), (100.0, 100.0)))))
    for op in ctx.base.ops[0]:
        op.gap = 100.0 if op.category in ("FW", "BW") else op.gap
    gaps = {op.name: op.gap for op in with_compile(ctx.base, ctx.probes, ["<root>"]).ops[0]}
    assert gaps["FW.fc2"] == pytest.approx(50.0)  # between two modules of the region: the region's own code
    assert gaps["FW.fc1"] == 100.0  # before the pass: the loop's own work


def test_a_run_with_only_compile_probes_prices_compile_and_refuses_the_others(tmp_path):
    """The MXNet recorder's probe file: compile probes alone (no pass of the whole model at the recorded batch)."""
    run = make_run(tmp_path / "run")
    write_probes(run, [{"schema": "dpro.probes/1", "rank": r, "batch": 16, "skipped": [],
                        "probes": [compile_entry("<root>", (50.0, 150.0), (100.0, 200.0))]} for r in (0, 1)])
    ctx = context(load_run(run))
    base = {op.name: op for op in ctx.base.ops[0]}
    compiled = {op.name: op for op in transformed_model(ctx, {"compile": ["<root>"]}).ops[0]}
    for name in OPS:  # every forward and backward op of the model: there is no reference probe to narrow them
        ratio = 0.5 if name.startswith("FW") else 0.75
        assert compiled[name].duration == pytest.approx(base[name].duration * ratio)
    assert predict(ctx, {"compile": ["<root>"]}).predicted_step_ms < predict(ctx, {}).predicted_step_ms
    with pytest.raises(UsageError, match=r"amp=bf16: this run.s probe passes hold no pass of the batch as recorded"):
        predict(ctx, {"amp": "bf16"})


def test_an_unprobed_region_names_what_was_probed(tmp_path):
    ctx = context(load_run(compiled_run(tmp_path, compile_entry("<root>", (50.0, 150.0), (100.0, 200.0)))))
    with pytest.raises(UsageError, match=r"compile=fc2: the probes timed compiled only <root>.*DPRO_PROBE_COMPILE"):
        predict(ctx, {"compile": ["fc2"]})
    with pytest.raises(UsageError, match="does not price them together with amp or micro_batches"):
        predict(ctx, {"compile": ["<root>"], "micro_batches": 2})
    bare = context(load_run(make_run(tmp_path / "bare")))
    with pytest.raises(UsageError, match=r"compile=<root>: no compile probe prices it \(the run has none"):
        predict(bare, {"compile": ["<root>"]})


def test_a_skipped_compile_probe_says_why(tmp_path):
    run = compiled_run(tmp_path)
    for r in (0, 1):
        path = run / "probes" / f"rank-{r}.json"
        doc = json.loads(path.read_text())
        doc["skipped"] = [{"probe": "compile <root>", "why": "BackendCompilerFailed: no C++ compiler"}]
        path.write_text(json.dumps(doc))
    with pytest.raises(UsageError, match="it was skipped: BackendCompilerFailed: no C\\+\\+ compiler"):
        predict(context(load_run(run)), {"compile": ["<root>"]})


def test_compile_knob_parses_paths_and_refuses_nested_ones():
    assert parse_settings(["compile=fc1,fc2"]) == {"compile": ["fc1", "fc2"]}
    assert parse_settings(["compile=<root>"]) == {"compile": ["<root>"]}
    assert parse_settings(["compile=none"]) == {"compile": []}
    with pytest.raises(UsageError, match="'encoder.0' lies inside 'encoder'"):
        parse_settings(["compile=encoder,encoder.0"])
    with pytest.raises(UsageError, match="lies inside '<root>'"):
        parse_settings(["compile=<root>,fc1"])


def test_compile_probes_read_back_and_stay_apart_from_the_others(tmp_path):
    probe = Probe(None, 16, 5, {"FW": 1.0, "BW": 2.0}, 3.0, 0, compile="fc1", eager={"FW": 2.0, "BW": 2.0})
    run = compiled_run(tmp_path, probe.to_json())
    rank = read_probes(run)[0]
    assert rank.compiled("fc1") == probe and rank.compiled_regions == ["fc1"]
    assert rank.find(None, 16).compile is None  # the reference probe, not the compile probe of the same batch
    assert compile_ratios(probe) == {"FW": 0.5, "BW": 1.0}
    bad = {**probe.to_json(), "eager": [1, 2]}
    (run / "probes" / "rank-0.json").write_text(json.dumps({**probe_doc(0, {}), "probes": [bad]}))
    with pytest.raises(TraceError, match="eager must be an object"):
        read_probes(run)


@pytest.mark.parametrize(("compiled_us", "picked"), [
    ((20.0, 40.0), True),     # the whole model measured 5x faster compiled
    ((150.0, 300.0), False),  # measured slower compiled: never
])
def test_optimize_compiles_only_what_measured_faster(tmp_path, compiled_us, picked):
    from dpro.optimize import optimize

    ctx = context(load_run(compiled_run(tmp_path, compile_entry("<root>", compiled_us, (100.0, 200.0)))))
    result = optimize(ctx)
    assert (result.knobs.get("compile") == ["<root>"]) is picked
    note = next(e for e in result.explain if e["knob"] == "compile")
    assert ("priced by the compile probe" if picked else "measured slower compiled") in note["why"]


def test_a_compile_probe_alone_prices_compile_and_says_why_amp_is_not(tmp_path):
    """The TensorFlow recorder's probe file: one compile probe of <root>, no pass of the batch as recorded."""
    run = make_run(tmp_path / "run")
    write_probes(run, [{"schema": "dpro.probes/1", "rank": r, "batch": 16,
                        "probes": [compile_entry("<root>", (50.0, 150.0), (100.0, 200.0))], "skipped": []}
                       for r in (0, 1)])
    ctx = context(load_run(run))
    base = {op.name: op for op in ctx.base.ops[0]}
    whole = {op.name: op for op in with_compile(ctx.base, ctx.probes, ["<root>"]).ops[0]}
    assert whole["FW.fc1"].duration == pytest.approx(base["FW.fc1"].duration * 0.5)  # every FW/BW op: the model's
    assert whole["BW.fc2"].duration == pytest.approx(base["BW.fc2"].duration * 0.75)
    assert whole["UPDATE.sgd"].duration == base["UPDATE.sgd"].duration
    assert predict(ctx, {"compile": ["<root>"]}).predicted_step_ms < predict(ctx, {}).predicted_step_ms
    with pytest.raises(UsageError, match="amp=bf16: this run's probe passes hold no pass of the batch as recorded"):
        predict(ctx, {"amp": "bf16"})
