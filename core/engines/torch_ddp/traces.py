"""The torch-ddp engine on PyTorch profiler (Kineto) traces: what-if and search of DDP's gradient buckets.

A CPU trace of a DDP job recorded with ``record_shapes=True`` holds what a bucket what-if needs: every gradient as
autograd accumulates it (``torch::autograd::AccumulateGrad``, its shape and dtype in ``Input Dims`` / ``Input type``,
in the order they become ready), DDP's launch of each bucket's allreduce (``c10d::allreduce_``, nested in the
accumulation of the bucket's last gradient) and the allreduce itself on the backend's thread (``gloo:all_reduce``,
its message size). ``ddp_steps`` reads them and checks that the recorded allreduces are DDP's buckets (consecutive
gradients in ready order, every step and rank alike); ``regroup`` rebuilds the replay graph with the gradients in new
groups: each group's allreduce is launched by the accumulation of its last gradient on every rank, and one transfer,
priced by ``TransferFit`` from the recorded allreduces (the link's busy periods: a backend runs several at once,
sharing the link), runs once every rank has launched it, after the one before (the link's bytes take the same time
one after another as side by side). What waited for a recorded allreduce waits for the new one that holds that
bucket's last gradient (one its rank has launched: no wait runs backwards).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from dpro.dag.graph import NO_QUEUE, Graph, GraphBuilder
from dpro.dag.kineto import KinetoGraphInfo
from dpro.engines.torch_ddp.buckets import BUCKET_CAP, CAP_CANDIDATES_MB, bucket_groups, ddp_buckets
from dpro.errors import UsageError
from dpro.io.kineto import KinetoTrace
from dpro.sim.choices import MIN_GAIN
from dpro.sim.interference import fit_trace_interference
from dpro.sim.kineto import interfered_graph, mean_step_graph, measured_step_ms, replayed_step_ms, used_iterations

__all__ = ["DdpSteps", "TransferFit", "ddp_steps", "fit_transfer", "optimize_traces", "regroup", "regrouped_traces"]

ACCUMULATE = "torch::autograd::AccumulateGrad"
LAUNCH = "c10d::allreduce_"
DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "c10::Float8_e4m3fn": 1, "long int": 8,
               "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}


@dataclass
class DdpSteps:
    """What the traces say about DDP's gradients and buckets (gradient names are made up: ``g<k>:<shape>``)."""

    gradients: list[tuple[str, int]]               # (name, bytes) in ready order
    groups: list[list[str]]                        # the recorded buckets, in launch order
    grad_nodes: dict[tuple[int, int], list[int]]   # (rank, iteration) -> host node accumulating each gradient
    comm_nodes: dict[tuple[int, int], list[int]]   # (rank, iteration) -> the recorded allreduces' nodes
    transfers: list[tuple[int, float]]             # (bytes, µs) per busy period of the link, the fastest rank's
    launch_us: float                               # host time of launching one allreduce (median)


@dataclass(frozen=True)
class TransferFit:
    """An allreduce of ``n`` bytes takes ``latency_us + n * us_per_byte``."""

    latency_us: float
    us_per_byte: float

    def __call__(self, nbytes: float) -> float:
        return self.latency_us + nbytes * self.us_per_byte

    def describe(self) -> str:
        gbit = 8e-3 / self.us_per_byte if self.us_per_byte > 0 else math.inf
        return f"allreduce = {self.latency_us:.0f} µs + bytes at {gbit:.2f} Gbit/s (fitted on the recorded buckets)"


def _tensor_bytes(ev: dict[str, Any], what: str) -> int:
    args = ev.get("args") or {}
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not (isinstance(dims, list) and dims and isinstance(dims[0], list) and isinstance(types, list) and types):
        raise UsageError(f"{what} carries no tensor shape: record the trace with torch.profiler.profile("
                         "record_shapes=True) for a bucket what-if")
    shape = dims[0][0] if dims[0] and isinstance(dims[0][0], list) else dims[0]  # a TensorList holds one tensor
    kind = types[0] if types[0] != "TensorList" else "float"
    if not all(isinstance(d, int) and d >= 0 for d in shape) or kind not in DTYPE_BYTES:
        raise UsageError(f"{what}: tensor {shape} of type {kind!r} is not one dpro can size")
    return math.prod(shape) * DTYPE_BYTES[kind]


