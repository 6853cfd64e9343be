"""Pricing ``amp``, ``micro_batches`` and ``compile`` from the recorder's probe passes (``dpro.io.probes``), never
from FLOPs.

Each op keeps its recorded mean time and is scaled by what the probes measured for it, relative to the probe of the
batch as recorded (the probes run outside the step, without communication, so only their ratios are used):

- ``amp``: op time x (time under autocast / time as recorded), both at the recorded batch. Autocast keeps the
  parameters, and so the gradients and their collectives, in fp32: their bytes do not change (the
  ``gradient_compression`` knob halves them). Activations scale as the probes' kept output bytes did, and autocast
  keeps a cast copy of the weights while the forward runs (half their bytes).
- ``micro_batches`` k: the step's rows (B, the recorded pass's rows times the passes the step runs) in k forward and
  backward passes. Each op's time against its batch is fitted as t(b) = a + s b (least squares over the probes at
  the recorded pass's rows and their slices), and the op runs k times per step at t(B/k) / t(recorded rows) of its
  time. Collectives run once, after the last micro-batch's backward (the engine skips synchronising the others).
  A step recorded with several passes (gradient accumulation) is priced from its last pass, which holds the
  collectives, and the loop's work recorded between its last two passes (a batch fetched per micro-batch).
  Activations scale as the probes' kept bytes did at B/k (in proportion where B/k was not probed).
- ``compile`` (module paths, ``<root>`` for the whole model): the forward ops of each region's modules scale by its
  compiled over eager forward time, the backward ops by the backward's, both measured in the same compile probe in
  paired passes; so do the gaps between two ops of the region (work of the region's own code between its
  modules). Communication, and every op outside the regions, keep their time.

Work between the recorded modules (a parent's own tensor ops, such as attention's products inside a block whose
children are the recorded layers) is in the gaps before the forward and backward ops; the probes measure it as the
pass less its ops (``BETWEEN``) and the gaps inside the pass scale as it did. Ops the probes did not time (an
engine's own work after the forward, the optimizer, IO) keep their recorded time.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from dpro.dag.step_model import OpStats, StepModel, occurrence_name
from dpro.errors import UsageError
from dpro.io.probes import Probe, RankProbes
from dpro.record.trace import ROOT_MODULE

__all__ = ["BETWEEN", "MIN_BATCH_RATIO", "activation_scale", "amp_ratios", "batch_ratios", "compile_probe_of",
           "compile_ratios", "fit_line", "in_region", "pass_starts", "probes_of", "step_passes", "with_amp",
           "with_compile", "with_micro_batches"]

MIN_BATCH_RATIO = 0.02  # a fitted time at a small batch is at least this share of the recorded one (a line may
# cross zero below the batches probed)
SCALED = ("FW", "BW", "RECOMPUTE")
BETWEEN = "<between modules>"  # a probe pass's time outside its recorded ops: the gaps inside the pass
BETWEEN_MIN = 0.02  # ... priced only where it is at least this share of the pass (else timer noise)


def timed(probe: Probe) -> dict[str, float]:
    """A probe's op times, and the pass's time outside them as ``BETWEEN`` (where it is a share worth pricing;
    nested modules timed twice can make the ops add up to more than the pass)."""
    between = probe.pass_us - sum(probe.ops.values())
    return {**probe.ops, BETWEEN: between} if between >= BETWEEN_MIN * probe.pass_us else dict(probe.ops)


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
    """The probes of ``rank`` (those of the lowest rank that has usable ones when it has none: the reference probe,
    the batch as recorded, is what every ratio is taken against).

    Raises:
        UsageError: the run has no probes (``knob`` names what needed them).
    """
    def usable(rank_probes: RankProbes | None) -> bool:
        return rank_probes is not None and rank_probes.batch is not None and \
            rank_probes.find(None, rank_probes.batch) is not None

    own = probes.get(rank)
    found = own if usable(own) else next((probes[r] for r in sorted(probes) if usable(probes[r])), None)
    if found is None:
        skipped = [s["why"] for r in sorted(probes) for s in probes[r].skipped
                   if not s["probe"].startswith("compile")][:1]
        if skipped:
            raise UsageError(f"{knob}: the recorder's probe passes, which price it by measurement, were skipped: "
                             f"{skipped[0]}")
        if probes:  # compile probes alone (the MXNet and TensorFlow recorders' only probe)
            raise UsageError(f"{knob}: this run's probe passes hold no pass of the batch as recorded, which prices "
                             "it by measurement (only the torch recorder runs those)")
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
    ops, reference_ops = timed(probe), timed(reference)
    return {op: ops[op] / t for op, t in reference_ops.items() if op in ops and t > 0}


def batch_ratios(rank_probes: RankProbes, k: int, passes: int = 1) -> dict[str, float]:
    """op -> t(B / k) / t(b) from the line fitted through its probes in the recorded precision (b: the recorded
    pass's rows, B = b x ``passes`` the step's; ``MIN_BATCH_RATIO`` at least).

    Raises:
        UsageError: the probes hold no batch but the recorded one (a batch of 1 cannot be sliced).
    """
    reference = _reference(rank_probes)
    full = reference.batch
    sliced = [p for p in rank_probes.probes if p.amp is None and p.batch != full and p.compile is None]
    if not sliced:
        raise UsageError(f"micro_batches={k}: rank {rank_probes.rank}'s probes ran no smaller batch than the "
                         f"recorded {full} rows")
    out: dict[str, float] = {}
    sliced_ops = [(p.batch, timed(p)) for p in sliced]
    for op, t_full in timed(reference).items():
        points = [(float(full), t_full)] + [(float(rows), ops[op]) for rows, ops in sliced_ops if op in ops]
        a, s = fit_line(points)
        at_full = a + s * full
        if at_full <= 0:
            continue
        out[op] = max(a + s * full * passes / k, MIN_BATCH_RATIO * at_full) / at_full
    return out


def activation_scale(rank_probes: RankProbes, amp: str | None, k: int, passes: int = 1) -> float:
    """The activations kept under ``amp`` and ``k`` micro-batches over those recorded (``passes`` passes a step),
    as the probes measured them (in proportion for a micro-batch size not probed; amp and micro-batches
    multiply)."""
    reference = _reference(rank_probes)
    if not reference.activation_bytes:
        return (1.0 if amp is None else 0.5) * passes / k
    scale = 1.0
    if amp is not None:
        probe = rank_probes.find(amp, reference.batch)
        scale *= probe.activation_bytes / reference.activation_bytes if probe is not None else 0.5
    if k != passes:
        rows = reference.batch * passes / k
        probe = rank_probes.find(None, int(rows)) if rows == int(rows) else None
        scale *= probe.activation_bytes / reference.activation_bytes if probe is not None else passes / k
    return scale


def _scale_op(op: OpStats, ratio: float) -> None:
    op.duration *= ratio
    op.samples = [d * ratio for d in op.samples]
    offsets = op.args.get("grads_ready_offset_us")
    if isinstance(offsets, dict):
        op.args = {**op.args, "grads_ready_offset_us": {g: t * ratio for g, t in offsets.items()}}


def _price(op: OpStats, ratios: dict[str, float], *, opens_pass: bool) -> None:
    """Scale a forward/backward op by its probed ratio (a recomputed forward as its forward), and its gap by the
    work between modules (``BETWEEN``), except the gap before a pass's first op (the loop's own work, not the
    model's)."""
    if op.category not in SCALED:
        return
    ratio = ratios.get(base_name(op.name))
    if ratio is None and op.category == "RECOMPUTE":
        ratio = ratios.get("FW." + base_name(op.name).split(".", 1)[1])
    if ratio is not None:
        _scale_op(op, ratio)
    if not opens_pass and op.gap is not None and BETWEEN in ratios:
        op.gap *= ratios[BETWEEN]


