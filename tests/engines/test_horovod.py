"""Horovod: timeline parsing and merging (hand-written), the Horovod fusion search, and real
``horovodrun -np 2 -H localhost:2 --gloo`` jobs recorded by ``record_horovod``."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobrunner import JOBS, job_env, run_job
from run_builder import (
    BYTES,
    OFFSET,
    SHAPES,
    horovod_timeline_events,
    horovod_timeline_text,
    make_horovod_run,
    make_run,
)

from dpro.engines import load_prepared, prepared
from dpro.engines.horovod.search import (
    HVD_CYCLES_MS,
    HVD_THRESHOLDS_MB,
    _units,
    horovod_comm_model,
    horovod_cycles,
    horovod_fusion,
    horovod_loop,
    knobs_in_force,
    recorded_launches,
    simulate_loop,
)
from dpro.engines.horovod.timeline import (
    TIMELINE_FILE,
    fused_groups,
    merge_horovod_timeline,
    parse_timeline_text,
    read_timeline,
    tensor_ops,
)
from dpro.errors import TraceError
from dpro.io.load import load_run
from dpro.optimize import optimize
from dpro.record.protocol import PROBE_BYTES, PROBE_MOST, PROBE_REPEAT
from dpro.sim.whatif import context

HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None
needs_horovod = pytest.mark.skipif(
    not HAVE_HOROVOD, reason="horovod is not installed in this venv (make horovod / scripts/build_horovod.sh)")

def test_timeline_phases_and_fused_groups() -> None:
    events, truncated = parse_timeline_text(horovod_timeline_text(horovod_timeline_events([3])))
    assert not truncated
    ops, start_epoch, incomplete, _ = tensor_ops(events)
    assert start_epoch == 1_700_000_000_000_000 and incomplete == 0
    allreduce = [o for o in ops if o.op == "ALLREDUCE"]
    assert [o.tensor for o in allreduce] == [f"allreduce.{n}" for n in SHAPES]
    assert {o.key for o in allreduce} == set(SHAPES)
    assert [o.nbytes for o in allreduce] == [BYTES[n] for n in SHAPES]
    first = allreduce[0]
    assert first.negotiate is not None and first.negotiate[1] - first.negotiate[0] == 80
    assert first.activity_us == {"MEMCPY_IN_FUSION_BUFFER": 80, "GLOO_ALLREDUCE": 1100, "MEMCPY_OUT_FUSION_BUFFER": 90}
    groups = [g for g in fused_groups(ops) if g.op == "ALLREDUCE"]
    assert [g.tensors for g in groups] == [["allreduce.fc2.bias", "allreduce.fc2.weight"],
                                           ["allreduce.fc1.bias", "allreduce.fc1.weight"]]
    phases = groups[0].phases()
    assert phases["allreduce_us"] == 1100 and phases["memcpy_in_us"] == 80 and phases["memcpy_out_us"] == 90
    assert phases["negotiate_us"] == 79 and phases["queue_us"] == 10
    assert groups[0].nbytes == 16 + 4080


@pytest.mark.parametrize("cut", ["no-bracket", "trailing-comma", "mid-event"])
def test_truncated_timeline_is_read_up_to_the_cut(cut: str, tmp_path: Path) -> None:
    text = horovod_timeline_text(horovod_timeline_events([3, 4]))
    body = text[:-1]  # without the closing ']'
    cuts = {"no-bracket": body, "trailing-comma": body + ",\n",
            "mid-event": body[: body.rindex('{"ph": "E"') + 15]}
    path = tmp_path / TIMELINE_FILE
    path.write_text(cuts[cut])
    timeline = read_timeline(path)
    assert timeline.truncated
    complete = [o for o in timeline.ops if o.op == "ALLREDUCE"]
    assert len(complete) == (8 if cut != "mid-event" else 7)
    assert timeline.incomplete == (0 if cut != "mid-event" else 1)


def test_broken_timeline_is_refused_with_the_file(tmp_path: Path) -> None:
    lines = horovod_timeline_text(horovod_timeline_events([3])).split("\n")
    lines[5] = lines[5][:10]  # corruption in the middle, complete events after it
    path = tmp_path / TIMELINE_FILE
    path.write_text("\n".join(lines))
    with pytest.raises(TraceError, match="broken event in the middle"):
        read_timeline(path)
    path.write_text("")
    with pytest.raises(TraceError, match="empty"):
        read_timeline(path)


def test_load_run_only_reads_and_prepared_merges_the_timeline_once(tmp_path: Path) -> None:
    """Reading is io's (``load_run``); the engine's merge is a step of its own (``dpro.engines.prepared``), which a
    second call leaves as it was."""
    run = load_run(make_horovod_run(tmp_path / "run", horovod_timeline_text(horovod_timeline_events([3, 4]))))
    assert not run.engine_prepared and "merged" not in (run.meta.get("horovod") or {})
    assert not any("buffer" in e["args"] for e in run.ranks[0].events if e["cat"] == "COMM")
    assert prepared(run) is run and run.engine_prepared
    merged = [(e["ts"], e["dur"], e["args"]["buffer"]) for e in run.ranks[0].events if e["cat"] == "COMM"]
    problems, summary = list(run.problems), dict(run.meta["horovod"]["merged"])
    prepared(run)
    assert [(e["ts"], e["dur"], e["args"]["buffer"]) for e in run.ranks[0].events if e["cat"] == "COMM"] == merged
    assert run.problems == problems and run.meta["horovod"]["merged"] == summary


def test_load_prepared_merges_the_timeline_into_fused_comm_events(tmp_path: Path) -> None:
    run = load_prepared(make_horovod_run(tmp_path / "run", horovod_timeline_text(horovod_timeline_events([3, 4]))))
    assert run.problems == []
    merged = run.meta["horovod"]["merged"]
    assert merged["fused_groups"] == 5 and merged["steps"] == [3, 4]  # 4 fused allreduces + the broadcast
    assert merged["offset_us"] == pytest.approx(OFFSET + 100)  # completions seen 100 µs after the ends
    assert [b["tensors"] for b in merged["buffers"] if b["step"] == 3] == [["fc2.bias", "fc2.weight"],
                                                                          ["fc1.bias", "fc1.weight"]]
    for rank in (0, 1):
        comm = [e for e in run.ranks[rank].events if e["cat"] == "COMM"]
        # one event per launched tensor, named as launched whatever the fusion
        assert sorted({e["name"] for e in comm}) == sorted(f"COMM.{n}.allreduce" for n in BYTES)
        for step in (3, 4):
            this = sorted((e for e in comm if e["args"]["step"] == step), key=lambda e: e["ts"])
            assert [e["args"]["buffer"] for e in this] == [0, 0, 1, 1]
            assert [e["args"]["buffer_tensors"] for e in this[::2]] == [["fc2.bias", "fc2.weight"],
                                                                       ["fc1.bias", "fc1.weight"]]
            assert sum(e["args"]["bytes"] for e in this) == sum(BYTES.values())
            assert this[0]["args"]["buffer_bytes"] == BYTES["fc2.bias"] + BYTES["fc2.weight"]
            assert this[0]["args"]["allreduce_us"] == 1100 and this[0]["args"]["fused"] == 2
            t0 = 1_000_000.0 + step * 10_000 + rank * 50
            assert [e["ts"] for e in this] == [t0 + 4100, t0 + 4110, t0 + 6100, t0 + 6110]  # each launch
            # tensors of one buffer complete together, when the buffer does (here: as rank 0 saw it)
            ends = [e["ts"] + e["dur"] for e in this[:2]]
            assert ends == pytest.approx([1_000_000.0 + step * 10_000 + 5600] * 2)


def test_truncated_timeline_merges_and_says_so(tmp_path: Path) -> None:
    text = horovod_timeline_text(horovod_timeline_events([3, 4]))[:-1]
    run = load_prepared(make_horovod_run(tmp_path / "run", text))
    assert any("cut off" in p for p in run.problems)
    assert all("buffer" in e["args"] for e in run.ranks[0].events if e["cat"] == "COMM")


def test_unreadable_timeline_keeps_the_per_tensor_events(tmp_path: Path) -> None:
    run = load_prepared(make_horovod_run(tmp_path / "run", "{not a timeline"))
    assert any("not a Horovod timeline" in p for p in run.problems)
    assert any(e["name"] == "COMM.fc2.bias.allreduce" for e in run.ranks[0].events)
    assert merge_horovod_timeline(load_prepared(make_run(tmp_path / "plain"))) is None  # no timeline: nothing to do


# ---- fusion that differs from step to step (hand-written) ------------------------------------------

A, B, C, D = "fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"
LAUNCH = {A: 4100, B: 4110, C: 6100, D: 6110}     # µs into the step; rank 1 launches 50 µs later (its step does)
FIRST, SECOND = 4170, 6170                          # where Horovod starts a buffer (after both ranks launched)
OPERATION = 1380                                    # each buffer's ALLREDUCE phase
# steps 3 and 5: two buffers; 4 and 6: one buffer; 7: the first tensor alone, then the rest
FUSIONS = {3: [([A, B], FIRST), ([C, D], SECOND)], 4: [([A, B, C, D], SECOND)],
           5: [([A, B], FIRST), ([C, D], SECOND)], 6: [([A, B, C, D], SECOND)],
           7: [([A], FIRST), ([B, C, D], SECOND)]}


def _fusion_timeline(fusions: dict[int, list[tuple[list[str], int]]]) -> str:
    pids = {name: i + 1 for i, name in enumerate(SHAPES)}
    ev: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"allreduce.{n}"}}
                                for n, pid in pids.items()]
    for step, groups in fusions.items():
        t0 = 1_000_000.0 + step * 10_000 - OFFSET
        for names, at in groups:
            p = [pids[n] for n in names]
            ev += [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": t0 + LAUNCH[n], "pid": pids[n]} for n in names]
            ev += [{"ph": "E", "ts": t0 + at - 10, "pid": pid} for pid in p]
            ev += [{"ph": "B", "name": "ALLREDUCE", "ts": t0 + at, "pid": pid} for pid in p]
            ev += [{"ph": "B", "name": "GLOO_ALLREDUCE", "ts": t0 + at + 10, "pid": pid} for pid in p]
            ev += [{"ph": "E", "ts": t0 + at + OPERATION - 10, "pid": pid} for pid in p]
            ev += [{"ph": "E", "ts": t0 + at + OPERATION, "pid": pid, "args": {"dtype": "float32", "shape": SHAPES[n]}}
                   for pid, n in zip(p, names, strict=True)]
    return horovod_timeline_text(ev)


def _fusion_comm_events(rank: int, step: int, groups: list[tuple[list[str], int]]) -> list[dict[str, Any]]:
    """What record_horovod writes: each tensor from its launch to the completion its next poll saw. Rank 0
    polls at once (10 µs after the buffer ends); rank 1 sees an early buffer only at its next launch."""
    t0 = 1_000_000.0 + step * 10_000 + rank * 50
    out = []
    for k, (names, at) in enumerate(groups):
        end = 1_000_000.0 + step * 10_000 + at + OPERATION        # rank 0's clock = rank 1's (one host)
        seen = end + 10 if rank == 0 or k == len(groups) - 1 else max(end, t0 + LAUNCH[C]) + 5
        for n in names:
            out.append({"name": f"COMM.{n}.allreduce", "cat": "COMM", "ph": "X", "ts": t0 + LAUNCH[n],
                        "dur": seen - t0 - LAUNCH[n], "pid": rank, "tid": 1,
                        "args": {"step": step, "bytes": BYTES[n], "tensors": [n], "op": "allreduce",
                                 "phase": "allreduce", "hvd_name": n}})
    return out


def _fusion_run(root: Path, fusions: dict[int, list[tuple[list[str], int]]] = FUSIONS) -> Path:
    root = make_horovod_run(root, _fusion_timeline(fusions), steps=tuple(fusions))
    for rank in (0, 1):
        path = root / f"rank-{rank}.json"
        doc = json.loads(path.read_text())
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "COMM"]
        for e in doc["traceEvents"]:
            if e.get("cat") == "BW":  # the gradients each backward op produces (as the recorder writes them)
                e["args"]["grads"] = [A, B] if e["name"] == "BW.fc2" else [C, D]
        doc["traceEvents"] += [e for s, groups in fusions.items() for e in _fusion_comm_events(rank, s, groups)]
        path.write_text(json.dumps(doc))
    return root


def test_every_step_is_kept_when_fusion_differs_and_tensors_end_with_their_buffer(tmp_path: Path) -> None:
    run = load_prepared(_fusion_run(tmp_path / "run"))
    merged = run.meta["horovod"]["merged"]
    assert merged["steps"] == [3, 4, 5, 6, 7] and merged["distinct_fusions"] == 3
    assert run.ranks[0].steps == run.ranks[1].steps == [3, 4, 5, 6, 7]  # none left out
    assert not any("leaves out" in p for p in run.problems)
    for rank in (0, 1):
        ends = {(e["args"]["step"], e["name"]): e["ts"] + e["dur"]
                for e in run.ranks[rank].events if e["cat"] == "COMM"}
        for step, groups in FUSIONS.items():
            for names, at in groups:
                end = 1_000_000.0 + step * 10_000 + at + OPERATION
                for n in names:  # rank 1's late poll (its next launch) is not the end: the buffer's end is
                    assert ends[(step, f"COMM.{n}.allreduce")] == pytest.approx(end, abs=11), (rank, step, n)


def test_a_median_step_of_steps_fused_differently_replays_to_the_measured_step(tmp_path: Path) -> None:
    from dpro.analyze import analyze_run, predicted_step_us
    from dpro.dag.align import align
    from dpro.dag.step_model import step_model
    from dpro.dag.wiring import graph_from_steps
    from dpro.sim.replay import plan_levels, replay

    run = load_prepared(_fusion_run(tmp_path / "run"))
    analysis = analyze_run(run).analysis
    assert analysis.measured_step_ms == pytest.approx(9.0)
    assert analysis.predicted_step_ms == pytest.approx(9.0, abs=0.1)
    # the median of each tensor's own transfer is a mixture (its whole buffer, or nothing when it rode in the
    # buffer before it): fc2.weight's is 0 in 4 steps of 5, so that chain ends 1.4 ms early
    per_step = step_model(run, align(run), transfers="per-step")
    g = graph_from_steps(per_step, 4)
    replayed = max(predicted_step_us(g, replay(g, plan_levels(g))).values()) / 1000.0
    assert replayed < 8.0


# ---- the fusion search ---------------------------------------------------------------------------


def test_horovod_cycles_fuse_what_is_ready_per_cycle() -> None:
    units = [(["a"], 100, 10.0), (["b"], 100, 20.0), (["c"], 300, 1510.0), (["d"], 50, 1600.0)]
    cost = lambda nbytes: nbytes / 10.0  # noqa: E731
    buffers = horovod_cycles(units, threshold=1000, cycle_us=1000.0, phase_us=500.0, cost_us=cost, coordinate_us=5.0)
    assert [b[0] for b in buffers] == [["a", "b"], ["c", "d"]]
    assert buffers[0][2] == 505.0 and buffers[0][3] == 525.0
    assert buffers[1][2] == 2505.0  # c and d are both ready at the cycle at 2500
    small = horovod_cycles(units, threshold=150, cycle_us=1000.0, phase_us=500.0, cost_us=cost, coordinate_us=5.0)
    assert [b[0] for b in small] == [["a"], ["b"], ["c"], ["d"]]
    assert small[1][2] == small[0][3]  # buffers of one cycle run back to back


def test_horovod_cycles_price_the_cycle_fusion_and_the_cache() -> None:
    units = [(["a"], 100, 10.0), (["b"], 100, 20.0), (["c"], 300, 1510.0), (["d"], 50, 1600.0)]
    cost = lambda nbytes: nbytes / 10.0  # noqa: E731
    # threshold 0: no fusion, each tensor its own allreduce; the buffers of one cycle run gap_us apart
    none = horovod_cycles(units, 0, 1000.0, 500.0, cost, 5.0, buffer_gap_us=7.0)
    assert [b[0] for b in none] == [["a"], ["b"], ["c"], ["d"]]
    assert none[1][2] == none[0][3] + 7.0
    # a long cycle fuses everything into one buffer (with the copies), but starts it late
    long = horovod_cycles(units, 2**20, 25_000.0, 12_500.0, cost, 5.0, 0.01)
    assert [b[0] for b in long] == [["a", "b", "c", "d"]] and long[0][2] == 12_505.0
    assert long[0][3] == 12_505.0 + 55.0 + 0.01 * 550
    short = horovod_cycles(units, 2**20, 500.0, 250.0, cost, 5.0, 0.01)
    assert [b[0] for b in short] == [["a", "b"], ["c", "d"]] and short[-1][3] < long[0][3]
    # a tensor the response cache does not hold adds a negotiation to its cycle
    cached = horovod_cycles(units, 2**20, 1000.0, 500.0, cost, 5.0)
    uncached = horovod_cycles(units, 2**20, 1000.0, 500.0, cost, 5.0, negotiate_us=300.0,
                              uncached=frozenset({"d"}))
    assert uncached[0][2] == cached[0][2] and uncached[1][2] == cached[1][2] + 300.0


def test_the_loop_runs_on_from_step_to_step_so_a_long_cycle_quantises_the_step() -> None:
    from dpro.engines.horovod.search import HorovodLoop, horovod_steps
    from dpro.sim.cost import CommModel

    one_ms = CommModel(latency_us=500.0, us_per_byte=0.0, world_size=2)   # 1 ms per allreduce
    loop = HorovodLoop(one_ms, 0.0, wake_us=0.0, buffer_gap_us=0.0, negotiate_us=0.0)
    step = [(["g"], 1000, 30_000.0)]   # the gradient is launched 30 ms after the last allreduce ended
    steps = horovod_steps([step] * 4, 2**20, 25_000.0, loop)
    # the 1 ms allreduce does not run over the 25 ms cycle, so the cycles stay on their grid: the gradient
    # waits for the second cycle after the previous allreduce, every step lasts two cycles (not 31 ms + half
    # a cycle on average, as a loop unaligned with the steps would give)
    assert [round(t) for t, _ in steps[1:]] == [50_000] * 3
    # rank 1's loop 10 ms behind rank 0's: the gradient must be queued by rank 0's cycle (39 ms after the previous
    # allreduce ended) and the allreduce starts with rank 1's, 10 ms later
    lagged = horovod_steps([step] * 4, 2**20, 25_000.0, loop, lag_us=10_000.0)
    assert [round(t) for t, _ in lagged[1:]] == [50_000] * 3 and lagged[-1][1][0][2] == pytest.approx(49_000.0)
    # an allreduce longer than the cycle restarts the loop when it ends: two cycles plus the work
    thirty_ms = CommModel(latency_us=15_000.0, us_per_byte=0.0, world_size=2)
    long = horovod_steps([step] * 4, 2**20, 25_000.0, HorovodLoop(thirty_ms, 0.0, 0.0, 0.0, 0.0))
    assert [round(t) for t, _ in long[1:]] == [80_000] * 3


def test_allreduces_that_overlap_more_of_the_backward_slow_it_by_the_measured_slowdown() -> None:
    from dpro.engines.horovod.search import HorovodLoop, interfered_loop, simulate_loop
    from dpro.sim.cost import CommModel

    five_ms = HorovodLoop(CommModel(latency_us=2_500.0, us_per_byte=0.0, world_size=2), 0.0, 0.0, 0.0, 0.0)
    # four gradients launched 10 ms apart through the backward pass, in every step
    steps = [[([g], 2**20, 10_000.0 * (k + 1)) for k, g in enumerate("abcd")]] * 4
    # (a 2-rank allreduce: two latencies, 5 ms) recorded: fused buffers after the backward (a long cycle): nothing
    # overlapped it
    recorded = simulate_loop(five_ms, steps, 2**30, 50.0, frozenset())
    assert min(b[2] for b in recorded.buffers) >= 40_000.0
    # no fusion, a short cycle: three 5 ms allreduces run inside the backward before the last gradient
    free = simulate_loop(five_ms, steps, 0, 1.0, frozenset())
    slowed = interfered_loop(five_ms, steps, 0, 1.0, frozenset(), 0.5, recorded)
    # the last gradient comes 0.5 x 15 ms / (1 + 0.5 x 15 / 40) later; the allreduce after it follows it
    assert slowed.step_us - free.step_us == pytest.approx(0.5 * 15_000 / (1 + 0.5 * 15 / 40), abs=1_000.0)
    # however slow overlapped compute is measured to be, no launch moves before the step began
    fast = interfered_loop(five_ms, steps, 2**30, 50.0, frozenset(), 3.0, free)
    assert fast.step_us > 0 and all(b[1] > 0 for b in fast.buffers)
    # no slowdown, or the recorded setting itself: the plain simulation
    assert interfered_loop(five_ms, steps, 0, 1.0, frozenset(), 0.0, recorded).step_us == free.step_us
    assert interfered_loop(five_ms, steps, 2**30, 50.0, frozenset(), 0.5, recorded).step_us == recorded.step_us


def test_the_loop_is_calibrated_from_the_timeline_buffers(tmp_path: Path) -> None:
    from dpro.engines.horovod.search import horovod_loop

    run = load_prepared(_fusion_run(tmp_path / "run"))
    ctx = context(run)
    loop = horovod_loop(ctx)
    # every buffer of the hand-written timeline starts 20 µs after the last launch of its tensors (rank 1's):
    # less than the recorded 5 ms cycle alone makes the loop model wait, so no wake time is left (and no two
    # buffers were agreed on in one cycle: no gap between buffers was measured)
    assert loop.wake_us == 0.0 and loop.buffer_gap_us == 0.0
    assert "timeline" in loop.source
    assert loop.comm.allreduce_us(4096) > 0


def test_horovod_fusion_picks_a_setting_and_optimize_writes_env_knobs(tmp_path: Path) -> None:
    run = load_prepared(make_horovod_run(tmp_path / "run", horovod_timeline_text(horovod_timeline_events([3, 4]))))
    ctx = context(run)
    results = horovod_fusion(ctx)
    # autotune's space: thresholds 0 (no fusion) .. 256 MB, cycles up to 50 ms; and the setting in force (48 MB)
    assert len(results) == len(HVD_THRESHOLDS_MB) * len(HVD_CYCLES_MS) + 1
    assert HVD_THRESHOLDS_MB[0] == 0 and HVD_THRESHOLDS_MB[-1] == 256 and max(HVD_CYCLES_MS) >= 25
    in_force = [r for r in results if r["in_force"]]
    assert len(in_force) == 1 and in_force[0]["threshold_bytes"] == 48 * 2**20
    best = results[0]
    assert best["predicted_step_ms"] == min(r["predicted_step_ms"] for r in results)
    assert best["threshold_bytes"] in {mb * 2**20 for mb in HVD_THRESHOLDS_MB}
    assert sorted(n for b in best["buffers"] for n in b) == sorted(BYTES)
    assert sorted(n for g in best["tensor_groups"] for n in g) == sorted(BYTES)
    result = optimize(ctx)
    env = result.knobs["env"]
    assert {"HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME"} <= set(env) <= {
        "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY"}
    assert int(env["HOROVOD_FUSION_THRESHOLD"]) >= 0 and float(env["HOROVOD_CYCLE_TIME"]) > 0
    assert "torch.ddp.bucket_cap_mb" not in result.knobs
    why = {e["knob"]: e["why"] for e in result.explain}
    assert "not applicable" in why["horovod.hierarchical"]  # both ranks on one host
    assert "response cache" in why["horovod.cache_capacity"]
    # 5 ms cycles on a 10 ms step: a shorter cycle must be predicted faster
    assert float(env["HOROVOD_CYCLE_TIME"]) < 5.0
    assert result.predicted.predicted_step_ms < result.baseline.predicted_step_ms


# ---- real Horovod jobs ---------------------------------------------------------------------------


def horovodrun(*args: str, env: dict[str, str] | None = None, timeout: float = 240, check: bool = True):
    launcher = Path(sys.executable).with_name("horovodrun")
    return run_job([str(launcher), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                    str(JOBS / "hvd_job.py"), *args], env=env or job_env(), timeout=timeout, check=check)


@pytest.fixture(scope="module")
def hvd_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not HAVE_HOROVOD:
        pytest.skip("horovod is not installed in this venv (make horovod / scripts/build_horovod.sh)")
    root = tmp_path_factory.mktemp("hvd") / "run"
    root.mkdir()
    horovodrun("--model", "mlp", "--steps", "14", "--profile", "4:12", "--run-dir", str(root),
               env=job_env(HOROVOD_TIMELINE=str(root / TIMELINE_FILE)))
    return root


@pytest.mark.slow
@needs_horovod
def test_horovod_job_is_recorded(hvd_run: Path) -> None:
    meta = json.loads((hvd_run / "run.json").read_text())
    assert meta["engine"] == "horovod" and meta["world_size"] == 2
    assert meta["knobs"]["HOROVOD_FUSION_THRESHOLD"] == 128 * 2**20 and meta["knobs"]["HOROVOD_CYCLE_TIME"] == 1.0
    assert meta["horovod"]["timeline"].endswith(TIMELINE_FILE)
    model = json.loads((hvd_run / "model.json").read_text())
    grad_bytes = model["param_bytes"]
    for rank in (0, 1):
        doc = json.loads((hvd_run / f"rank-{rank}.json").read_text())
        assert doc["steps"] == list(range(4, 12))
        events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
        for step in range(4, 12):
            comm = [e for e in events if e["cat"] == "COMM" and e["args"]["step"] == step]
            assert len(comm) == len(model["gradients"])
            assert all(e["name"] == f"COMM.{e['args']['tensors'][0]}.allreduce" for e in comm)
            assert sum(e["args"]["bytes"] for e in comm) == grad_bytes
            updates = [e for e in events if e["cat"] == "UPDATE" and e["args"]["step"] == step]
            assert len(updates) == 1  # torch's step hooks fire twice under Horovod; recorded once
            assert any(e["cat"] == "BW" for e in events if e["args"]["step"] == step)


@pytest.mark.slow
@needs_horovod
def test_horovod_timeline_is_merged(hvd_run: Path) -> None:
    run = load_prepared(hvd_run)
    merged = run.meta["horovod"]["merged"]
    assert merged["offset_us"] is not None and merged["clock"].startswith("wall clock")
    sizes = len(PROBE_BYTES)  # each size 5 to 25 times (allreduce_probe)
    assert sizes * PROBE_REPEAT <= merged["probe_samples"] <= sizes * PROBE_MOST
    grad_bytes = run.model["param_bytes"]
    names = {g["name"] for g in run.model["gradients"]}
    recorded = run.ranks[0].steps
    # every step is kept, whatever its fusion. Horovod writes its timeline from a thread of its own, and once in a
    # fresh-clone run the file ended 3 steps before the window did: such a tail is missing, and said to be
    merged_steps = merged["steps"]
    assert merged_steps == recorded[:len(merged_steps)] and len(merged_steps) >= len(recorded) // 2, (
        merged_steps, recorded, run.problems)
    if merged_steps != recorded:
        assert any("have no operation in the Horovod timeline" in p for p in run.problems), run.problems
    for rank in (0, 1):
        for step in merged["steps"]:
            comm = [e for e in run.ranks[rank].events if e["cat"] == "COMM" and e["args"]["step"] == step]
            assert sum(e["args"]["bytes"] for e in comm) == grad_bytes
            assert sorted(n for e in comm for n in e["args"]["tensors"]) == sorted(names)
            assert all("allreduce_us" in e["args"] and "negotiate_us" in e["args"] for e in comm)
            buffers = {e["args"]["buffer"]: e["args"]["buffer_tensors"] for e in comm}
            assert sorted(n for b in buffers.values() for n in b) == sorted(names)  # a partition of the step
            if rank == 0:  # the tensors of one buffer end together (the timeline's end of the buffer; a poll
                for k in buffers:  # may see it a few µs before the placed end)
                    ends = [e["ts"] + e["dur"] for e in comm if e["args"]["buffer"] == k]
                    assert max(ends) - min(ends) < 100.0


@pytest.mark.slow
@needs_horovod
def test_dpro_analyze_and_optimize_a_horovod_run(hvd_run: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "dpro", "analyze", str(hvd_run), "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    analysis = json.loads(out)
    assert analysis["measured_step_ms"] > 0 and analysis["predicted_step_ms"] > 0
    assert isinstance(analysis["error_pct"], float)
    config_path = hvd_run.parent / "config.json"
    subprocess.run([sys.executable, "-m", "dpro", "optimize", str(hvd_run), "--output", str(config_path)],
                   capture_output=True, text=True, timeout=120, check=True)
    config = json.loads(config_path.read_text())
    assert config["fingerprint"]["engine"] == "horovod"
    env = config["knobs"]["env"]
    assert int(env["HOROVOD_FUSION_THRESHOLD"]) >= 0 and float(env["HOROVOD_CYCLE_TIME"]) > 0


@pytest.mark.slow
@needs_horovod
def test_a_killed_horovod_job_leaves_a_readable_timeline(hvd_run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "cut"
    shutil.copytree(hvd_run, copy)
    text = (copy / TIMELINE_FILE).read_text()
    (copy / TIMELINE_FILE).write_text(text[: int(len(text) * 0.97)])  # as a kill leaves it
    run = load_prepared(copy)
    assert any("cut off" in p for p in run.problems)
    assert run.meta["horovod"]["merged"]["truncated"]


@pytest.mark.slow
@needs_horovod
def test_dynamic_timeline_is_written_into_the_run_dir(tmp_path: Path) -> None:
    root = tmp_path / "dyn"
    horovodrun("--model", "mlp", "--steps", "8", "--profile", "3:6", "--run-dir", str(root),
               env=job_env(HOROVOD_TIMELINE="DYNAMIC"))
    assert (root / TIMELINE_FILE).is_file()
    run = load_prepared(root)
    assert run.meta["horovod"]["merged"]["steps"]


def test_whatif_prices_horovod_knobs_and_refuses_them_on_another_engine(tmp_path: Path) -> None:
    """Horovod's knobs are in the knob table: `dpro whatif --set HOROVOD_CYCLE_TIME=...` on a Horovod run is the
    search's own price of that setting; on a DDP run the knob is refused naming its engine."""
    from run_builder import (
        horovod_timeline_events,
        horovod_timeline_text,
        make_horovod_run,
        make_run,
    )

    from dpro.cli import main
    from dpro.engines.horovod.search import horovod_predict
    from dpro.errors import UsageError
    from dpro.sim.whatif import parse_settings, predict

    run_dir = make_horovod_run(tmp_path / "run", horovod_timeline_text(horovod_timeline_events([3, 4])))
    ctx = context(load_prepared(run_dir))
    knobs = parse_settings(["HOROVOD_CYCLE_TIME=25", "HOROVOD_FUSION_THRESHOLD=0"])
    assert knobs == {"HOROVOD_CYCLE_TIME": 25.0, "HOROVOD_FUSION_THRESHOLD": 0}
    baseline = predict(ctx, {}).predicted_step_ms
    expected = baseline + horovod_predict(ctx, 0, 25.0) - horovod_predict(ctx, 48 * 2**20, 5.0)
    assert predict(ctx, knobs).predicted_step_ms == pytest.approx(expected)
    assert predict(ctx, {"HOROVOD_CYCLE_TIME": 25.0}).predicted_step_ms != pytest.approx(baseline)
    ddp = context(load_prepared(make_run(tmp_path / "ddp")))
    with pytest.raises(UsageError, match="HOROVOD_CYCLE_TIME is a knob of the horovod engine; this run's engine is "
                                         "torch-ddp"):
        predict(ddp, {"HOROVOD_CYCLE_TIME": 25.0})
    assert main(["whatif", str(tmp_path / "run"), "--set", "HOROVOD_CYCLE_TIME=25", "--json"]) == 0
    # a config's env section (what dpro optimize writes) prices the same as the knobs themselves
    in_env = {"env": {"HOROVOD_CYCLE_TIME": "25", "HOROVOD_FUSION_THRESHOLD": "0"}}
    assert predict(ctx, in_env).predicted_step_ms == pytest.approx(expected)


