"""What-if: rebuild the step under changed knobs and replay it.

Each knob is a transformation of the mean step (``dpro.dag.step_model.StepModel``), priced by the cost
models of ``dpro.sim.cost`` and replayed by ``dpro.sim.replay``. The knobs are those of
``dpro.config.knob_table()`` that what-if can predict (``whatif_knobs()``):

| knob | what changes |
|---|---|
| an engine's grouping knobs (see ``dpro.engines``) | gradients regrouped the way the engine groups them |
| ``tensor_groups`` | explicit gradient groups (JSON list of lists of names) |
| ``world_size`` | ring-allreduce cost on N ranks |
| ``bandwidth_scale`` | network bandwidth times k (e.g. 10 for 1 -> 10 Gbit/s) |
| ``compute_scale`` | compute ops take k times as long (a slower or faster device) |
| ``gradient_compression`` | ``fp16`` / ``bf16``: half the bytes on the wire |
| ``recompute`` | modules checkpointed: their forward runs again in backward; fewer saved activations |
| ``amp`` | ``bf16`` / ``fp16`` autocast: each op at the time the recorder's probes measured (``dpro.sim.probes``) |
| ``micro_batches`` | k forward/backward passes on B/k rows (probed times), collectives after the last |
| ``compile`` | module paths compiled (``torch.compile``; Gluon: ``hybridize(static_alloc=True)``) at the probed ratio |
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpro.config import knob_table
from dpro.dag.align import align
from dpro.dag.graph import Graph
from dpro.dag.step_model import OpStats, StepModel, occurrence_name, step_model
from dpro.dag.wiring import graph_from_steps
from dpro.engines import get_engine
from dpro.errors import ConfigError, UsageError
from dpro.io.limits import parse_bounded_json
from dpro.io.load import RecordingCost, Run, recording_cost
from dpro.io.probes import RankProbes, read_probes
from dpro.sim.cost import CommModel, MemoryModel, fit_comm_model, memory_model, scale_to_reach
from dpro.sim.interference import NONE as NO_INTERFERENCE
from dpro.sim.interference import (
    Interference,
    fit_interference,
    op_overlap,
    scale_for_overlap,
    stretch_transfers,
)
from dpro.sim.links import OpKey, crowding_by_op, scale_for_crowding
from dpro.sim.probes import activation_scale, probes_of, step_passes, with_amp, with_compile, with_micro_batches
from dpro.sim.replay import plan_levels, predicted_step_us, replay

__all__ = [
    "MB",
    "REGROUPING_KNOBS",
    "Context",
    "Prediction",
    "add_recompute",
    "calibrate",
    "context",
    "parse_settings",
    "peak_memory",
    "predict",
    "recorded_crowding",
    "recorded_groups",
    "recorded_knobs",
    "regroup",
    "replay_model",
    "transformed_model",
    "whatif_knobs",
    "without_recording_cost",
]


MB = 2**20
REGROUPING_KNOBS = ("tensor_groups", "world_size", "bandwidth_scale", "gradient_compression")


def whatif_knobs() -> list[str]:
    """The knobs ``--set`` takes (every knob of the table that what-if can predict)."""
    return [name for name, knob in knob_table().items() if knob.whatif]


def parse_settings(items: list[str]) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` -> knobs. Values are JSON where they parse (numbers, lists), else text;
    ``recompute`` and ``compile`` also take a comma-separated list of module paths (``compile=none``: nothing)."""
    knobs: dict[str, Any] = {}
    known = whatif_knobs()
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. world_size=8")
        if key not in known:
            raise UsageError(f"--set {key}: unknown knob; known: {', '.join(known)}")
        try:
            value: Any = parse_bounded_json(raw, f"--set {key}",
                                            lambda where, problem: UsageError(f"{where}: {problem}"))
        except json.JSONDecodeError:
            value = raw
        if key in ("recompute", "compile") and isinstance(value, str):
            value = [] if value == "none" else [m for m in value.split(",") if m]
        if key in ("gradient_compression", "amp") and value == "none":
            value = None
        knobs[key] = value
    _validate(knobs)
    return knobs