def _shape(ev: dict[str, Any]) -> str:
    dims = (ev.get("args") or {}).get("Input Dims") or [[]]
    return "x".join(str(d) for d in dims[0]) or "scalar"


def _containing_node(info: KinetoGraphInfo, starts: dict[str, tuple[list[float], list[int]]], rank: int,
                     ev: dict[str, Any]) -> int | None:
    """The top-level host node of ``ev``'s thread that contains it."""
    queue = f"r{rank}/host{ev.get('tid')}"
    if queue not in starts:
        return None
    times, gids = starts[queue]
    i = bisect.bisect_right(times, ev["ts"] + 1e-3) - 1
    return gids[i] if i >= 0 else None


def ddp_steps(traces: list[KinetoTrace], info: KinetoGraphInfo) -> DdpSteps:
    """DDP's gradients and recorded buckets in the profiled steps of ``traces`` (``graph_from_kineto``'s ``info``).

    Raises:
        UsageError: no gradient accumulation or no allreduce in a step, shapes not recorded, or allreduces that are
            not DDP buckets (their sizes do not add up to consecutive gradients), or steps that differ.
    """
    starts: dict[str, tuple[list[float], list[int]]] = {}
    for (rank, queue, start), gid in sorted(info.node_at.items()):
        times, gids = starts.setdefault(f"{rank}|{queue}", ([], []))
        times.append(start)
        gids.append(gid)
    out = DdpSteps([], [], {}, {}, [], 0.0)
    launches: list[float] = []
    periods: dict[int, list[list[tuple[int, float]]]] = defaultdict(list)  # iteration -> per rank: (bytes, µs)
    for trace, rank in zip(traces, info.ranks, strict=True):
        rank_starts = {k.split("|", 1)[1]: v for k, v in starts.items() if k.startswith(f"{rank}|")}
        windows = {w.number: w for w in trace.steps}
        for it, number in enumerate(info.steps):
            w = windows[number]
            where = f"{trace.path}, ProfilerStep#{number}"
            acc = sorted((e for e in trace.cpu_ops if e.get("name") == ACCUMULATE and w.ts <= e["ts"] <= w.end),
                         key=lambda e: e["ts"])
            comms = sorted((e for e in trace.cpu_comms if "all_reduce" in str(e.get("name")) and
                            w.ts <= e["ts"] <= w.end), key=lambda e: e["ts"])
            if not comms and trace.nccl_kernels:
                raise UsageError(f"{where}: the allreduces are NCCL kernels; the bucket what-if on profiler traces "
                                 "reads a CPU backend's collectives (gloo) so far")
            if not acc or not comms:
                raise UsageError(f"{where}: no gradient accumulation ({ACCUMULATE}) or no allreduce on the "
                                 "backend's thread: not a DDP training step dpro can regroup")
            grads = [(f"g{k}:{_shape(e)}", _tensor_bytes(e, f"{where}: {ACCUMULATE}")) for k, e in enumerate(acc)]
            if not out.gradients:
                out.gradients = grads
            elif [b for _, b in grads] != [b for _, b in out.gradients]:
                raise UsageError(f"{where}: the gradients accumulated differ from the first profiled step's "
                                 f"({len(grads)} vs {len(out.gradients)}); dpro regroups only identical steps")
            nodes = [_containing_node(info, rank_starts, rank, e) for e in acc]
            comm_nodes = [info.node_at.get((rank, f"r{rank}/comm{e.get('tid')}", e["ts"])) for e in comms]
            if None in nodes or None in comm_nodes:
                raise UsageError(f"{where}: a gradient's accumulation or an allreduce lies outside the replayed step")
            out.grad_nodes[(rank, it)] = nodes
            out.comm_nodes[(rank, it)] = comm_nodes
            groups = _partition([b for _, b in grads], [_tensor_bytes(e, f"{where}: {e.get('name')}") for e in comms])
            if groups is None:
                raise UsageError(f"{where}: the allreduces' sizes do not add up to consecutive gradients in the order "
                                 "they were ready: not (only) DDP's buckets; dpro regroups DDP's buckets only")
            named = [[grads[i][0] for i in group] for group in groups]
            if out.groups and named != out.groups:
                raise UsageError(f"{where}: the buckets differ from the first profiled step's")
            out.groups = named
            sized = [(e["ts"], e["ts"] + e["dur"], sum(grads[i][1] for i in groups[k])) for k, e in enumerate(comms)]
            periods[it].append(_busy_periods(sized))
            launches += [float(e["dur"]) for e in trace.cpu_ops if e.get("name") == LAUNCH and w.ts <= e["ts"] <= w.end]
    for per_rank in periods.values():
        if len({len(p) for p in per_rank}) == 1:  # the ranks' periods pair up: the fastest rank's is the transfer
            out.transfers += [(per_rank[0][k][0], min(p[k][1] for p in per_rank)) for k in range(len(per_rank[0]))]
    out.launch_us = statistics.median(launches) if launches else 0.0
    return out