def test_the_buffers_own_line_prices_an_extra_buffer_despite_a_late_rank_and_an_off_slope() -> None:
    """Fixed cost and bandwidth come from a line through the step's buffers, robust to the few that waited."""
    from dpro.sim.cost import robust_line

    per_byte, fixed = 8.4e-3, 400.0
    sizes = [82_000, 16_785_408, 25_182_208] * 6
    buffers = [(float(b), fixed + per_byte * b) for b in sizes]
    buffers[0] = (82_000.0, 4_500.0)        # the step's first buffer waited for the other rank
    buffers[4] = (16_785_408.0, 250_000.0)  # one allreduce stalled
    intercept, slope = robust_line(buffers)
    assert abs(slope - per_byte) / per_byte < 0.01 and abs(intercept - fixed) < 50
    assert robust_line([(1e6, 10.0), (1.2e6, 12.0)]) is None  # sizes too alike for a slope


def test_an_extra_buffer_costs_at_least_what_the_smallest_buffers_took() -> None:
    """A token-bucket link passes mid-sized buffers faster than its rate, which pulls the line's fixed cost to 0;
    the 5 KB buffers, whose bytes cost next to nothing, still took 390 µs each (the GRU recording of bench/launch.py:
    no fusion, priced as free, ran 35% slower)."""
    from types import SimpleNamespace

    from dpro.engines.horovod.search import horovod_comm_model
    from dpro.sim.cost import CommModel

    per_byte = 8.2e-3
    sizes = [(5_140, 390.0), (263_168, 720.0), (268_308, 750.0), (792_576, 4_900.0), (2_244_608, 17_300.0),
             (3_037_184, 25_000.0)]
    buffers = [{"bytes": b, "allreduce_us": us + i} for i in range(4) for b, us in sizes]
    ctx = SimpleNamespace(run=SimpleNamespace(meta={"horovod": {"merged": {"buffers": buffers}}}), world_size=2,
                          comm=CommModel(latency_us=0.0, us_per_byte=per_byte, world_size=2, source="probe"))
    model = horovod_comm_model(ctx)
    fixed = model.latency_us * 2  # two hops for two ranks
    assert 300.0 < fixed < 400.0, model


