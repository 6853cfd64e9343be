"""The ``torch-ddp`` engine: PyTorch DistributedDataParallel, gradients allreduced in buckets.

Knobs: ``torch.ddp.bucket_cap_mb`` and ``torch.ddp.first_bucket_cap_mb`` (DDP's constructor arguments; the torch
plugin passes them, and ``tensor_groups`` as DDP's ``bucket_cap_mb_list``). DDP fills buckets in gradient-ready
order up to the cap (the first bucket up to its own, smaller cap). ``torch.ddp.find_unused_parameters``: with it DDP
searches the autograd graph after every forward (``FW.ddp.post_forward``, timed by the recorder); turning it off
saves that search, safe only when every parameter got a gradient in every recorded step. Search: every DDP cap that
gives a distinct grouping, replayed; the optimal grouping by dynamic programming; the flag; then the common
searches.
"""

from __future__ import annotations

import time
from typing import Any

from dpro.config import Knob, _bucket_cap, _optional
from dpro.engines.base import Engine
from dpro.engines.torch_ddp.buckets import (
    BUCKET_CAP,
    CAP_CANDIDATES_MB,
    DEFAULT_BUCKET_CAP_MB,
    FIND_UNUSED,
    FIRST_BUCKET_CAP,
    NAME,
    POST_FORWARD,
    bucket_groups,
    ddp_buckets,
)
from dpro.engines.torch_ddp.traces import optimize_traces, regrouped_traces
from dpro.errors import ConfigError, UsageError
from dpro.sim.choices import OptimizeResult, best_grouping, clears, optimize_common
from dpro.sim.whatif import MB, Context, Prediction, predict, replay_model, transformed_model

__all__ = ["BUCKET_CAP", "CAP_CANDIDATES_MB", "ENGINE", "FIND_UNUSED", "FIRST_BUCKET_CAP", "best_bucket_cap",
           "ddp_buckets", "unused_gradients"]