def _validate(knobs: dict[str, Any]) -> None:
    """Each knob's own check (the one config validation uses), reported as a usage error."""
    table = knob_table()
    for key, value in knobs.items():
        knob = table.get(key)
        if knob is None:
            raise UsageError(f"{key}: unknown knob; known: {', '.join(whatif_knobs())}")
        try:
            knobs[key] = knob.check(value, "--set", key)
        except ConfigError as err:
            raise UsageError(f"--set {key}={json.dumps(value)}: {err.problem}") from err


@dataclass
class Context:
    """What the what-if transformations need from a run, computed once."""

    run: Run
    base: StepModel
    comm: CommModel
    memory: MemoryModel
    gradients: list[tuple[str, int]]                  # ready order
    knobs: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)  # an engine's models fitted once per run (by engine name)
    on_predict: Callable[[dict[str, Any]], None] | None = None  # told the knobs of each prediction (progress)
    interference: Interference = NO_INTERFERENCE  # how much overlapped compute slows (sim.interference)
    recording: RecordingCost | None = None  # what recording cost the recorded steps, where the window's gaps told
    as_recorded_ms: float | None = None  # the recorded configuration's replay before that cost was taken out
    probes: dict[int, RankProbes] = field(default_factory=dict)  # the recorder's probe passes (io.probes), by rank
    comm_fitted: CommModel | None = None  # ``comm`` before ``calibrate`` scaled it (calibrated again under another
    # interference: the transfers' stretch moves the level the recorded run gives)

    @property
    def world_size(self) -> int:
        return int(self.knobs.get("world_size") or self.run.world_size)

    @property
    def engine(self) -> str:
        """The run's engine (run.json's ``engine``); ``dpro.engines.get_engine`` looks it up."""
        return str((self.run.meta or {}).get("engine") or "")


def context(run: Run) -> Context:
    """Align, summarise and fit the cost models of ``run`` (the inputs of every what-if)."""
    if not run.model:
        raise UsageError(f"{run.path}: model.json is missing; what-if needs the gradient list")
    base = step_model(run, align(run))
    graph_from_steps(base, iterations=1)  # fixes every op's measured gap before any transformation
    transfers = []
    for rank_ops in list(base.ops.values())[:1]:
        for op in rank_ops:
            if op.category == "COMM" and op.name in base.transfer:
                transfers.append((float(op.args.get("bytes", 0)), base.transfer[op.name]))
    probe = (run.meta or {}).get("comm_probe", {}).get("samples", [])
    comm = fit_comm_model(transfers, probe, run.world_size)
    knobs = recorded_knobs(run)
    passes = step_passes(base)
    if passes > 1:  # the job accumulates gradients: what-ifs' micro_batches count from its passes
        knobs.setdefault("micro_batches", passes)
    grads = [(g["name"], int(g["bytes"])) for g in run.model.get("gradients", [])]
    interference = fit_interference(run, base.steps)
    ctx = calibrate(Context(run, base, comm, memory_model(run.model, knobs), grads, knobs,
                            interference=interference, recording=recording_cost(run), probes=read_probes(run.path),
                            comm_fitted=comm))
    return without_recording_cost(ctx)


def recorded_knobs(run: Run) -> dict[str, Any]:
    """run.json's ``knobs``, each one dpro can change checked as a config's would be (a recorder's other notes,
    such as the optimizer's name, pass as they are).

    Raises:
        TraceError: naming run.json and the knob whose value is of the wrong kind or out of range.
    """
    from dpro.errors import TraceError

    table = knob_table()
    knobs = dict((run.meta or {}).get("knobs", {}))
    for name, value in knobs.items():
        if name in table and value is not None:
            try:
                knobs[name] = table[name].check(value, "run.json", name)
            except ConfigError as err:
                raise TraceError(Path(run.path) / "run.json", err.problem, f"knobs.{name}") from None
    return knobs