@pytest.mark.parametrize("env, params", [
    ({"HOROVOD_FUSION_THRESHOLD": str(64 * 2**20), "HOROVOD_CYCLE_TIME": "2.5", "HOROVOD_CACHE_CAPACITY": "0"},
     {"fusion_threshold_mb": 64, "cycle_time_ms": 2.5, "cache_capacity": 0}),
    ({"HOROVOD_FUSION_THRESHOLD": str(2**19), "HOROVOD_CYCLE_TIME": "5"},
     {"fusion_threshold_mb": 0.5, "cycle_time_ms": 5}),
])
def test_horovodrun_config_file_holds_the_configs_env(tmp_path: Path, env: dict, params: dict) -> None:
    """horovodrun.yaml's params section, as horovodrun's config parser and dpro-launch read it."""
    yaml = pytest.importorskip("yaml")  # dpro-launch's dependency: the MXNet venv runs this file without it
    from dpro.engines.horovod import horovodrun_config
    from dpro.launch.horovod_run import read_horovod_config_file

    text = horovodrun_config({"knobs": {"env": env}})
    assert yaml.safe_load(text) == {"params": params}
    path = tmp_path / "horovodrun.yaml"
    path.write_text(text)
    assert read_horovod_config_file(path) == (params, None)


@pytest.mark.parametrize(("probe_fixed_us", "bounded"), [(20_000.0, True), (300.0, False)])
def test_a_probe_fixed_cost_above_every_recorded_allreduce_is_bounded_by_the_shortest(
        tmp_path: Path, probe_fixed_us: float, bounded: bool) -> None:
    """Without a timeline the fixed cost comes from the probe after the window; a probe a neighbour slowed reads it
    far above what any recorded allreduce took (launch to completion), which bounds it."""
    run_dir = make_horovod_run(tmp_path / "run", None)
    meta = json.loads((run_dir / "run.json").read_text())
    meta["comm_probe"] = {"op": "allreduce", "world_size": 2,
                          "samples": [[float(b), probe_fixed_us + b / 1000.0] for b in (65536, 524288, 2097152)
                                      for _ in range(3)]}
    (run_dir / "run.json").write_text(json.dumps(meta))
    comm = horovod_comm_model(context(load_prepared(run_dir)))
    fixed = comm.latency_us * 2  # two ranks: 2 (n - 1) hops
    shortest = 1490.0  # horovod_comm_events: the second tensor of a buffer, launched 10 us after the first
    if bounded:
        assert fixed == pytest.approx(shortest) and "shortest allreduce" in comm.source
    else:
        assert fixed < shortest and "shortest allreduce" not in comm.source