def _flag(value: Any, source: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(source, f"must be true or false, got {value!r}", key)
    return value


def unused_gradients(ctx: Context) -> list[str]:
    """The gradients some recorded step did not produce (their parameters took no part in its forward): what
    ``find_unused_parameters`` is for."""
    names = {n for n, _ in ctx.gradients}
    missing: set[str] = set()
    for trace in ctx.run.ranks.values():
        seen: dict[int, set[str]] = {}
        for e in trace.events:
            step = e["args"].get("step")
            if step in ctx.base.steps:
                seen.setdefault(step, set()).update(e["args"].get("grads") or ())
        for step in ctx.base.steps:
            missing |= names - seen.get(step, set())
    return sorted(missing)


def _predict(ctx: Context, knobs: dict[str, Any]) -> Prediction | None:
    """``find_unused_parameters`` off where the run had it on: DDP's search after each forward goes (the rest of its
    post-forward work, tens of µs, goes with it: an upper bound of the saving)."""
    if FIND_UNUSED not in knobs or bool(knobs[FIND_UNUSED]) == bool(ctx.knobs.get(FIND_UNUSED, False)):
        return None
    if knobs[FIND_UNUSED]:
        raise UsageError(f"--set {FIND_UNUSED}=true: the run was recorded without it, so the search it adds after "
                         "every forward was never measured")
    others = {k: v for k, v in knobs.items() if k != FIND_UNUSED}
    model = transformed_model(ctx, others)
    for ops in model.ops.values():
        for op in ops:
            if op.name == POST_FORWARD:
                op.duration, op.samples = 0.0, [0.0 for _ in op.samples]
    return replay_model(ctx, model, knobs)

def best_bucket_cap(ctx: Context, extra_caps_mb: list[float] = ()) -> list[tuple[float, Prediction]]:
    """Replay every candidate DDP bucket cap (one per distinct grouping, the largest cap that gives it);
    best first."""
    seen: dict[tuple[int, ...], float] = {}
    results = []
    extra = {round(c, 2) for c in extra_caps_mb if c >= 0.01}
    for cap in sorted(set(CAP_CANDIDATES_MB) | extra, reverse=True):
        shape = tuple(len(g) for g in ddp_buckets(ctx.gradients, cap))
        if shape in seen:
            continue
        seen[shape] = cap
        results.append((cap, predict(ctx, {BUCKET_CAP: cap})))
    return sorted(results, key=lambda cp: (cp[1].predicted_step_ms, cp[0]))


def search(ctx: Context, *, memory_budget_bytes: int | None = None, allow_compression: bool = False) -> OptimizeResult:
    """DDP's bucket cap (every distinct grouping replayed), the optimal grouping (as ``tensor_groups``, applied
    through ``bucket_cap_mb_list``), then compression and recomputation."""
    began = time.perf_counter()
    baseline = predict(ctx, {})
    explain: list[dict[str, Any]] = []
    knobs: dict[str, Any] = {}
    current = baseline
    grouping, _ = best_grouping(ctx)
    grouped = predict(ctx, {"tensor_groups": grouping})
    group_caps = [sum(dict(ctx.gradients)[g] for g in grp) / MB for grp in grouping]
    caps = best_bucket_cap(ctx, extra_caps_mb=[max(group_caps)])
    cap, cap_pred = caps[0]
    in_force, first, in_force_knobs = _caps_in_force(ctx)
    # a cap written in a config applies to DDP's first bucket too: where the run kept DDP's smaller first bucket, the
    # setting in force is not the candidate of the same cap
    same_cap = next((p for c, p in caps if first is None and abs(c - in_force) < 1e-9), None) or predict(
        ctx, in_force_knobs)
    gain = same_cap.predicted_step_ms - cap_pred.predicted_step_ms
    worth, shown = clears(ctx, gain, same_cap.predicted_step_ms, change=(in_force_knobs, {BUCKET_CAP: cap}))
    written = f"{in_force:g} MB" + (f" (first bucket {first:g} MB)" if first is not None else "")
    if ddp_buckets(ctx.gradients, cap) == ddp_buckets(ctx.gradients, in_force, first):
        explain.append({"knob": BUCKET_CAP, "predicted_gain_ms": 0.0,
                        "why": f"the bucket size in force ({written}) makes the buckets that predict the "
                               f"shortest step of the caps tried ({cap_pred.predicted_step_ms:.2f} ms)"})
    elif worth:
        knobs[BUCKET_CAP] = cap
        current = cap_pred
        explain.append({"knob": BUCKET_CAP, "predicted_gain_ms": gain,
                        "why": f"{cap:g} MB buckets ({len(ddp_buckets(ctx.gradients, cap))} allreduces) predict "
                               f"{shown} against {written}"})
    else:
        explain.append({"knob": BUCKET_CAP, "predicted_gain_ms": 0.0,
                        "why": f"{cap:g} MB buckets predict {cap_pred.predicted_step_ms:.2f} ms against "
                               f"{same_cap.predicted_step_ms:.2f} ms for the {written} in force, {shown}: "
                               f"within what the prediction can tell, so {written} is kept"})
    group_gain = current.predicted_step_ms - grouped.predicted_step_ms
    group_worth, group_shown = clears(ctx, group_gain, current.predicted_step_ms,
                                      change=(dict(knobs), {**knobs, "tensor_groups": grouping}))
    explain.append({"knob": "tensor_groups", "predicted_gain_ms": max(0.0, group_gain),
                    "why": f"optimal grouping by dynamic programming: {len(grouping)} groups of "
                           f"{', '.join(f'{c:.2f}' for c in group_caps)} MB, applied as DDP's bucket_cap_mb_list; "
                           f"{group_shown}" + ("" if group_worth else ": not applied, within the prediction's "
                                                                       "uncertainty")})
    if group_worth:
        knobs["tensor_groups"] = grouping
    if ctx.knobs.get(FIND_UNUSED):
        explain.append(_find_unused_choice(ctx, knobs))
    # the plugins apply tensor_groups over a bucket cap (DDP's bucket_cap_mb_list), and so does what-if
    return optimize_common(ctx, memory_budget_bytes=memory_budget_bytes, allow_compression=allow_compression,
                           knobs=knobs, explain=explain, baseline=baseline, began=began)


def _caps_in_force(ctx: Context) -> tuple[float, float | None, dict[str, Any]]:
    """The run's bucket cap, its first bucket's cap where DDP kept one of its own (None: the cap applies to every
    bucket), and the knobs that say both."""
    cap = float(ctx.knobs.get(BUCKET_CAP) or DEFAULT_BUCKET_CAP_MB)
    first = ctx.knobs.get(FIRST_BUCKET_CAP)
    first = float(first) if isinstance(first, (int, float)) and first > 0 and abs(first - cap) > 1e-9 else None
    return cap, first, {BUCKET_CAP: cap, **({FIRST_BUCKET_CAP: first} if first is not None else {})}


def _find_unused_choice(ctx: Context, knobs: dict[str, Any]) -> dict[str, Any]:
    """Whether to turn ``find_unused_parameters`` off (sets it in ``knobs`` when it clears the uncertainty); the
    explanation."""
    unused = unused_gradients(ctx)
    if unused:
        return {"knob": FIND_UNUSED, "predicted_gain_ms": 0.0,
                "why": f"kept on: {len(unused)} parameter(s) got no gradient in some recorded step "
                       f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}), and DDP without it would wait "
                       "for them forever"}
    before = predict(ctx, dict(knobs)).predicted_step_ms
    after = predict(ctx, {**knobs, FIND_UNUSED: False}).predicted_step_ms
    worth, shown = clears(ctx, before - after, before)
    if worth:
        knobs[FIND_UNUSED] = False
    return {"knob": FIND_UNUSED, "predicted_gain_ms": before - after if worth else 0.0,
            "why": f"every parameter got a gradient in every recorded step, so DDP's search for unused ones after "
                   f"each forward can go: {shown}" + ("" if worth else ": within what the prediction can tell, kept")}