def calibrate(ctx: Context) -> Context:
    """Scale the fitted ``CommModel`` so that the recorded configuration, rebuilt with the model's transfer
    times, replays to the step time the measured transfers give.

    The fit gives the shape (latency vs bandwidth); the run itself gives the level: collectives that
    overlap each other and backward on a busy host run slower than the recording-time probe. Without
    this, a what-if would compare a model-priced change against a measurement-priced baseline.
    """
    buckets = [list(b.get("tensors") or []) for b in (ctx.run.model or {}).get("buckets", [])]
    names = {n for n, _ in ctx.gradients}
    if not ctx.base.transfer or not buckets or {t for b in buckets for t in b} != names:
        return ctx
    target = predict(ctx, {}).predicted_step_ms
    fitted = ctx.comm

    def step_at(scale: float) -> float:
        ctx.comm = dataclasses.replace(fitted, latency_us=fitted.latency_us * scale,
                                       us_per_byte=fitted.us_per_byte * scale)
        return predict(ctx, {"tensor_groups": buckets}).predicted_step_ms

    scale = scale_to_reach(step_at, target, 0.05, 20.0)
    ctx.comm = dataclasses.replace(fitted, latency_us=fitted.latency_us * scale, us_per_byte=fitted.us_per_byte * scale,
                                   source=f"{fitted.source}, scaled x{scale:.2f} to replay the recorded run")
    return ctx


DEFLATION_FLOOR = 0.2  # compute never priced below a fifth of what was recorded, whatever the gaps said


def without_recording_cost(ctx: Context) -> Context:
    """Take what recording cost out of the model: where the window's gaps measured the recorded steps longer than
    the unrecorded ones beyond their noise (``RecordingCost.beyond_noise``), compute ops are scaled down until the
    recorded configuration replays to the unrecorded step. Hooks and profilers slow the compute they time, so a
    model built from recorded steps would otherwise price every what-if against a slower job than the one that
    runs. ``ctx.as_recorded_ms`` keeps the replay before."""
    cost = ctx.recording
    if cost is None or not cost.beyond_noise:
        return ctx
    recorded = ctx.base
    as_recorded = predict(ctx, {}).predicted_step_ms
    target = as_recorded / (1.0 + cost.pct / 100.0)

    def step_at(scale: float) -> float:
        ctx.base = scaled_compute(recorded, scale)
        ctx.cache.clear()  # the recorded overlap is the base's
        return predict(ctx, {}).predicted_step_ms

    lo, hi = DEFLATION_FLOOR, 1.0
    if step_at(lo) >= target:
        scale = lo
    else:
        for _ in range(14):  # the step grows with the compute scale
            mid = (lo + hi) / 2.0
            lo, hi = (mid, hi) if step_at(mid) < target else (lo, mid)
        scale = (lo + hi) / 2.0
    ctx.base = scaled_compute(recorded, scale)
    ctx.cache.clear()
    ctx.as_recorded_ms = as_recorded
    return ctx


def _pass_of(name: str) -> int:
    """Which run of an op in the step a node is (``occurrence_name``: ``BW.fc1`` 1, ``BW.fc1#2`` 2)."""
    _, sep, count = name.rpartition("#")
    return int(count) if sep and count.isdigit() else 1


def _producers_by_pass(ops: list[OpStats]) -> list[tuple[dict[str, int], int]]:
    """Per backward pass of the step, in order (gradient accumulation runs one per micro-batch): the index of the
    BW op that computes each gradient, and of the pass's last BW op."""
    passes: dict[int, tuple[dict[str, int], list[int]]] = {}
    for i, op in enumerate(ops):
        if op.category == "BW":
            producer, last = passes.setdefault(_pass_of(op.name), ({}, [i]))
            last[0] = i
            for g in op.args.get("grads", []):
                producer[g] = i
    return [(producer, last[0]) for _, (producer, last) in sorted(passes.items())]