def test_without_a_timeline_the_loop_takes_the_recorded_step_within_its_standard_error(tmp_path: Path) -> None:
    """Without a timeline a buffer's fixed cost is a guess (the probe's, bounded by the shortest recorded
    allreduce); the loop is scaled so that the setting in force, simulated over the recorded launches, takes the
    recorded step within twice its standard error."""
    from dpro.sim.choices import step_stderr_ms
    from dpro.sim.whatif import predict

    run_dir = make_horovod_run(tmp_path / "run", None)
    meta = json.loads((run_dir / "run.json").read_text())
    meta["knobs"].update({"HOROVOD_FUSION_THRESHOLD": 0, "HOROVOD_CYCLE_TIME": 0.1})  # a buffer per tensor
    (run_dir / "run.json").write_text(json.dumps(meta))
    ctx = context(load_prepared(run_dir))
    threshold, cycle, _ = knobs_in_force(ctx)
    launches = recorded_launches(ctx)
    loop = horovod_loop(ctx, launches)
    recorded_us = predict(ctx, {}).predicted_step_ms * 1000.0
    simulated_us = simulate_loop(loop, [_units(ctx, None, ready) for ready in launches], threshold, cycle).step_us
    assert "no Horovod timeline: a buffer's fixed cost" in loop.source and "x1.00" not in loop.source
    assert abs(simulated_us - recorded_us) <= 2000.0 * step_stderr_ms(ctx) + cycle * 1000.0  # a cycle quantises it