def _busy_periods(comms: list[tuple[float, float, int]]) -> list[tuple[int, float]]:
    """(bytes, µs) of each stretch of time in which the rank's allreduces overlap: a backend runs several at once
    on its threads (gloo: 2), sharing the link, so one alone is slower than its bytes say."""
    out: list[tuple[int, float]] = []
    start, end, nbytes = None, 0.0, 0
    for ts, te, size in sorted(comms):
        if start is not None and ts < end:
            end, nbytes = max(end, te), nbytes + size
            continue
        if start is not None:
            out.append((nbytes, end - start))
        start, end, nbytes = ts, te, size
    if start is not None:
        out.append((nbytes, end - start))
    return out


def _partition(grad_bytes: list[int], comm_bytes: list[int]) -> list[list[int]] | None:
    """Consecutive runs of gradients whose sizes are ``comm_bytes`` (indices per run), or None."""
    groups, i = [], 0
    for size in comm_bytes:
        group, total = [], 0
        while i < len(grad_bytes) and total < size:
            group.append(i)
            total += grad_bytes[i]
            i += 1
        if total != size:
            return None
        groups.append(group)
    return groups if i == len(grad_bytes) else None


def fit_transfer(points: list[tuple[int, float]]) -> TransferFit:
    """Latency and per-byte time by least squares over (bytes, µs) of the link's busy periods; with a single size,
    the time is taken as all bandwidth (no latency is seen, so none is assumed)."""
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    if len(set(xs.tolist())) >= 2:
        slope, intercept = np.polyfit(xs, ys, 1)
        if slope > 0 and intercept >= 0:
            return TransferFit(float(intercept), float(slope))
    return TransferFit(0.0, float(np.median(ys / np.maximum(xs, 1.0))))