def regroup(ctx: Context, model: StepModel, groups: list[list[str]], bytes_scale: float = 1.0,
            bandwidth_scale: float = 1.0, world_size: int | None = None) -> StepModel:
    """Replace the step's COMM ops by one allreduce per group, priced by the fitted ``CommModel``."""
    sizes = dict(ctx.gradients)
    known = set(sizes)
    seen: set[str] = set()
    for group in groups:
        for name in group:
            if name not in known:
                raise UsageError(f"tensor group names unknown gradient {name!r}")
            if name in seen:
                raise UsageError(f"tensor groups name gradient {name!r} twice; each gradient is in one group")
            seen.add(name)
    missing = [name for name, _ in ctx.gradients if name not in seen]
    if missing and seen:  # a gradient in no group would not be communicated at all, and the step look faster
        raise UsageError(f"tensor groups name {len(seen)} of the {len(known)} gradients; every gradient must be in "
                         f"one group (missing: {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})")
    out = copy.deepcopy(model)
    # collectives that carry no gradient (reductions of the step's outputs: loss, metrics) stay as measured
    others = {op.name for ops in model.ops.values() for op in ops
              if op.category == "COMM" and not op.args.get("tensors")}
    out.transfer = {name: t for name, t in model.transfer.items() if name in others}
    out.transfer_end = {name: t for name, t in model.transfer_end.items() if name in others}
    for rank, ops in out.ops.items():
        comm_gaps = [op.gap for op in ops if op.category == "COMM" and op.gap is not None and op.name not in others]
        launch_gap = statistics.median(comm_gaps) if comm_gaps else 0.0
        kept = [op for op in ops if op.category != "COMM" or op.name in others]
        # a pass's gradients are communicated after it when the engine synchronised that pass: under gradient
        # accumulation usually only the last, every pass when the engine was not told to skip the others
        passes = _producers_by_pass(kept) or [({}, len(kept) - 1)]
        synced = max((_pass_of(op.name) for op in ops if op.category == "COMM" and op.name not in others), default=1)
        inserts: list[tuple[int, OpStats]] = []
        for run, (producer, last_bw) in enumerate(passes[-synced:]):
            position = -1
            for k, group in enumerate(groups):
                position = last_bw if model.comm_after_backward else \
                    max([position] + [producer.get(g, last_bw) for g in group])
                anchor = kept[position]
                nbytes = sum(sizes[g] for g in group)
                name = occurrence_name(f"COMM.group{k}.allreduce", run)
                inserts.append((position, OpStats(name, "COMM", "comm", rank,
                                                  anchor.order + anchor.duration + 1e-3 * k, 0.0, launch_gap,
                                                  {"tensors": group, "bytes": nbytes})))
                out.transfer[name] = ctx.comm.allreduce_us(nbytes * bytes_scale, world_size, bandwidth_scale)
                out.priced_transfers.add(name)
        merged: list[OpStats] = []
        by_pos: dict[int, list[OpStats]] = {}
        for pos, op in inserts:
            by_pos.setdefault(pos, []).append(op)
        for i, op in enumerate(kept):
            merged.append(op)
            merged.extend(by_pos.get(i, []))
        out.ops[rank] = merged
    return out


def add_recompute(ctx: Context, model: StepModel, modules: list[str]) -> StepModel:
    """Insert each checkpointed module's forward again, just before the first backward op inside it."""
    out = copy.deepcopy(model)
    for module in modules:
        prefix = f"{module}."
        inside = [f"FW.{m}" for m in ctx.memory.activation_bytes if m == module or m.startswith(prefix)]
        if not inside and not any(op.name == f"FW.{module}" for ops in model.ops.values() for op in ops):
            raise UsageError(f"recompute={module!r}: no recorded module has that path")
        for rank, ops in out.ops.items():
            fw_names = set(inside) | {f"FW.{module}"}
            # each pass of the step (one per micro-batch) recomputes its own forward
            for run in sorted({_pass_of(op.name) for op in ops if op.category == "BW"}, reverse=True):
                cost = sum(op.duration for op in ops if op.name in {occurrence_name(n, run - 1) for n in fw_names})
                first_bw = next((i for i, op in enumerate(ops) if op.category == "BW" and _pass_of(op.name) == run
                                 and (op.name.partition("#")[0] == f"BW.{module}"
                                      or op.name.startswith(f"BW.{prefix}"))), None)
                if first_bw is None:
                    continue
                anchor = ops[first_bw]
                ops.insert(first_bw, OpStats(occurrence_name(f"RECOMPUTE.{module}", run - 1), "RECOMPUTE",
                                             anchor.queue, rank, anchor.order - 1e-3, cost, 0.0, {}))
    return out


@dataclass
class Prediction:
    """A replayed prediction under some knobs (times in ms). ``spread``: for a scale-out (more ranks than were
    recorded), the predicted step of each seed's draw of the ranks' op times, and its p50 and p90."""

    knobs: dict[str, Any]
    predicted_step_ms: float
    predicted_peak_memory_bytes: int
    graph_nodes: int
    per_rank_ms: dict[int, float] = field(default_factory=dict)
    spread: dict[str, Any] = field(default_factory=dict)