def test_allreduces_beside_the_backward_move_at_the_transfer_probes_pace() -> None:
    from dpro.engines.horovod.search import HorovodLoop, simulate_loop
    from dpro.sim.cost import CommModel
    from dpro.sim.interference import TransferSlowdown

    comm = CommModel(latency_us=2_500.0, us_per_byte=0.0, world_size=2)  # 5 ms per allreduce alone
    stretch = TransferSlowdown(stall_us=1_000.0, slowdown=1.0, stall_stderr=0.0, stderr=0.0, excess_us=6_000.0,
                               excess_stderr=100.0)
    alone, beside = HorovodLoop(comm, 0.0, 0.0, 0.0, 0.0), HorovodLoop(comm, 0.0, 0.0, 0.0, 0.0, transfer=stretch)
    steps = [[([g], 2**20, 10_000.0 * (k + 1)) for k, g in enumerate("abcd")]] * 4  # the backward ends at 40 ms
    # fused after the backward (a long cycle): nothing computes beside the one buffer, which takes what it takes alone
    fused = simulate_loop(beside, steps, 2**30, 50.0)
    assert min(b[2] for b in fused.buffers) >= 40_000.0
    assert fused.step_us == pytest.approx(simulate_loop(alone, steps, 2**30, 50.0).step_us)
    # one allreduce per tensor: the first two run under compute, wait 1 ms and move at half pace; the third
    # outlasts the backward and ends at full pace; the last, after it, runs alone
    unfused, slowed = simulate_loop(alone, steps, 0, 1.0), simulate_loop(beside, steps, 0, 1.0)
    took = [b[3] - b[2] for b in slowed.buffers[:4]]
    assert took[:2] == pytest.approx([11_000.0] * 2) and 5_000.0 < took[2] < 11_000.0
    assert took[3] == pytest.approx(5_000.0)
    assert slowed.step_us > unfused.step_us


