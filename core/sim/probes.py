"""Pricing ``amp`` and ``micro_batches`` from the recorder's probe passes (``dpro.io.probes``), never from FLOPs.

Each op keeps its recorded mean time and is scaled by what the probes measured for it, relative to the probe of the
batch as recorded (the probes run outside the step, without communication, so only their ratios are used):

- ``amp``: op time x (time under autocast / time as recorded), both at the recorded batch. Autocast keeps the
  parameters, and so the gradients and their collectives, in fp32: their bytes do not change (the
  ``gradient_compression`` knob halves them). Activations scale as the probes' kept output bytes did, and autocast
  keeps a cast copy of the weights while the forward runs (half their bytes).
- ``micro_batches`` k: each op's time against its batch is fitted as t(b) = a + s b (least squares over the probes
  at the recorded batch and its slices), and the op runs k times per step at t(B/k) / t(B) of its time. Collectives
  run once, after the last micro-batch's backward (the engine skips synchronising the others). Activations scale as
  the probes' kept bytes did at B/k (1/k where B/k was not probed).

Ops the probes did not time (an engine's own work after the forward, the optimizer, IO) keep their recorded time.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from dpro.dag.step_model import OpStats, StepModel, occurrence_name
from dpro.errors import UsageError
from dpro.io.probes import Probe, RankProbes

__all__ = ["MIN_BATCH_RATIO", "activation_scale", "amp_ratios", "batch_ratios", "fit_line", "probes_of",
           "with_amp", "with_micro_batches"]

MIN_BATCH_RATIO = 0.02  # a fitted time at a small batch is at least this share of the recorded one (a line may
# cross zero below the batches probed)
SCALED = ("FW", "BW", "RECOMPUTE")


def base_name(name: str) -> str:
    """``FW.fc1#2`` -> ``FW.fc1`` (an op's later runs in a step are priced as its first)."""
    head, sep, count = name.rpartition("#")
    return head if sep and count.isdigit() else name


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares a, s of t = a + s b over (b, t) points; a single batch gives the line through the origin."""
    if not points:
        raise ValueError("fit_line: no points")
    xs = {b for b, _ in points}
    if len(xs) == 1:
        b, t = points[0][0], sum(t for _, t in points) / len(points)
        return 0.0, t / b if b else 0.0
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    s = sum((b - mx) * (t - my) for b, t in points) / sxx
    return my - s * mx, s


def probes_of(probes: dict[int, RankProbes], rank: int, knob: str) -> RankProbes:
    """The probes of ``rank`` (those of the lowest rank that has any when it has none).

    Raises:
        UsageError: the run has no probes (``knob`` names what needed them).
    """
    found = probes.get(rank) or next((probes[r] for r in sorted(probes) if probes[r].probes), None)
    if found is None or found.batch is None or found.find(None, found.batch) is None:
        raise UsageError(f"{knob}: this run has no probe passes (RUN/probes/), which price it by measurement; "
                         "record it again with the torch recorder and $DPRO_PROBES unset")
    return found


def _reference(rank_probes: RankProbes) -> Probe:
    return rank_probes.find(None, rank_probes.batch)  # probes_of checked it


def amp_ratios(rank_probes: RankProbes, amp: str) -> dict[str, float]:
    """op -> its time under ``amp`` autocast over its time as recorded, both at the recorded batch.

    Raises:
        UsageError: ``amp`` was not probed (the note says why, when the recorder skipped it).
    """
    reference = _reference(rank_probes)
    probe = rank_probes.find(amp, reference.batch)
    if probe is None:
        why = next((s["why"] for s in rank_probes.skipped if s["probe"].startswith(amp)), "not probed")
        raise UsageError(f"amp={amp}: rank {rank_probes.rank}'s probes have no {amp} pass ({why})")
    return {op: probe.ops[op] / t for op, t in reference.ops.items() if op in probe.ops and t > 0}


def batch_ratios(rank_probes: RankProbes, k: int) -> dict[str, float]:
    """op -> t(B / k) / t(B) from the line fitted through its probes in the recorded precision (B: the recorded
    batch; ``MIN_BATCH_RATIO`` at least).

    Raises:
        UsageError: the probes hold no batch but the recorded one (a batch of 1 cannot be sliced).
    """
    reference = _reference(rank_probes)
    full = reference.batch
    sliced = [p for p in rank_probes.probes if p.amp is None and p.batch != full]
    if not sliced:
        raise UsageError(f"micro_batches={k}: rank {rank_probes.rank}'s probes ran no smaller batch than the "
                         f"recorded {full} rows")
    out: dict[str, float] = {}
    for op, t_full in reference.ops.items():
        points = [(float(full), t_full)] + [(float(p.batch), p.ops[op]) for p in sliced if op in p.ops]
        a, s = fit_line(points)
        at_full = a + s * full
        if at_full <= 0:
            continue
        out[op] = max(a + s * full / k, MIN_BATCH_RATIO * at_full) / at_full
    return out


def activation_scale(rank_probes: RankProbes, amp: str | None, k: int) -> float:
    """The activations kept under ``amp`` and ``k`` micro-batches over those recorded, as the probes measured them
    (1/k for a micro-batch size not probed; amp and micro-batches multiply)."""
    reference = _reference(rank_probes)
    if not reference.activation_bytes:
        return (1.0 if amp is None else 0.5) / k
    scale = 1.0
    if amp is not None:
        probe = rank_probes.find(amp, reference.batch)
        scale *= probe.activation_bytes / reference.activation_bytes if probe is not None else 0.5
    if k > 1:
        rows = reference.batch / k
        probe = next((p for p in rank_probes.probes if p.amp is None and p.batch == rows), None)
        scale *= probe.activation_bytes / reference.activation_bytes if probe is not None else 1.0 / k
    return scale


def _scale_op(op: OpStats, ratio: float) -> None:
    op.duration *= ratio
    op.samples = [d * ratio for d in op.samples]
    offsets = op.args.get("grads_ready_offset_us")
    if isinstance(offsets, dict):
        op.args = {**op.args, "grads_ready_offset_us": {g: t * ratio for g, t in offsets.items()}}


def _scaled(model: StepModel, ratios_of: Callable[[int], dict[str, float]]) -> StepModel:
    out = copy.deepcopy(model)
    for rank, ops in out.ops.items():
        ratios = ratios_of(rank)
        for op in ops:
            if op.category in SCALED:
                ratio = ratios.get(base_name(op.name))
                if ratio is None and op.category == "RECOMPUTE":  # a recomputed forward is priced as the forward
                    ratio = ratios.get("FW." + op.name.split(".", 1)[1])
                if ratio is not None:
                    _scale_op(op, ratio)
    return out


def with_amp(model: StepModel, probes: dict[int, RankProbes], amp: str) -> StepModel:
    """``model`` with each probed compute op at its measured time under ``amp`` autocast."""
    return _scaled(model, lambda rank: amp_ratios(probes_of(probes, rank, f"amp={amp}"), amp))


def with_micro_batches(model: StepModel, probes: dict[int, RankProbes], k: int) -> StepModel:
    """``model`` with each rank's forward and backward run ``k`` times on B / k rows (times from ``batch_ratios``),
    its collectives once, after the last pass's backward.

    Raises:
        UsageError: the run already runs several passes a step, or has no probes of smaller batches.
    """
    if k == 1:
        return model
    out = copy.deepcopy(model)
    for rank, ops in out.ops.items():
        ratios = batch_ratios(probes_of(probes, rank, f"micro_batches={k}"), k)
        out.ops[rank] = _passes(ops, ratios, k, rank)
    return out


def _passes(ops: list[OpStats], ratios: dict[str, float], k: int, rank: int) -> list[OpStats]:
    """One rank's ops with the span from its first forward to its last backward run ``k`` times."""
    if any(op.category in SCALED and base_name(op.name) != op.name for op in ops):
        raise UsageError(f"micro_batches: rank {rank} already runs several forward/backward passes a step; "
                         "price splitting a run recorded with one pass per step")
    compute = [i for i, op in enumerate(ops) if op.category in ("FW", "BW")]
    if not compute:
        return ops
    first = next(i for i in compute if ops[i].category == "FW") if any(
        ops[i].category == "FW" for i in compute) else compute[0]
    last = max(i for i in compute if ops[i].category == "BW") if any(
        ops[i].category == "BW" for i in compute) else compute[-1]
    body = ops[first:last + 1]
    span = body[-1].order + body[-1].duration - body[0].order
    out = list(ops[:first])
    for j in range(k):
        final = j == k - 1
        for op in body:
            if op.category not in SCALED and not final:
                continue  # collectives and other work: once, with the last micro-batch
            copied = copy.deepcopy(op)
            copied.order += j * span
            if op.category in SCALED:
                copied.name = occurrence_name(op.name, j)
                ratio = ratios.get(op.name)
                if ratio is None and op.category == "RECOMPUTE":
                    ratio = ratios.get("FW." + op.name.split(".", 1)[1])
                if ratio is not None:
                    _scale_op(copied, ratio)
            out.append(copied)
    for op in ops[last + 1:]:
        moved = copy.deepcopy(op)
        moved.order += (k - 1) * span
        out.append(moved)
    return out