def recorded_groups(ctx: Context) -> list[list[str]]:
    """The gradient groups the recorded run communicated in (model.json's buckets), else one group per
    gradient; gradients no group names join the last group."""
    groups = [list(b.get("tensors") or []) for b in (ctx.run.model or {}).get("buckets", [])]
    groups = [g for g in groups if g]
    named = {n for g in groups for n in g}
    rest = [n for n, _ in ctx.gradients if n not in named]
    if not groups:
        return [[n] for n in rest]
    if rest:
        groups[-1] = groups[-1] + rest
    return groups


def transformed_model(ctx: Context, knobs: dict[str, Any]) -> StepModel:
    """The mean step under ``knobs`` (names from ``whatif_knobs()``)."""
    _validate(knobs)
    model = ctx.base
    regions = _compiled_regions(ctx, knobs)  # first: it refuses the knobs it was not probed with
    recorded_amp = ctx.knobs.get("amp")
    if knobs.get("amp", recorded_amp) != recorded_amp:
        if recorded_amp:
            raise UsageError(f"amp={knobs['amp'] or 'off'}: this run was recorded under {recorded_amp} autocast; its "
                             "probes price another precision only from a run recorded without it")
        model = with_amp(model, ctx.probes, knobs["amp"])
    if _splits(ctx, knobs):
        model = with_micro_batches(model, ctx.probes, int(knobs["micro_batches"]))
    if regions:
        model = with_compile(model, ctx.probes, regions)
    engine = get_engine(ctx.engine)
    if any(k in knobs for k in (*REGROUPING_KNOBS, *engine.comm_knobs)):
        groups = knobs.get("tensor_groups") or engine.groups(ctx, knobs) or recorded_groups(ctx)
        compression = knobs.get("gradient_compression")
        scale = 0.5 if compression in ("fp16", "bf16") else 1.0
        model = regroup(ctx, model, groups, bytes_scale=scale, bandwidth_scale=float(knobs.get("bandwidth_scale", 1.0)),
                        world_size=knobs.get("world_size"))
    if knobs.get("recompute"):
        model = add_recompute(ctx, model, list(knobs["recompute"]))
    if float(knobs.get("compute_scale", 1.0)) != 1.0:
        model = scaled_compute(model, float(knobs["compute_scale"]))
    return model


def _compiled_regions(ctx: Context, knobs: dict[str, Any]) -> list[str]:
    """The regions ``knobs`` compile beyond the recorded run's (the compile probe ran at the recorded precision and
    batch, on a model recorded uncompiled: other combinations are refused)."""
    recorded = list(ctx.knobs.get("compile") or [])
    wanted = list(knobs.get("compile", recorded) or [])
    if wanted == recorded:
        return []
    if recorded:
        raise UsageError(f"compile={','.join(wanted) or 'none'}: this run was recorded with {','.join(recorded)} "
                         "compiled (its modules untimed); price compiling from a run recorded without it")
    if knobs.get("amp", ctx.knobs.get("amp")) != ctx.knobs.get("amp") or _splits(ctx, knobs):
        raise UsageError("compile: the compile probe timed the regions at the recorded precision and batch; it "
                         "does not price them together with amp or micro_batches")
    return wanted


def _splits(ctx: Context, knobs: dict[str, Any]) -> bool:
    """Whether ``knobs`` run the step in other micro-batches than the recorded ones."""
    return knobs.get("micro_batches") is not None and int(knobs["micro_batches"]) != step_passes(ctx.base)


COMPUTE_CATEGORIES = ("FW", "BW", "RECOMPUTE", "UPDATE", "COMPUTE")


def scaled_compute(model: StepModel, scale: float) -> StepModel:
    """``model`` on a device ``scale`` times as slow (0.5: twice as fast): compute ops last ``scale`` times as
    long, gradients are ready as much sooner or later in their backward op; host gaps and communication stay."""
    out = copy.deepcopy(model)
    for ops in out.ops.values():
        for op in ops:
            if op.category in COMPUTE_CATEGORIES:
                op.duration *= scale
                op.samples = [d * scale for d in op.samples]
                offsets = op.args.get("grads_ready_offset_us")
                if isinstance(offsets, dict):
                    op.args["grads_ready_offset_us"] = {g: t * scale for g, t in offsets.items()}
    return out