def test_only_a_cycles_first_buffer_waits_for_the_background_thread_to_wake() -> None:
    """The stall the transfer probe measures is the wait of a thread woken under compute for a core; the buffers
    after the first of a cycle run on from it on the same thread, so they only move at the slower pace."""
    from dpro.engines.horovod.search import HorovodLoop, simulate_loop
    from dpro.sim.cost import CommModel
    from dpro.sim.interference import TransferSlowdown

    comm = CommModel(latency_us=2_500.0, us_per_byte=0.0, world_size=2)  # 5 ms per allreduce alone
    stretch = TransferSlowdown(stall_us=3_000.0, slowdown=1.0, stall_stderr=0.0, stderr=0.0, excess_us=6_000.0,
                               excess_stderr=100.0)
    loop = HorovodLoop(comm, 0.0, 0.0, 0.0, 0.0, transfer=stretch)
    # two tensors ready together at 1 ms, the backward going on until 100 ms: one cycle, two buffers (no fusion)
    steps = [[(["a"], 2**20, 1_000.0), (["b"], 2**20, 1_000.0), (["c"], 2**20, 100_000.0)]] * 4
    first, second = sorted(simulate_loop(loop, steps, 0, 1.0).buffers[:2], key=lambda b: b[2])
    assert first[3] - first[2] == pytest.approx(3_000.0 + 10_000.0)  # woken: waits, then at half pace
    assert second[2] == pytest.approx(first[3])
    assert second[3] - second[2] == pytest.approx(10_000.0)  # runs on: half pace, no wait
