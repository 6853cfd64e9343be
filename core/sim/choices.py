"""Choosing among configurations by replay: the building blocks every engine's search uses (``dpro.engines``) and
the searches every engine shares.

- ``clears`` / ``uncertainty_ms``: a change is recommended only when its predicted gain clears the prediction's
  uncertainty (the recorded steps' spread plus what a what-if misses by), and holds across the interference the
  recorder's probe cannot rule out (``worst_gain_ms``).
- ``best_grouping``: the grouping of the ordered gradients into allreduce groups that finishes communication first,
  by dynamic programming over the gradient list against the fitted cost model (exact for that model), then
  confirmed by a full replay.
- ``best_recompute``: the modules to checkpoint that meet a memory budget with the least replayed step time; when no
  choice meets the budget it says so and gives the smallest reachable peak.
- ``optimize_common``: the searches every engine shares, after its own (gradient compression, priced and applied
  only when the caller allows it, since it changes numerics; recomputation under a budget).
- ``probed_choices``: after every search, the knobs the recorder's probe passes price (``dpro.sim.probes``):
  micro-batches weighed against recomputation under a memory budget (the cheaper way that fits), and autocast
  precision, only when the caller allows it (it changes numerics) and only where it measured faster; and compiling
  the regions the compile probe timed, only where it measured faster beyond the prediction's uncertainty.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from dpro.config import MAX_MICRO_BATCHES
from dpro.errors import UsageError
from dpro.io.load import run_step_times_ms
from dpro.sim.interference import Interference
from dpro.sim.probes import step_passes
from dpro.sim.whatif import MB, Context, Prediction, calibrate, peak_memory, predict

__all__ = [
    "MIN_GAIN",
    "WHATIF_ERROR",
    "OptimizeResult",
    "RecomputeChoice",
    "best_grouping",
    "best_recompute",
    "clears",
    "gradient_ready_us",
    "optimize_common",
    "probed_choices",
    "recompute_candidates",
    "step_stderr_ms",
    "uncertainty_ms",
    "worst_gain_ms",
]


MIN_GAIN = 0.03  # a change must be predicted to save 3% to be recommended: smaller gains are within what-if error
WHATIF_ERROR = 0.05  # what a what-if on a job not tuned on misses by (median, issue 35's measurements): every
# prediction carries it beside the spread of the recorded steps


def step_stderr_ms(ctx: Context) -> float:
    """The standard error of the recorded steps' median (from their interquartile range; the slowest rank's step,
    step by step); 0 with fewer than 4 steps."""
    steps = sorted(run_step_times_ms(ctx.run))
    if len(steps) < 4:
        return 0.0
    iqr = steps[(3 * len(steps)) // 4] - steps[len(steps) // 4]
    return 1.253 * (iqr / 1.349) / math.sqrt(len(steps))  # the median's standard error, normal steps


def uncertainty_ms(ctx: Context, predicted_ms: float) -> float:
    """How far a predicted step of ``predicted_ms`` may be off: ``step_stderr_ms`` plus ``WHATIF_ERROR`` of it."""
    return step_stderr_ms(ctx) + WHATIF_ERROR * predicted_ms


def clears(ctx: Context, gain_ms: float, predicted_ms: float, floor: float = MIN_GAIN,
           change: tuple[dict[str, Any], dict[str, Any]] | None = None) -> tuple[bool, str]:
    """Whether a predicted gain is worth recommending (beyond ``floor`` of the step and the prediction's
    uncertainty), and the gain as people read it: ``+4.6 ms +/- 6.0 ms``. With ``change`` (the knobs before and
    after), the gain must also hold at each end of the interference the recorder measured (``worst_gain_ms``): a
    change that adds overlap looks free where the fit is too uncertain to apply, and costs where it is real."""
    margin = uncertainty_ms(ctx, predicted_ms)
    worst, at = worst_gain_ms(ctx, *change) if change is not None else (gain_ms, None)
    shown = f"{gain_ms:+.2f} ms +/- {margin:.2f} ms"
    if at is not None and worst < gain_ms - 0.005:
        shown += f", {worst:+.2f} ms if {_end_words(ctx.interference, at)} (what the recorder's probes cannot rule out)"
    return min(gain_ms, worst) > max(floor * predicted_ms, margin), shown


def _end_words(central: Interference, end: Interference) -> str:
    """An end of the interference (``Interference.ends``) as people read it."""
    words = []
    if central.plausible():
        words.append(f"overlapped compute runs {100.0 * end.slowdown:.0f}% slower" if end.slowdown > 0 else
                     "overlap slows no compute")
    if end.transfer is not None and central.transfer is not None:
        words.append(f"a transfer beside compute waits {end.transfer.stall_us / 1000.0:.1f} ms, then takes "
                     f"{1.0 + end.transfer.slowdown:.1f}x as long")
    return " and ".join(words)


def worst_gain_ms(ctx: Context, before: dict[str, Any], after: dict[str, Any]) -> tuple[float, Interference | None]:
    """The smallest gain of ``after`` over ``before`` at the ends of the interference the recorder's probes measured
    (``Interference.ends``; the comm model calibrated again where the transfers' stretch moved), and the end that
    gives it; (inf, None) where nothing was measured."""
    worst, at = math.inf, None
    for end in ctx.interference.ends():
        other = dataclasses.replace(ctx, interference=end, cache={}, on_predict=None)
        if end.transfer != ctx.interference.transfer and ctx.comm_fitted is not None:
            other = calibrate(dataclasses.replace(other, comm=ctx.comm_fitted))
        gain = predict(other, before).predicted_step_ms - predict(other, after).predicted_step_ms
        if gain < worst:
            worst, at = gain, end
    return worst, at


def gradient_ready_us(ctx: Context) -> dict[str, float]:
    """When each gradient is ready, relative to the step start: the end of the BW op that produces it,
    on the slowest rank (a collective waits for the last rank)."""
    ready: dict[str, float] = {}
    for ops in ctx.base.ops.values():
        for op in ops:
            if op.category == "BW":
                for g in op.args.get("grads", []):
                    ready[g] = max(ready.get(g, 0.0), op.order + op.duration)
    fallback = max(ready.values(), default=0.0)
    return {name: ready.get(name, fallback) for name, _ in ctx.gradients}


def best_grouping(ctx: Context, ready: dict[str, float] | None = None) -> tuple[list[list[str]], float]:
    """Exact DP: split the ready-ordered gradients into contiguous groups minimising the time the last
    allreduce ends, when group k starts at max(its last gradient ready, group k-1 done).

    Returns the groups and the modelled end of communication (µs from step start).
    """
    ready = ready or gradient_ready_us(ctx)
    names = [n for n, _ in ctx.gradients]
    sizes = [b for _, b in ctx.gradients]
    n = len(names)
    prefix = list(itertools.accumulate(sizes, initial=0))
    cost = ctx.comm.allreduce_us
    launch = _launch_gap(ctx)
    ready_at = [0.0] + [max(ready[names[i]] for i in range(k)) for k in range(1, n + 1)]
    done = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i):
            t = max(ready_at[i] + launch, done[j]) + cost(prefix[i] - prefix[j])
            if t < done[i]:
                done[i], cut[i] = t, j
    groups = []
    i = n
    while i > 0:
        groups.append(names[cut[i]:i])
        i = cut[i]
    return groups[::-1], done[n]


def _launch_gap(ctx: Context) -> float:
    gaps = [op.gap for ops in ctx.base.ops.values() for op in ops if op.category == "COMM" and op.gap is not None]
    return statistics.median(gaps) if gaps else 0.0


def recompute_candidates(ctx: Context) -> list[str]:
    """Modules worth checkpointing: those at depth 1-2 of the module tree holding saved activations."""
    acts = ctx.memory.activation_bytes
    out = set()
    for name in acts:
        parts = name.split(".")
        for depth in (1, 2):
            if len(parts) >= depth:
                out.add(".".join(parts[:depth]))
    return sorted(m for m in out if sum(acts[s] for s in ctx.memory.subtree(m) if s != m) > 0)


@dataclass
class RecomputeChoice:
    modules: list[str]
    prediction: Prediction | None
    feasible: bool
    smallest_peak_bytes: int
    note: str = ""


def best_recompute(ctx: Context, budget_bytes: int, base_knobs: dict[str, Any], keep: int = 5) -> RecomputeChoice:
    """Modules to checkpoint so the peak fits ``budget_bytes`` with the least replayed step time."""
    mem = ctx.memory
    base_peak = mem.peak_bytes(())
    if base_peak <= budget_bytes:
        return RecomputeChoice([], None, True, base_peak, "the run already fits the budget")
    cands = recompute_candidates(ctx)
    fw_cost = {m: _forward_cost(ctx, m) for m in cands}
    feasible: list[tuple[float, list[str]]] = []
    smallest = base_peak
    subsets: list[tuple[str, ...]]
    if len(cands) <= 12:
        subsets = [s for k in range(1, len(cands) + 1) for s in itertools.combinations(cands, k)]
    else:  # greedy by bytes freed per µs of extra forward
        order = sorted(cands, key=lambda m: -_freed(mem, m) / max(fw_cost[m], 1.0))
        subsets = [tuple(order[:k]) for k in range(1, len(order) + 1)]
    for subset in subsets:
        if any(a != b and b.startswith(a + ".") for a in subset for b in subset):
            continue  # nested choices
        peak = mem.peak_bytes(subset)
        smallest = min(smallest, peak)
        if peak <= budget_bytes:
            feasible.append((sum(fw_cost[m] for m in subset), list(subset)))
    if not feasible:
        return RecomputeChoice([], None, False, smallest,
                               f"no choice of modules to recompute meets the budget; the smallest reachable "
                               f"peak is {smallest / MB:.1f} MiB")
    feasible.sort(key=lambda cm: cm[0])
    confirmed = [(predict(ctx, {**base_knobs, "recompute": mods}), mods) for _, mods in feasible[:keep]]
    prediction, modules = min(confirmed, key=lambda pm: pm[0].predicted_step_ms)
    return RecomputeChoice(modules, prediction, True, smallest)


def _forward_cost(ctx: Context, module: str) -> float:
    names = {f"FW.{m}" for m in ctx.memory.subtree(module)} | {f"FW.{module}"}
    return max(sum(op.duration for op in ops if op.name in names) for ops in ctx.base.ops.values())


def _freed(mem: Any, module: str) -> int:
    return sum(mem.activation_bytes[s] for s in mem.subtree(module) if s != module)


@dataclass
class OptimizeResult:
    knobs: dict[str, Any]
    baseline: Prediction
    predicted: Prediction
    explain: list[dict[str, Any]] = field(default_factory=list)
    search_seconds: float = 0.0
    measured_step_ms: float = 0.0


def optimize_common(ctx: Context, *, memory_budget_bytes: int | None = None, allow_compression: bool = False,
                    knobs: dict[str, Any] | None = None, explain: list[dict[str, Any]] | None = None,
                    baseline: Prediction | None = None, began: float | None = None) -> OptimizeResult:
    """The searches every engine shares, after the engine's own (``knobs`` and ``explain`` so far):
    gradient compression (priced, applied only when allowed) and recomputation under a budget."""
    began = time.perf_counter() if began is None else began
    baseline = baseline or predict(ctx, {})
    knobs = dict(knobs or {})
    explain = list(explain or [])
    current = predict(ctx, knobs) if knobs else baseline
    comm_knobs = {k: v for k, v in knobs.items() if k != "tensor_groups"}
    if ctx.base.transfer:
        compressed = predict(ctx, {**comm_knobs, "gradient_compression": "fp16"})
        c_gain = current.predicted_step_ms - compressed.predicted_step_ms
        worth, shown = clears(ctx, c_gain, current.predicted_step_ms, floor=0.05)
        if worth and allow_compression:
            knobs["gradient_compression"] = "fp16"
            current = compressed
            explain.append({"knob": "gradient_compression", "predicted_gain_ms": c_gain,
                            "why": f"fp16 allreduce halves the bytes on the wire: {shown}"})
        else:
            explain.append({"knob": "gradient_compression", "predicted_gain_ms": max(0.0, c_gain),
                            "why": "not applied: " + ("fp16 compression changes numerics; pass --allow-compression"
                                                      if worth else f"{shown} is within what the prediction can "
                                                                    "tell (or under 5% of the step)")})
    if memory_budget_bytes is not None:
        choice = best_recompute(ctx, memory_budget_bytes, {k: v for k, v in knobs.items() if k != "tensor_groups"})
        if choice.modules and choice.prediction is not None:
            knobs["recompute"] = choice.modules
            explain.append({"knob": "recompute", "predicted_gain_ms": current.predicted_step_ms
                            - choice.prediction.predicted_step_ms,
                            "why": f"checkpointing {', '.join(choice.modules)} brings the peak to "
                                   f"{choice.prediction.predicted_peak_memory_bytes / MB:.1f} MiB "
                                   f"(budget {memory_budget_bytes / MB:.1f} MiB) at the least replayed cost"})
        else:
            explain.append({"knob": "recompute", "predicted_gain_ms": 0.0, "why": choice.note})
    final = predict(ctx, knobs)
    return OptimizeResult(knobs=knobs, baseline=baseline, predicted=final, explain=explain,
                          search_seconds=time.perf_counter() - began,
                          measured_step_ms=ctx.base.measured_step_us / 1000.0)


AMPS = ("bf16", "fp16")
APPLYING_MICRO_BATCHES = ("; a framework with its own gradient accumulation (a transformers.Trainer under dpro-launch) "
                          "gets it without a code change, a plain training loop splits its batch itself "
                          "(dpro-launch says how)")


def probed_choices(ctx: Context, result: OptimizeResult, *, memory_budget_bytes: int | None = None,
                   allow_precision: bool = False) -> OptimizeResult:
    """``result`` (an engine's search) weighed against the knobs only the probe passes price: under a memory budget,
    micro-batches in place of recomputation where they fit at a shorter replayed step; then autocast precision when
    ``allow_precision`` and it clears the uncertainty (never where the probes measured it slower); then compiled
    regions where they clear it. A run without probes comes back as it was, with a note when either was asked
    for."""
    if not ctx.probes:
        if memory_budget_bytes is not None or allow_precision:
            result.explain.append({"knob": "micro_batches / amp", "predicted_gain_ms": 0.0,
                                   "why": "not priced: the run has no probe passes (RUN/probes/)"})
        return result
    knobs, current = dict(result.knobs), result.predicted
    explain = list(result.explain)
    if memory_budget_bytes is not None:
        knobs, current, note = _weigh_micro_batches(ctx, knobs, current, memory_budget_bytes)
        explain.append(note)
    knobs, current, note = _precision(ctx, knobs, current, allow_precision, memory_budget_bytes)
    explain.append(note)
    knobs, current, note = _compiled(ctx, knobs, current)
    explain.append(note)
    return OptimizeResult(knobs=knobs, baseline=result.baseline, predicted=current, explain=explain,
                          search_seconds=result.search_seconds, measured_step_ms=result.measured_step_ms)


def _micro_batch_counts(ctx: Context) -> list[int]:
    """k = 2, 4, 8, ... up to the step's rows (a micro-batch has a row at least), beyond the passes it runs."""
    passes = step_passes(ctx.base)
    rows = min((p.batch for p in ctx.probes.values() if p.batch), default=1) * passes
    counts, k = [], 2
    while k <= min(rows, MAX_MICRO_BATCHES):
        if k > passes:
            counts.append(k)
        k *= 2
    return counts


def _weigh_micro_batches(ctx: Context, knobs: dict[str, Any], current: Prediction,
                         budget: int) -> tuple[dict[str, Any], Prediction, dict[str, Any]]:
    """The fewest micro-batches whose peak fits ``budget`` (without recomputation), kept when its replayed step is
    shorter than the search's answer or the search found no way under the budget."""
    fits_already = current.predicted_peak_memory_bytes <= budget
    if fits_already and not knobs.get("recompute"):
        return knobs, current, {"knob": "micro_batches", "predicted_gain_ms": 0.0,
                                "why": "not needed: the run fits the memory budget as it is"}
    plain = {k: v for k, v in knobs.items() if k != "recompute"}
    for k in _micro_batch_counts(ctx):
        try:
            if peak_memory(ctx, {**plain, "micro_batches": k}) > budget:
                continue
            split = predict(ctx, {**plain, "micro_batches": k})
        except UsageError as err:
            return knobs, current, {"knob": "micro_batches", "predicted_gain_ms": 0.0,
                                    "why": f"not priced: {err}"}
        gain = current.predicted_step_ms - split.predicted_step_ms
        other = (f"recomputing {', '.join(knobs['recompute'])}" if knobs.get("recompute") else "the search's answer")
        if not fits_already or gain > 0:
            return {**plain, "micro_batches": k}, split, {
                "knob": "micro_batches", "predicted_gain_ms": gain,
                "why": f"{k} micro-batches bring the peak to {split.predicted_peak_memory_bytes / MB:.1f} MiB "
                       f"(budget {budget / MB:.1f} MiB) at {split.predicted_step_ms:.2f} ms a step, "
                       + (f"{gain:+.2f} ms against {other}" if fits_already else "where nothing else fit")
                       + APPLYING_MICRO_BATCHES}
        return knobs, current, {
            "knob": "micro_batches", "predicted_gain_ms": 0.0,
            "why": f"{k} micro-batches would fit the budget at {split.predicted_step_ms:.2f} ms a step, slower than "
                   f"{other} ({current.predicted_step_ms:.2f} ms)"}
    return knobs, current, {"knob": "micro_batches", "predicted_gain_ms": 0.0,
                            "why": "no number of micro-batches the batch allows meets the budget"}


def _precision(ctx: Context, knobs: dict[str, Any], current: Prediction, allowed: bool,
               budget: int | None) -> tuple[dict[str, Any], Prediction, dict[str, Any]]:
    """The fastest autocast precision the probes measured (within ``budget``, its cast weights counted), applied
    when ``allowed`` and its gain clears the uncertainty; a precision measured slower is never recommended."""
    priced: list[tuple[float, str, Prediction]] = []
    refused = []
    for amp in AMPS:
        try:
            pred = predict(ctx, {**knobs, "amp": amp})
        except UsageError as err:
            refused.append(f"{amp}: {err}")
            continue
        if budget is not None and pred.predicted_peak_memory_bytes > budget:
            refused.append(f"{amp}: its peak {pred.predicted_peak_memory_bytes / MB:.1f} MiB is over the budget")
            continue
        priced.append((current.predicted_step_ms - pred.predicted_step_ms, amp, pred))
    if not priced:
        return knobs, current, {"knob": "amp", "predicted_gain_ms": 0.0,
                                "why": "not priced: " + "; ".join(refused)}
    gain, amp, pred = max(priced)
    measured = ", ".join(f"{a} {current.predicted_step_ms - g:.2f} ms" for g, a, _ in sorted(priced,
                                                                                          key=lambda p: p[1]))
    if gain <= 0:
        return knobs, current, {"knob": "amp", "predicted_gain_ms": 0.0,
                                "why": f"not applied: autocast measured slower here ({measured} against "
                                       f"{current.predicted_step_ms:.2f} ms)"}
    worth, shown = clears(ctx, gain, current.predicted_step_ms)
    if worth and allowed:
        return {**knobs, "amp": amp}, pred, {"knob": "amp", "predicted_gain_ms": gain,
                                             "why": f"{amp} autocast, priced by the probe passes ({measured}): "
                                                    f"{shown}; it changes numerics"}
    return knobs, current, {"knob": "amp", "predicted_gain_ms": 0.0,
                            "why": "not applied: " + ("autocast changes numerics; pass --allow-precision "
                                                      f"({amp}: {shown})" if worth else
                                                      f"{amp}'s {shown} is within what the prediction can tell")}


def _compiled(ctx: Context, knobs: dict[str, Any], current: Prediction) -> tuple[dict[str, Any], Prediction,
                                                                                dict[str, Any]]:
    """The compile probe's region (one, the fastest) compiled (torch.compile; Gluon's hybridize), when its predicted
    gain clears the uncertainty; a region measured slower compiled is never recommended."""
    regions = sorted({c for r in ctx.probes.values() for c in r.compiled_regions})
    if not regions:
        why = next((s["why"] for r in ctx.probes.values() for s in r.skipped if s["probe"].startswith("compile")),
                   "the run has no compile probe")
        return knobs, current, {"knob": "compile", "predicted_gain_ms": 0.0, "why": f"not priced: {why}"}
    priced, refused = [], []
    for region in regions:
        try:
            pred = predict(ctx, {**knobs, "compile": [region]})
        except UsageError as err:
            refused.append(str(err))
            continue
        priced.append((current.predicted_step_ms - pred.predicted_step_ms, region, pred))
    if not priced:
        return knobs, current, {"knob": "compile", "predicted_gain_ms": 0.0, "why": "not priced: " + "; ".join(refused)}
    gain, region, pred = max(priced)
    if gain <= 0:
        return knobs, current, {"knob": "compile", "predicted_gain_ms": 0.0,
                                "why": f"not applied: {region} measured slower compiled ({pred.predicted_step_ms:.2f} "
                                       f"ms against {current.predicted_step_ms:.2f} ms)"}
    worth, shown = clears(ctx, gain, current.predicted_step_ms)
    if not worth:
        return knobs, current, {"knob": "compile", "predicted_gain_ms": 0.0,
                                "why": f"not applied: compiling {region}: {shown} is within what the prediction "
                                       "can tell"}
    return {**knobs, "compile": [region]}, pred, {"knob": "compile", "predicted_gain_ms": gain,
                                                  "why": f"compiling {region}, priced by the compile probe: "
                                                         f"{shown}"}