def predict(ctx: Context, knobs: dict[str, Any], iterations: int = 4) -> Prediction:
    """Replay the step under ``knobs`` and predict its time and peak memory (an engine's own knobs that no
    regrouping expresses are priced by the engine: ``Engine.predict``)."""
    table = knob_table()
    for key in knobs:
        engine_of = table[key].engine if key in table else ""
        if engine_of and engine_of != ctx.engine:
            raise UsageError(f"{key} is a knob of the {engine_of} engine; this run's engine is "
                             f"{ctx.engine or 'not named in run.json'}")
    own = get_engine(ctx.engine).predict(ctx, knobs) if knobs else None
    if own is not None:
        result = own
    elif int(knobs.get("world_size") or 0) > len(ctx.base.ops):
        result = scale_out(ctx, transformed_model(ctx, knobs), knobs)
    else:
        result = replay_model(ctx, transformed_model(ctx, knobs), knobs, iterations)
    if ctx.on_predict is not None:
        ctx.on_predict(knobs)
    return result


def peak_memory(ctx: Context, knobs: dict[str, Any]) -> int:
    """The peak memory of a rank under ``knobs``: recomputation's activations, scaled by what the probes kept under
    ``amp`` and at B / ``micro_batches`` (``sim.probes.activation_scale``), plus autocast's cast copy of the weights
    (half their bytes) while the forward runs."""
    passes = step_passes(ctx.base)
    amp, k = knobs.get("amp"), int(knobs.get("micro_batches") or passes)
    recompute = knobs.get("recompute") or ()
    if not amp and k == passes:
        return ctx.memory.peak_bytes(recompute)
    scale = activation_scale(probes_of(ctx.probes, 0, "amp" if amp else "micro_batches"), amp, k, passes)
    return ctx.memory.peak_bytes(recompute, activation_scale=scale) + (ctx.memory.param_bytes // 2 if amp else 0)


SCALE_OUT_SEEDS = 5
SCALE_OUT_ITERATIONS = 2  # the second step, after the first: what predicted_step_us reads


def ranks_drawn(model: StepModel, world_size: int, seed: int) -> StepModel:
    """``model`` on ``world_size`` ranks: rank r runs the ops of recorded rank ``r % recorded``, each compute op
    lasting what it lasted in one profiled step drawn for that rank (seeded), so ranks differ as the recorded
    steps did and the slowest of them holds up every collective."""
    rng = random.Random(seed)
    recorded = sorted(model.ops)
    ops: dict[int, list[OpStats]] = {}
    for rank in range(world_size):
        source = recorded[rank % len(recorded)]
        step = rng.randrange(max(1, len(model.steps)))
        ops[rank] = [dataclasses.replace(op, rank=rank, duration=op.samples[step % len(op.samples)])
                     if op.samples and op.category not in ("COMM", "STEP") else dataclasses.replace(op, rank=rank)
                     for op in model.ops[source]]
    pick = {rank: recorded[rank % len(recorded)] for rank in range(world_size)}
    return dataclasses.replace(
        model, ops=ops, step_us_by_rank={r: model.step_us_by_rank.get(s, 0.0) for r, s in pick.items()},
        tail_us={r: model.tail_us.get(s, 0.0) for r, s in pick.items()})


def scale_out(ctx: Context, model: StepModel, knobs: dict[str, Any], seeds: int = SCALE_OUT_SEEDS) -> Prediction:
    """More ranks than were recorded: the N-rank DAG replayed once per seed (``ranks_drawn``); the prediction is
    the median over seeds, with p50/p90 in ``spread``."""
    world_size = int(knobs["world_size"])
    steps, nodes = [], 0
    for seed in range(seeds):
        g = graph_from_steps(ranks_drawn(model, world_size, seed), iterations=SCALE_OUT_ITERATIONS)
        sched = replay(g, plan_levels(g))
        steps.append(statistics.median(predicted_step_us(g, sched).values()) / 1000.0)
        nodes = g.size
    ordered = sorted(steps)
    p90 = ordered[min(len(ordered) - 1, int(math.ceil(0.9 * len(ordered))) - 1)]
    return Prediction(knobs=dict(knobs), predicted_step_ms=statistics.median(steps),
                      predicted_peak_memory_bytes=peak_memory(ctx, knobs), graph_nodes=nodes,
                      spread={"seeds": steps, "p50": statistics.median(steps), "p90": p90})


INTERFERENCE_ROUNDS = 3  # replays that let the scaled durations and the overlap they cause settle
SETTLED_US = 1.0  # transfers stretched beside compute: replays go on until no duration moves more than this ...
MAX_TRANSFER_ROUNDS = 8  # ... or this many rounds (each settles about one more iteration)
CROWDING_ROUNDS = 6  # replays that let compute's pace on shared CPUs and the crowding it meets settle


def replay_model(ctx: Context, model: StepModel, knobs: dict[str, Any], iterations: int = 4,
                 crowded_as: dict[OpKey, float] | None = None) -> Prediction:
    """Replay ``iterations`` copies of a (transformed) mean step: the prediction under ``knobs``. With a fitted
    interference (``ctx.interference``), compute that overlaps communication more than it did in the recorded
    configuration runs that much slower (less: faster), and the transfers the what-if priced alone
    (``StepModel.priced_transfers``) take as long as the transfer probe says beside the compute they overlap.
    Compute sharing its host's CPUs with work on them (``StepModel.compute_links``) runs as much slower or faster
    than recorded as the CPUs are more or less crowded than in the recorded configuration's replay
    (``crowded_as``: ``recorded_crowding``)."""
    g = graph_from_steps(model, iterations=iterations)
    plan = plan_levels(g)
    sched = replay(g, plan)
    if crowded_as and sched.crowding is not None:
        base = g.duration.copy()
        for _ in range(CROWDING_ROUNDS):
            before = g.duration.copy()
            scale_for_crowding(g, sched.crowding, crowded_as, base)
            sched = replay(g, plan)
            if float(np.max(np.abs(g.duration - before))) < SETTLED_US:
                break
    slowed = ctx.interference.applies
    stretched = _priced_transfer_nodes(g, model) if ctx.interference.stretches_transfers else np.zeros(0, int)
    if slowed or stretched.size:
        recorded = _recorded_overlap(ctx, iterations) if slowed else {}
        base = g.duration.copy()
        rounds = MAX_TRANSFER_ROUNDS if stretched.size else INTERFERENCE_ROUNDS
        for _ in range(rounds):
            before = g.duration.copy()
            if slowed:
                scale_for_overlap(g, sched, recorded, ctx.interference.slowdown, base)
            if stretched.size:
                stretch_transfers(g, sched, stretched, base[stretched], ctx.interference.transfer)
            sched = replay(g, plan)
            if stretched.size and float(np.max(np.abs(g.duration - before))) < SETTLED_US:
                break
    per_rank = predicted_step_us(g, sched)
    return Prediction(knobs=dict(knobs), predicted_step_ms=statistics.median(per_rank.values()) / 1000.0,
                      predicted_peak_memory_bytes=peak_memory(ctx, knobs), graph_nodes=g.size,
                      per_rank_ms={r: v / 1000.0 for r, v in per_rank.items()})


def recorded_crowding(model: StepModel, iterations: int = 4) -> dict[OpKey, float]:
    """How crowded each compute op's CPUs were in the replay of ``model``, the recorded configuration under the
    what-if's pricing (``crowded_as`` of ``replay_model``); empty where its compute shares no CPUs."""
    g = graph_from_steps(model, iterations=iterations)
    sched = replay(g, plan_levels(g))
    return crowding_by_op(g, sched.crowding) if sched.crowding is not None else {}


def _priced_transfer_nodes(g: Graph, model: StepModel) -> np.ndarray:
    """The graph's transfer nodes of the collectives ``model`` priced alone (``StepModel.priced_transfers``)."""
    suffix = ".transfer"
    return np.array([i for i, (name, cat) in enumerate(zip(g.names, g.category, strict=True))
                     if cat == "XFER" and name.endswith(suffix) and name[:-len(suffix)] in model.priced_transfers],
                    dtype=np.int64)


def _recorded_overlap(ctx: Context, iterations: int) -> dict[tuple[int, str], float]:
    """How much each compute op overlapped communication in the replay of the recorded configuration (once)."""
    key = f"recorded_overlap/{iterations}"
    if key not in ctx.cache:
        g = graph_from_steps(ctx.base, iterations=iterations)
        ctx.cache[key] = op_overlap(g, replay(g, plan_levels(g)))
    return ctx.cache[key]