def _scaled(model: StepModel, ratios_of: Callable[[int], dict[str, float]]) -> StepModel:
    out = copy.deepcopy(model)
    for rank, ops in out.ops.items():
        ratios = ratios_of(rank)
        opened: set[int] = set()  # the passes whose first op was seen
        for op in ops:
            run = _pass_of(op.name)
            _price(op, ratios, opens_pass=op.category == "FW" and run not in opened)
            if op.category == "FW":
                opened.add(run)
    return out


def _pass_of(name: str) -> int:
    head, sep, count = name.rpartition("#")
    return int(count) if sep and count.isdigit() else 1


def with_amp(model: StepModel, probes: dict[int, RankProbes], amp: str) -> StepModel:
    """``model`` with each probed compute op at its measured time under ``amp`` autocast."""
    return _scaled(model, lambda rank: amp_ratios(probes_of(probes, rank, f"amp={amp}"), amp))


def pass_starts(ops: list[OpStats]) -> list[int]:
    """The index of each forward/backward pass's first op in one rank's step: a forward op after a backward one
    opens a pass (a module called twice in one forward, a shared layer, stays in its pass); [] without forward or
    backward ops."""
    starts: list[int] = []
    backward_seen = True
    for i, op in enumerate(ops):
        if op.category == "BW":
            backward_seen = True
            if not starts:
                starts.append(i)  # a step recorded without forward ops
        elif op.category == "FW" and backward_seen:
            starts.append(i)
            backward_seen = False
    return starts


