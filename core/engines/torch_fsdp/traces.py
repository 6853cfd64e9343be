"""``reshard_after_forward`` priced on the profiler traces of an FSDP job.

With resharding (FSDP2's default for every unit but the root) a unit frees its gathered parameters after its
forward and gathers them again before its backward: FSDP's ``FSDP::all_gather (i)`` inside ``FSDP::pre_backward
(i)`` (or ``FSDP::backward_prefetch``), with its copy-out, and the collective on the backend's thread. Without it
the parameters stay gathered from the forward to the backward: those all-gathers go, and each rank holds the
units' gathered parameters through the step. The what-if removes, from the traces' graph (every op at its mean),
the time the backward spent in those scopes and the collectives they ran.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from typing import Any

import numpy as np

from dpro.dag.graph import Graph
from dpro.dag.kineto import KinetoGraphInfo
from dpro.engines.torch_fsdp.knobs import NAME, RESHARD
from dpro.errors import UsageError
from dpro.io.kineto import KinetoTrace
from dpro.sim.choices import MIN_GAIN
from dpro.sim.kineto import mean_step_graph, measured_step_ms, op_keys, replayed_step_ms

__all__ = ["backward_gathers", "optimize_resharding", "resharded_traces"]

BACKWARD_SCOPES = ("FSDP::pre_backward", "FSDP::backward_prefetch")
GATHER_SCOPES = ("FSDP::all_gather", "FSDP::all_gather_copy_out")   # ... (i): the unit's index


def _within(e: dict[str, Any], outer: list[tuple[float, float]]) -> bool:
    return any(a <= e["ts"] and e["ts"] + e["dur"] <= b + 1e-3 for a, b in outer)


def backward_gathers(trace: KinetoTrace) -> tuple[list[tuple[float, float]], list[dict[str, Any]]]:
    """The spans of FSDP's all-gather scopes inside its backward hooks, and the backend's collectives inside
    them (a CPU backend runs them on its own threads: the collective starts inside the scope's span)."""
    scopes = [e for e in trace.annotations if str(e.get("name", "")).startswith(BACKWARD_SCOPES)]
    outer = [(e["ts"], e["ts"] + e["dur"]) for e in scopes]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace.annotations
                   if str(e.get("name", "")).startswith(GATHER_SCOPES) and _within(e, outer))
    merged: list[tuple[float, float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    gathers = [e for e in trace.cpu_comms if "all_gather" in str(e.get("name", ""))
               and any(a <= e["ts"] <= b for a, b in merged)]
    return merged, gathers


def _gathered_bytes(e: dict[str, Any], world_size: int) -> int:
    dims = ((e.get("args") or {}).get("Input Dims") or [[0]])[0] or [0]
    return int(np.prod(dims)) * 4 * world_size  # the shard's float32 elements, gathered from every rank


def resharded_traces(traces: list[KinetoTrace], info: KinetoGraphInfo, base: Graph,
                     knobs: dict[str, Any]) -> tuple[Graph, KinetoGraphInfo, dict[str, Any]]:
    """The engine's ``trace_whatif``: ``base`` (``info``'s graph, every op at its mean) under
    ``torch.fsdp.reshard_after_forward``, and what the change saw.

    Raises:
        UsageError: a GPU trace (its all-gather kernels are not matched yet), or resharding asked of traces that
            recorded none (the all-gathers it would add were never measured).
    """
    wanted = knobs[RESHARD]
    if any(t.gpu_ops for t in traces):
        raise UsageError(f"--set {RESHARD}: priced on CPU traces only for now (the GPU traces' all-gather kernels "
                         "are not matched to FSDP's scopes yet)")
    found = {t.rank if t.rank is not None else k: backward_gathers(t) for k, t in enumerate(traces)}
    recorded = any(gathers for _, gathers in found.values())
    if wanted and not recorded:
        raise UsageError(f"--set {RESHARD}=true: the traces ran without resharding (no all-gather in the backward), "
                         "so the all-gathers it would add were never measured; record the job with resharding")
    facts: dict[str, Any] = {"recorded_reshard_after_forward": recorded,
                             "backward_all_gathers": sum(len(g) for _, g in found.values())}
    if wanted or not recorded:
        return base, info, {**facts, "removed_ms_per_step": 0.0, "unsharded_bytes_kept": 0}
    removed_by_node: dict[int, float] = defaultdict(float)
    for rank, (spans, gathers) in found.items():
        trace = next(t for k, t in enumerate(traces) if (t.rank if t.rank is not None else k) == rank)
        for e in trace.cpu_ops:
            gid = info.node_at.get((rank, f"r{rank}/host{e.get('tid')}", e["ts"]))
            if gid is None:
                continue
            end = e["ts"] + e["dur"]
            cut = sum(max(0.0, min(b, end) - max(a, e["ts"])) for a, b in spans)
            if cut > 0:
                removed_by_node[gid] += cut
        for e in gathers:
            gid = info.node_at.get((rank, f"r{rank}/comm{e.get('tid')}", e["ts"]))
            if gid is not None:
                removed_by_node[gid] = float("inf")  # the collective goes
    keys = op_keys(base)
    per_key: dict[tuple, list[float]] = defaultdict(list)
    for node, cut in removed_by_node.items():
        per_key[keys[node]].append(cut)
    duration = base.duration.copy()
    gone = set()
    for node, key in enumerate(keys):
        cuts = per_key.get(key)
        if not cuts:
            continue
        if any(c == float("inf") for c in cuts):
            duration[node] = 0.0
            gone.add(node)
        else:
            duration[node] = max(0.0, duration[node] - statistics.fmean(cuts))
    for node in range(base.size):  # a collective's transfer whose every arrival went
        if base.category[node] == "XFER":
            arrivals = [int(p) for p in base.preds(node) if base.category[int(p)] == "COMM"]
            if arrivals and all(p in gone for p in arrivals):
                duration[node] = 0.0
    steps = max(1, len(info.steps))
    saved = float(np.sum(base.duration - duration)) / steps / max(1, len(found)) / 1000.0
    world = max([t.world_size or 1 for t in traces] + [len(traces)])
    # what stays gathered from forward to backward: the parameters the backward gathered again, per step
    kept = max((sum(_gathered_bytes(e, world) for e in g) // steps for _, g in found.values()), default=0)
    return dataclasses.replace(base, duration=duration), info, {
        **facts, "removed_ms_per_step": saved, "unsharded_bytes_kept": int(kept)}


def recorded_peak_bytes(meta: dict[str, Any] | None) -> int | None:
    """The largest of the ranks' peak memory the FSDP recorder measured (run.json's ``fsdp.peak_memory_bytes``);
    None when the run has none (traces alone, or a window that did not end)."""
    peaks = ((meta or {}).get("fsdp") or {}).get("peak_memory_bytes")
    if not isinstance(peaks, list) or not peaks or not all(isinstance(v, int) and v >= 0 for v in peaks):
        return None
    return max(peaks)


def optimize_resharding(traces: list[KinetoTrace], memory_budget_bytes: int | None = None,
                        meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``dpro optimize`` of an FSDP job's traces: the recorded resharding against keeping the units' parameters
    gathered from forward to backward (priced only from traces that reshard: the other way round the all-gathers
    were never measured). The change is recommended when it is predicted to save at least ``MIN_GAIN`` of the
    step and, under ``memory_budget_bytes``, when the recorded peak (``meta``: run.json, ``recorded_peak_bytes``)
    plus the parameters it keeps gathered fits the budget; its memory cost is said.

    Raises:
        UsageError: traces without FSDP's annotations (not an FSDP job's).
    """
    if not any(str(e.get("name", "")).startswith("FSDP::") for t in traces for e in t.annotations):
        raise UsageError(f"{traces[0].path}: no FSDP annotations (FSDP::pre_forward ...): not an FSDP job's traces")
    base, info, its = mean_step_graph(traces)
    recorded_ms = replayed_step_ms(base, info, its)
    recorded = any(gathers for _, gathers in (backward_gathers(t) for t in traces))
    candidates = [{"setting": f"reshard_after_forward={str(recorded).lower()} (recorded)",
                   "predicted_step_ms": recorded_ms}]
    kept = 0
    if recorded:
        changed, changed_info, facts = resharded_traces(traces, info, base, {RESHARD: False})
        kept = facts["unsharded_bytes_kept"]
        candidates.append({"setting": "reshard_after_forward=false",
                           "predicted_step_ms": replayed_step_ms(changed, changed_info, its)})
    peak = recorded_peak_bytes(meta)
    for c in candidates:
        c["predicted_peak_memory_bytes"] = None if peak is None else peak + (kept if c is not candidates[0] else 0)
    best = min(candidates, key=lambda c: c["predicted_step_ms"])
    gain = recorded_ms - best["predicted_step_ms"]
    chosen = best is not candidates[0] and gain > MIN_GAIN * recorded_ms
    over = None
    if chosen and memory_budget_bytes is not None:
        if peak is None:
            over = ("the run holds no measured peak memory (run.json's fsdp.peak_memory_bytes), so keeping the "
                    f"gathered parameters ({kept / 2**20:.1f} MiB more per rank) cannot be weighed against the "
                    f"{memory_budget_bytes / 2**20:.0f} MiB budget")
        elif peak + kept > memory_budget_bytes:
            over = (f"it would hold {kept / 2**20:.1f} MiB more of gathered parameters on top of the measured peak "
                    f"of {peak / 2**20:.1f} MiB: {(peak + kept) / 2**20:.1f} MiB, over the "
                    f"{memory_budget_bytes / 2**20:.0f} MiB budget")
        chosen = over is None
    if over is not None:
        why = (f"the recorded resharding is kept: not resharding predicts {best['predicted_step_ms']:.2f} ms against "
               f"{recorded_ms:.2f} ms, but {over}")
    elif chosen:
        why = (f"keep each unit's gathered parameters from its forward to its backward: predicted "
               f"{best['predicted_step_ms']:.2f} ms against {recorded_ms:.2f} ms; each rank then holds "
               f"{kept / 2**20:.1f} MiB more of gathered parameters through the step")
    elif recorded:
        why = (f"the recorded resharding is kept: not resharding is predicted at "
               f"{candidates[-1]['predicted_step_ms']:.2f} ms against {recorded_ms:.2f} ms, less than "
               f"{100 * MIN_GAIN:.0f}% saved")
    else:
        why = "the recorded setting is kept: the traces do not reshard, so no all-gather is left to save"
    world = max([t.world_size or 1 for t in traces] + [len(traces)])
    config = {
        "schema": "dpro.config/1",
        "fingerprint": {"framework": "torch", "engine": NAME, "world_size": world, "model": "profiler-traces"},
        "baseline": {"run": ", ".join(str(t.path) for t in traces), "step_ms": measured_step_ms(info, its)},
        "predicted": {"step_ms": best["predicted_step_ms"] if chosen else recorded_ms,
                      "peak_memory_bytes": (best if chosen else candidates[0])["predicted_peak_memory_bytes"]},
        "knobs": {RESHARD: False} if chosen else {},
        "explain": [{"knob": RESHARD, "why": why, "predicted_gain_ms": gain if chosen else 0.0}],
    }
    return {"measured_step_ms": measured_step_ms(info, its), "recorded_modelled_step_ms": recorded_ms,
            "candidates": candidates, "recommended": best if chosen else None, "config": config}
