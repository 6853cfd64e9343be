"""The ``torch-ddp`` engine: PyTorch DistributedDataParallel, gradients allreduced in buckets.

Knobs: ``torch.ddp.bucket_cap_mb`` and ``torch.ddp.first_bucket_cap_mb`` (DDP's constructor arguments; the torch
plugin passes them, and ``tensor_groups`` as DDP's ``bucket_cap_mb_list``). DDP fills buckets in gradient-ready
order up to the cap (the first bucket up to its own, smaller cap). Search: every DDP cap that gives a distinct
grouping, replayed; the optimal grouping by dynamic programming; then the common searches.
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
    FIRST_BUCKET_CAP,
    NAME,
    bucket_groups,
    ddp_buckets,
)
from dpro.engines.torch_ddp.traces import optimize_traces, regrouped_traces
from dpro.sim.choices import OptimizeResult, best_grouping, clears, optimize_common
from dpro.sim.whatif import MB, Context, Prediction, predict

__all__ = ["BUCKET_CAP", "CAP_CANDIDATES_MB", "ENGINE", "FIRST_BUCKET_CAP", "best_bucket_cap", "ddp_buckets"]

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
    in_force = float(ctx.knobs.get(BUCKET_CAP) or DEFAULT_BUCKET_CAP_MB)
    same_cap = next((p for c, p in caps if abs(c - in_force) < 1e-9), None) or predict(ctx, {BUCKET_CAP: in_force})
    gain = same_cap.predicted_step_ms - cap_pred.predicted_step_ms
    worth, shown = clears(ctx, gain, same_cap.predicted_step_ms)
    if [len(g) for g in ddp_buckets(ctx.gradients, cap)] == [len(g) for g in ddp_buckets(ctx.gradients, in_force)]:
        explain.append({"knob": BUCKET_CAP, "predicted_gain_ms": 0.0,
                        "why": f"the bucket size in force ({in_force:g} MB) makes the buckets that predict the "
                               f"shortest step of the caps tried ({cap_pred.predicted_step_ms:.2f} ms)"})
    elif worth:
        knobs[BUCKET_CAP] = cap
        current = cap_pred
        explain.append({"knob": BUCKET_CAP, "predicted_gain_ms": gain,
                        "why": f"{cap:g} MB buckets ({len(ddp_buckets(ctx.gradients, cap))} allreduces) predict "
                               f"{shown} against {in_force:g} MB"})
    else:
        explain.append({"knob": BUCKET_CAP, "predicted_gain_ms": 0.0,
                        "why": f"{cap:g} MB buckets predict {cap_pred.predicted_step_ms:.2f} ms against "
                               f"{same_cap.predicted_step_ms:.2f} ms for the {in_force:g} MB in force, {shown}: "
                               f"within what the prediction can tell, so {in_force:g} MB is kept"})
    group_gain = current.predicted_step_ms - grouped.predicted_step_ms
    group_worth, group_shown = clears(ctx, group_gain, current.predicted_step_ms)
    explain.append({"knob": "tensor_groups", "predicted_gain_ms": max(0.0, group_gain),
                    "why": f"optimal grouping by dynamic programming: {len(grouping)} groups of "
                           f"{', '.join(f'{c:.2f}' for c in group_caps)} MB, applied as DDP's bucket_cap_mb_list; "
                           f"{group_shown}" + ("" if group_worth else ": not applied, within the prediction's "
                                                                       "uncertainty")})
    if group_worth:
        knobs["tensor_groups"] = grouping
    # the plugins apply tensor_groups over a bucket cap (DDP's bucket_cap_mb_list), and so does what-if
    return optimize_common(ctx, memory_budget_bytes=memory_budget_bytes, allow_compression=allow_compression,
                           knobs=knobs, explain=explain, baseline=baseline, began=began)


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
    ),
    groups=bucket_groups,
    optimize=search,
    apply="DistributedDataParallel(bucket_cap_mb=, bucket_cap_mb_list=) by the torch plugin (DproCallback, "
          "dpro-launch's auto-attach, dpro.plugins.torch.apply)",
    comm_knobs=(BUCKET_CAP, FIRST_BUCKET_CAP),
    sweeps=sweeps,
    trace_whatif=regrouped_traces,
    trace_optimize=optimize_traces,
)