def step_passes(model: StepModel) -> int:
    """The forward/backward passes a step of ``model`` runs (its micro-batches; 1 at least)."""
    return max((len(pass_starts(ops)) for ops in model.ops.values()), default=1) or 1


def with_micro_batches(model: StepModel, probes: dict[int, RankProbes], k: int) -> StepModel:
    """``model`` with each rank's step rows run as ``k`` forward and backward passes (times from ``batch_ratios``),
    its collectives once, after the last pass's backward; a rank already running ``k`` passes is left as it is.

    Raises:
        UsageError: the run has no probes of smaller batches.
    """
    out = copy.deepcopy(model)
    for rank, ops in out.ops.items():
        passes = len(pass_starts(ops))
        if passes in (0, k):
            continue
        ratios = batch_ratios(probes_of(probes, rank, f"micro_batches={k}"), k, passes)
        out.ops[rank] = _passes(ops, ratios, k)
    return out


def _end(op: OpStats) -> float:
    return op.order + op.duration


def _passes(ops: list[OpStats], ratios: dict[str, float], k: int) -> list[OpStats]:
    """One rank's ops with its passes replaced by ``k`` copies of its last pass (its ops priced by ``ratios``; the
    ops that are not forward or backward, collectives among them, with the last copy only), each copy after the
    first led by the loop's work recorded between the last two passes."""
    starts = pass_starts(ops)
    compute = [i for i, op in enumerate(ops) if op.category in ("FW", "BW")]
    backward = [i for i in compute if ops[i].category == "BW"]
    last = backward[-1] if backward else compute[-1]
    body = ops[starts[-1]:last + 1]
    lead: list[OpStats] = []
    lead_from = body[0].order
    if len(starts) > 1:
        previous = max((i for i in backward if i < starts[-1]), default=starts[-2])
        lead_from = _end(ops[previous])
        lead = [op for op in ops[previous + 1:starts[-1]] if op.category not in (*SCALED, "COMM")]
    out = list(ops[:starts[0]])
    cursor = ops[starts[0]].order
    for j in range(k):
        final = j == k - 1
        if j:
            for op in lead:
                copied = copy.deepcopy(op)
                copied.name = occurrence_name(base_name(op.name), j)
                copied.order = cursor + op.order - lead_from
                out.append(copied)
            cursor += body[0].order - lead_from
        for op in body:
            if op.category not in SCALED and not final:
                continue  # collectives and other work: once, with the last micro-batch
            copied = copy.deepcopy(op)
            copied.order = cursor + op.order - body[0].order
            if op.category in SCALED:
                copied.name = occurrence_name(base_name(op.name), j)
                if op is body[0] and j == 0:
                    copied.gap = ops[starts[0]].gap  # the step's own lead-in to its first pass
                _price(copied, ratios, opens_pass=op is body[0])
            out.append(copied)
        cursor += _end(body[-1]) - body[0].order
    shift = cursor - _end(body[-1])
    for op in ops[last + 1:]:
        moved = copy.deepcopy(op)
        moved.order += shift
        out.append(moved)
    return out