def regroup(g: Graph, info: KinetoGraphInfo, ddp: DdpSteps, groups: list[list[str]],
            transfer: TransferFit) -> tuple[Graph, KinetoGraphInfo]:
    """``g`` (a graph of ``info``'s steps) with the recorded allreduces replaced by one per group of ``groups``
    (gradient names of ``ddp.gradients``); the info's step markers follow the new node ids."""
    index = {name: k for k, (name, _) in enumerate(ddp.gradients)}
    nbytes = dict(ddp.gradients)
    last_of = [max(index[n] for n in group) for group in groups]
    recorded_last = [max(index[n] for n in group) for group in ddp.groups]
    group_of = {index[n]: j for j, group in enumerate(groups) for n in group}
    # a recorded allreduce -> the new group that holds its bucket's last gradient (what now completes that bucket)
    removed = {gid: group_of[recorded_last[k]] for nodes in ddp.comm_nodes.values() for k, gid in enumerate(nodes)}
    duration = g.duration.copy()
    launches: dict[int, list[int]] = defaultdict(list)   # host node -> new groups it launches
    comm_queue: dict[tuple[int, int], str] = {}
    for (rank, it), nodes in ddp.grad_nodes.items():
        for k in recorded_last:
            duration[nodes[k]] = max(0.0, duration[nodes[k]] - ddp.launch_us)
        for j, k in enumerate(last_of):
            duration[nodes[k]] += ddp.launch_us
            launches[nodes[k]].append(j)
        first = ddp.comm_nodes[(rank, it)][0]
        comm_queue[(rank, it)] = g.queue_names[g.queue[first]] if g.queue[first] != NO_QUEUE else f"r{rank}/comm"
    b = GraphBuilder()
    new_id: dict[int, int] = {}
    xfer: dict[tuple[int, int], int] = {}   # (iteration, group) -> transfer node
    launched: dict[tuple[int, int], set[int]] = defaultdict(set)  # (rank, iteration) -> groups it has launched
    for node in range(g.size):
        rank, it = int(g.rank[node]), int(g.iteration[node])
        if node in removed:
            continue
        preds = []
        for p in g.preds(node):
            p = int(p)
            mapped = new_id.get(p)
            if p in removed:  # waited for a recorded allreduce: now for the transfer of the group that completes it
                done = launched[(rank, int(g.iteration[p]))]
                j = removed[p] if removed[p] in done else max(done, default=None)  # only one this rank launched
                mapped = xfer[(int(g.iteration[p]), j)] if j is not None else None
            if mapped is not None and mapped not in preds:
                preds.append(mapped)
        queue = g.queue_names[g.queue[node]] if g.queue[node] != NO_QUEUE else None
        new_id[node] = b.add(g.names[node], g.category[node], rank, it, queue, duration[node], g.gap[node], preds)
        for j in launches.get(node, ()):
            launch = b.add(f"DDP bucket {j} allreduce (launch)", "COMM", rank, it, comm_queue[(rank, it)], 0.0, 0.0,
                           [new_id[node]])
            if (it, j) not in xfer:
                before = [xfer[(it, j - 1)]] if (it, j - 1) in xfer else []
                xfer[(it, j)] = b.add(f"DDP bucket {j} allreduce ({sum(nbytes[n] for n in groups[j]):,} bytes)",
                                      "XFER", -1, it, None, transfer(sum(nbytes[n] for n in groups[j])), 0.0, before)
            b.preds[xfer[(it, j)]].append(launch)
            launched[(rank, it)].add(j)
    for key, end in g.step_end.items():
        b.step_end[key] = new_id[end]
    regrouped = b.build()
    return regrouped, dataclasses.replace(info, step_begin={k: new_id[v] for k, v in info.step_begin.items()})