def sweeps(ctx: Context) -> list[tuple[str, list[Any]]]:
    """The bucket cap, over the caps the search tries and the one in force (what-if curves of ``dpro report``)."""
    in_force = float(ctx.knobs.get(BUCKET_CAP) or DEFAULT_BUCKET_CAP_MB)
    return [(BUCKET_CAP, sorted({*CAP_CANDIDATES_MB, in_force}))]


ENGINE = Engine(
    name=NAME,
    doc="PyTorch DistributedDataParallel (gloo, nccl): gradients allreduced in buckets during backward",
    knobs=(
        Knob(BUCKET_CAP, "DDP gradient bucket size in MiB (positive)", _bucket_cap, default=DEFAULT_BUCKET_CAP_MB,
             engine=NAME),
        Knob(FIRST_BUCKET_CAP, "size of DDP's first bucket in MiB, or null for DDP's choice", _optional(_bucket_cap),
             engine=NAME),
        Knob(FIND_UNUSED, "DDP searches the autograd graph after each forward for parameters without a gradient "
                          "(false: no search; needs every parameter used every step)", _flag, default=False,
             engine=NAME),
    ),
    predict=_predict,
    groups=bucket_groups,
    optimize=search,
    apply="DistributedDataParallel(bucket_cap_mb=, bucket_cap_mb_list=, find_unused_parameters=) by the torch "
          "plugin (DproCallback, dpro-launch's auto-attach, dpro.plugins.torch.apply); amp as autocast around the "
          "model's forward; micro_batches as a Trainer's gradient accumulation (no_sync before the last; a plain "
          "loop changes its code)",
    comm_knobs=(BUCKET_CAP, FIRST_BUCKET_CAP),
    sweeps=sweeps,
    trace_whatif=regrouped_traces,
    trace_optimize=optimize_traces,
)