# ---- compile ------------------------------------------------------------------------------------------


def in_region(op_name: str, region: str) -> bool:
    """Whether the op ``FW.<module>`` / ``BW.<module>`` (``#k`` runs alike) times a module inside ``region``."""
    module = base_name(op_name).partition(".")[2]
    return region == ROOT_MODULE or module == region or module.startswith(region + ".")


def compile_probe_of(probes: dict[int, RankProbes], rank: int, region: str) -> Probe:
    """The compile probe of ``region`` on ``rank`` (else on the lowest rank that ran one).

    Raises:
        UsageError: no rank probed ``region`` compiled; the message names the regions probed (or why none was).
    """
    own = probes.get(rank)
    if own is not None and own.compiled(region) is not None:
        return own.compiled(region)
    found = next((probes[r].compiled(region) for r in sorted(probes) if probes[r].compiled(region)), None)
    if found is not None:
        return found
    probed = sorted({c for r in probes.values() for c in r.compiled_regions})
    if probed:
        raise UsageError(f"compile={region}: the probes timed compiled only {', '.join(probed)}; record again with "
                         f"$DPRO_PROBE_COMPILE={region} to price it")
    skipped = [s["why"] for r in sorted(probes) for s in probes[r].skipped if s["probe"].startswith("compile")][:1]
    why = f"it was skipped: {skipped[0]}" if skipped else "the run has none (RUN/probes/)"
    raise UsageError(f"compile={region}: no compile probe prices it ({why})")


def compile_ratios(probe: Probe) -> dict[str, float]:
    """``{"FW": compiled / eager forward, "BW": compiled / eager backward}`` of one compile probe (a phase the probe
    did not time keeps its time)."""
    eager = probe.eager or {}
    return {phase: probe.ops[phase] / eager[phase] for phase in ("FW", "BW")
            if phase in probe.ops and eager.get(phase, 0.0) > 0}


def with_compile(model: StepModel, probes: dict[int, RankProbes], regions: list[str]) -> StepModel:
    """``model`` with the forward and backward ops of each of ``regions`` at their compiled time (``compile_ratios``
    of the region's probe), and the gaps between two ops of one region alike.

    Raises:
        UsageError: a region was not probed compiled.
    """
    out = copy.deepcopy(model)
    for rank, ops in out.ops.items():
        priced = [(region, compile_ratios(compile_probe_of(probes, rank, region))) for region in regions]
        model_ops = _model_ops(probes.get(rank))
        previous: str | None = None  # the region of the rank's previous forward/backward op in the same pass
        last_category = ""
        for op in ops:
            if op.category not in SCALED:
                continue
            if op.category == "FW" and last_category == "BW":
                previous = None  # a new pass: the gap before it is the loop's own work
            last_category = op.category
            region = next((r for r, _ in priced if in_region(op.name, r)), None)
            if model_ops is not None and base_name(op.name) not in model_ops and op.category != "RECOMPUTE":
                region = None  # not a module of the model (an engine's own work after the forward)
            if region is not None:
                ratio = dict(priced)[region].get("BW" if op.category == "BW" else "FW")
                if ratio is not None:
                    _scale_op(op, ratio)
                    if previous == region and op.gap is not None:
                        op.gap *= ratio
            previous = region
    return out


def _model_ops(rank_probes: RankProbes | None) -> set[str] | None:
    """The ops the reference probe timed on the model alone (None without one)."""
    if rank_probes is None or rank_probes.batch is None:
        return None
    reference = rank_probes.find(None, rank_probes.batch)
    return set(reference.ops) if reference is not None else None