def optimize_traces(traces: list[KinetoTrace], memory_budget_bytes: int | None = None,
                    meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``dpro optimize TRACE...``: every DDP bucket cap that gives a distinct grouping of the traces' gradients,
    each replayed on the traces' graph (every op at its mean over the profiled steps); the best is recommended when
    it is predicted to save at least ``MIN_GAIN`` of the step against the recorded buckets replayed the same way.
    Returns the candidates (best first), the recommendation and an applied config (its model fingerprint is the
    gradients' shapes: a job records parameter names, traces do not, so applying it needs ``--force``). A memory
    budget changes nothing here: DDP's buckets hold every gradient whatever their cap, and the note says so."""
    base, info, its = mean_step_graph(traces)
    ddp = ddp_steps(traces, info)
    transfer = fit_transfer(ddp.transfers)
    interference = fit_trace_interference(traces)

    def step_ms(groups: list[list[str]]) -> float:
        changed, changed_info = regroup(base, info, ddp, groups, transfer)
        if interference.applies:
            changed = interfered_graph(changed, base, interference.slowdown)
        return replayed_step_ms(changed, changed_info, its)

    recorded_ms = step_ms(ddp.groups)
    seen: set[tuple[int, ...]] = set()
    candidates = []
    for cap in sorted(CAP_CANDIDATES_MB, reverse=True):
        groups = ddp_buckets(ddp.gradients, cap)
        shape = tuple(len(grp) for grp in groups)
        if shape not in seen:
            seen.add(shape)
            candidates.append({"bucket_cap_mb": cap, "buckets": len(groups), "predicted_step_ms": step_ms(groups)})
    candidates.sort(key=lambda c: (c["predicted_step_ms"], -c["bucket_cap_mb"]))
    best = candidates[0]
    gain = recorded_ms - best["predicted_step_ms"]
    chosen = gain > MIN_GAIN * recorded_ms
    measured = measured_step_ms(info, its)
    why = (f"{best['bucket_cap_mb']:g} MB buckets ({best['buckets']} allreduces) replace the recorded "
           f"{len(ddp.groups)}: predicted {best['predicted_step_ms']:.2f} ms against {recorded_ms:.2f} ms"
           if chosen else f"no bucket cap is predicted to save {100 * MIN_GAIN:.0f}% of the step (best "
           f"{best['bucket_cap_mb']:g} MB: {best['predicted_step_ms']:.2f} ms against {recorded_ms:.2f} ms as "
           "recorded)")
    if memory_budget_bytes is not None:
        why += ("; the memory budget does not bear on it (DDP's buckets hold every gradient whatever their cap, so "
                "the cap leaves the peak as it was)")
    shapes = hashlib.sha256(json.dumps([n.split(":", 1)[1] for n, _ in ddp.gradients]).encode()).hexdigest()[:16]
    config = {
        "schema": "dpro.config/1",
        "fingerprint": {"framework": "torch", "engine": "torch-ddp", "world_size": max(len(traces), 1),
                        "model": f"gradient-shapes:{shapes}"},
        "baseline": {"run": ", ".join(str(t.path) for t in traces), "step_ms": measured},
        "predicted": {"step_ms": best["predicted_step_ms"] if chosen else recorded_ms, "peak_memory_bytes": None},
        "knobs": {BUCKET_CAP: best["bucket_cap_mb"]} if chosen else {},
        "explain": [{"knob": BUCKET_CAP, "why": why, "predicted_gain_ms": gain if chosen else 0.0}],
    }
    return {"measured_step_ms": measured, "recorded_buckets": len(ddp.groups), "recorded_modelled_step_ms": recorded_ms,
            "candidates": candidates, "recommended": best if chosen else None, "comm_model": transfer.describe(),
            "config": config}


def regrouped_traces(traces: list[KinetoTrace], info: KinetoGraphInfo, base: Graph,
                  grouping: dict[str, Any]) -> tuple[Graph, KinetoGraphInfo, dict[str, Any]]:
    """The engine's ``trace_whatif``: ``base`` (``info``'s graph, every op at its mean) with DDP's buckets regrouped
    under ``grouping`` (a bucket cap, or ``tensor_groups``), and what the regrouping saw.

    Raises:
        UsageError: the traces are not a DDP job's dpro can regroup (see ``ddp_steps``), or groups that do not name
            every gradient once.
    """
    ddp = ddp_steps(traces, info)
    transfer = fit_transfer(ddp.transfers)
    if "tensor_groups" in grouping:
        groups = grouping["tensor_groups"]
        names = [n for n, _ in ddp.gradients]
        if sorted(n for grp in groups for n in grp) != sorted(names):
            raise UsageError(f"--set tensor_groups: name every gradient once; the traces' gradients are "
                             f"{', '.join(names)}")
    else:
        groups = bucket_groups(SimpleNamespace(knobs={}, gradients=ddp.gradients), grouping)
    changed, changed_info = regroup(base, info, ddp, groups, transfer)
    # the recorded buckets through the same model, the interference's included (what-if applies it to any change)
    recorded, recorded_info = regroup(base, info, ddp, ddp.groups, transfer)
    interference = fit_trace_interference(traces)
    if interference.applies:
        recorded = interfered_graph(recorded, base, interference.slowdown)
    return changed, changed_info, {
        "gradients": len(ddp.gradients), "gradient_bytes": sum(b for _, b in ddp.gradients),
        "recorded_buckets": len(ddp.groups), "buckets": len(groups), "comm_model": transfer.describe(),
        "recorded_buckets_modelled_step_ms": replayed_step_ms(recorded, recorded_info, used_iterations(info, []))}
