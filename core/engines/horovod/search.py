"""Horovod's fusion knobs, searched by replaying a model of Horovod's background loop.

``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME`` and the response cache: every cycle Horovod's background
thread fuses the tensors that are ready, up to the threshold, and allreduces each fused buffer;
``horovod_cycles`` replays that loop over the gradients' ready times, ``horovod_fusion`` prices every setting,
``search`` writes the best as the config's ``env`` knobs (set by ``dpro-launch --apply``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from dpro.dag.graph import graph_from_steps
from dpro.optimize.search import OptimizeResult, best_grouping, best_recompute, gradient_ready_us
from dpro.sim.cost import CommModel, fit_comm_model
from dpro.sim.replay import plan_levels, replay
from dpro.sim.whatif import MB, Context, Prediction, predict, regroup

__all__ = [
    "HOROVOD_MIN_GAIN",
    "HVD_CYCLES_MS",
    "HVD_DEFAULT_CACHE",
    "HVD_DEFAULT_CYCLE_MS",
    "HVD_DEFAULT_THRESHOLD",
    "HVD_PHASES",
    "HVD_THRESHOLDS_MB",
    "HorovodLoop",
    "horovod_comm_model",
    "horovod_cycles",
    "horovod_fusion",
    "horovod_hierarchical",
    "horovod_loop",
    "horovod_memcpy_us_per_byte",
    "search",
]

HOROVOD_MIN_GAIN = 0.01  # Horovod's fusion model prices its buffer copies from the timeline (see bench/launch.py)


# The space Horovod's autotuner explores (0.28.1: fusion threshold, cycle time, response cache, hierarchical
# allreduce / allgather), searched by replay.
HVD_THRESHOLDS_MB = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
HVD_CYCLES_MS = (0.5, 1, 2.5, 5, 10, 15, 20, 25, 50)
HVD_DEFAULT_THRESHOLD = 128 * MB   # horovod 0.28.1 (operations.cc)
HVD_DEFAULT_CYCLE_MS = 1.0
HVD_DEFAULT_CACHE = 1024           # HOROVOD_CACHE_CAPACITY
HVD_PHASES = 8                     # cycle phases averaged over (the loop runs unaligned with the steps)


@dataclass(frozen=True)
class HorovodLoop:
    """Horovod's background loop as dpro prices it (µs), calibrated from the recorded run's timeline.

    Every ``HOROVOD_CYCLE_TIME`` (or at once, when the last cycle's work took longer) the loop wakes, agrees
    with the other ranks on the tensors every rank has requested (the response cache makes that one small
    bit-vector allreduce), fuses them in request order into buffers of at most ``HOROVOD_FUSION_THRESHOLD``
    bytes and runs the buffers one after the other: copy into the fusion buffer (several tensors only),
    allreduce, copy out.
    """

    comm: CommModel                 # the allreduce phase of a buffer (e.g. GLOO_ALLREDUCE) vs its bytes
    memcpy_us_per_byte: float       # copies into and out of the fusion buffer, per byte of a fused buffer
    wake_us: float                  # a cycle with work: from the cycle's start to its first buffer's start
    buffer_gap_us: float            # between buffers run back to back in one cycle
    negotiate_us: float             # added to a cycle holding a tensor the response cache does not hold
    source: str = ""

    def buffer_us(self, nbytes: float, tensors: int) -> float:
        return self.comm.allreduce_us(nbytes) + (self.memcpy_us_per_byte * nbytes if tensors > 1 else 0.0)

    def describe(self) -> dict[str, Any]:
        return {"latency_us": self.comm.latency_us, "gbit_per_s": self.comm.gbit_per_s, "source": self.source,
                "memcpy_us_per_byte": self.memcpy_us_per_byte, "wake_us": self.wake_us,
                "buffer_gap_us": self.buffer_gap_us, "negotiate_us": self.negotiate_us}


def _hvd_buffers(ctx: Context) -> list[dict[str, Any]]:
    """The fused buffers of every step, from the merged Horovod timeline (``dpro.engines.horovod.timeline``)."""
    meta = (ctx.run.meta or {}) if ctx.run is not None else {}
    return list(((meta.get("horovod") or {}).get("merged") or {}).get("buffers") or [])


def horovod_comm_model(ctx: Context) -> CommModel:
    """Allreduce cost without Horovod's cycle, negotiation and fusion-buffer copies, from the timeline's
    allreduce phases of every step's fused buffers (``allreduce_us``, e.g. GLOO_ALLREDUCE) and of the probe.

    The slope (time per byte) is the fit of ``fit_comm_model``. The fixed cost per allreduce is the lower
    envelope of the samples (the least any of them took beyond its bytes): a lone small allreduce also
    waits for the other ranks' background threads to be scheduled, which buffers reduced back to back
    in one cycle do not, so an intercept fitted through the samples would price every extra buffer with
    that wait (measured: several ms per buffer on a busy 2-core machine, where fusing less was faster).
    """
    transfers = [(float(b["bytes"]), float(b["allreduce_us"])) for b in _hvd_buffers(ctx)
                 if b.get("bytes") and b.get("allreduce_us") is not None]
    probe = ((ctx.run.meta or {}).get("comm_probe", {}).get("samples", [])) if ctx.run is not None else []
    if not transfers and not probe:
        return ctx.comm
    fitted = fit_comm_model(transfers, probe, ctx.world_size)
    n = max(ctx.world_size, 2)
    frac = 2 * (n - 1) / n
    samples = transfers + [(float(b), float(us)) for b, us in probe]
    floor = min(us - frac * b * fitted.us_per_byte for b, us in samples)
    latency = max(0.0, min(fitted.latency_us, floor / (2 * (n - 1))))
    return dataclasses.replace(fitted, latency_us=latency, source=fitted.source + ", latency: lower envelope")


def horovod_memcpy_us_per_byte(ctx: Context) -> float:
    """Time per byte to copy a fused buffer in and out of Horovod's fusion buffer (timeline phases)."""
    copied, took = 0.0, 0.0
    for b in _hvd_buffers(ctx):
        if len(b.get("tensors", [])) > 1 and b.get("bytes"):
            copied += float(b["bytes"])
            took += float(b.get("memcpy_in_us", 0.0)) + float(b.get("memcpy_out_us", 0.0))
    return took / copied if copied else 0.0


def horovod_loop(ctx: Context) -> HorovodLoop:
    """Calibrate ``HorovodLoop`` from the recorded run.

    Per step, each buffer could start when its last tensor was launched on every rank and the buffer
    before it had finished; it started ``delay`` later. A buffer whose tensors were all launched before
    the previous buffer started ran back to back with it in one cycle: its delay is the gap between
    buffers. Any other buffer waited for a cycle: when the loop was idle, half a cycle on average (the
    loop runs unaligned with the steps); right after a buffer, nothing (a cycle whose work ran over starts
    the next at once). The wake time is the median of those delays less that wait; on a busy machine it
    holds the time the background thread waits to be scheduled. Medians, so a few stalls do not count.
    """
    comm = horovod_comm_model(ctx)
    memcpy = horovod_memcpy_us_per_byte(ctx)
    coordinate = comm.allreduce_us(0)
    _, cycle_ms, _ = _in_force(ctx)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for b in _hvd_buffers(ctx):
        if all(k in b for k in ("start_us", "end_us", "last_launch_us")):
            by_step.setdefault(b["step"], []).append(b)
    wake, gaps = [], []
    for buffers in by_step.values():
        buffers.sort(key=lambda b: b["start_us"])
        previous: dict[str, Any] | None = None
        for b in buffers:
            if previous is not None and b["last_launch_us"] <= previous["start_us"]:
                gaps.append(b["start_us"] - previous["end_us"])
            elif previous is not None and b["last_launch_us"] <= previous["end_us"]:
                wake.append(b["start_us"] - previous["end_us"])
            else:
                wake.append(b["start_us"] - b["last_launch_us"] - cycle_ms * 500.0)
            previous = b
    if not wake and not gaps:
        return HorovodLoop(comm, memcpy, coordinate, 0.0, 2 * coordinate, "no Horovod timeline: loop not measured")
    return HorovodLoop(
        comm, memcpy, max(0.0, statistics.median(wake)) if wake else coordinate,
        max(0.0, statistics.median(gaps)) if gaps else 0.0, 2 * coordinate,
        f"{len(wake) + len(gaps)} buffers of {len(by_step)} steps (timeline); {comm.source}")


def horovod_cycles(units: list[tuple[list[str], int, float]], threshold: float, cycle_us: float, phase_us: float,
                   cost_us: Any, coordinate_us: float, memcpy_us_per_byte: float = 0.0, *,
                   buffer_gap_us: float = 0.0, negotiate_us: float = 0.0,
                   uncached: frozenset[str] = frozenset()) -> list[tuple[list[str], float, float, float]]:
    """Horovod's background loop: every cycle (start ``phase_us + k * cycle_us``, or at once when the
    previous cycle's work ran over), the requests ready so far are fused, in ready order, into buffers of
    at most ``threshold`` bytes (a larger request goes alone; threshold 0: no fusion); after
    ``coordinate_us`` (plus ``negotiate_us`` when a ready tensor is ``uncached``: not in the response
    cache) the buffers are reduced one after the other, ``buffer_gap_us`` apart, each priced by
    ``cost_us(bytes)`` plus, for a buffer of several tensors, the copies into and out of the fusion buffer
    (``memcpy_us_per_byte``).

    ``units`` are (gradient names, bytes, ready µs) in ready order; a unit is never split (one tensor,
    or an explicit group of ``hvd.DistributedOptimizer(groups=)``).
    Returns the buffers: (names, ready µs of the last member, start µs, end µs).
    """
    remaining = sorted(units, key=lambda u: u[2])
    out: list[tuple[list[str], float, float, float]] = []
    t = phase_us
    while remaining:
        ready = [u for u in remaining if u[2] <= t]
        if not ready:
            upcoming = remaining[0][2]
            t = upcoming if cycle_us <= 0 else t + math.ceil((upcoming - t) / cycle_us) * cycle_us
            continue
        remaining = [u for u in remaining if u[2] > t]
        cursor = t + coordinate_us
        if uncached and any(n in uncached for u in ready for n in u[0]):
            cursor += negotiate_us
        buffers: list[list[tuple[list[str], int, float]]] = []
        size = 0.0
        for unit in ready:
            if buffers and size + unit[1] <= threshold:
                buffers[-1].append(unit)
                size += unit[1]
            else:
                buffers.append([unit])
                size = unit[1]
        for k, buf in enumerate(buffers):
            nbytes = sum(u[1] for u in buf)
            names = [n for u in buf for n in u[0]]
            start = cursor + (buffer_gap_us if k else 0.0)
            end = start + cost_us(nbytes) + (memcpy_us_per_byte * nbytes if len(names) > 1 else 0.0)
            out.append((names, max(u[2] for u in buf), start, end))
            cursor = end
        t = max(t + cycle_us, cursor) if cycle_us > 0 else cursor
    return out


def _replay_buffers(ctx: Context, comm: CommModel, buffers: list[tuple[list[str], float, float, float]],
                    knobs: dict[str, Any]) -> Prediction:
    """Regroup the step into ``buffers`` and replay it; each buffer's transfer holds what Horovod's loop
    adds to the allreduce itself (waiting for the cycle, negotiation, earlier buffers of the cycle)."""
    hctx = dataclasses.replace(ctx, comm=comm)
    model = regroup(hctx, ctx.base, [b[0] for b in buffers])
    previous_end = 0.0
    for k, (_, ready, _, end) in enumerate(buffers):
        model.transfer[f"COMM.group{k}.allreduce"] = max(0.0, end - max(ready, previous_end))
        previous_end = end
    model.transfer_end = {}
    g = graph_from_steps(model, iterations=4)
    sched = replay(g, plan_levels(g))
    from dpro.analyze import predicted_step_us

    per_rank = predicted_step_us(g, sched)
    return Prediction(knobs=dict(knobs), predicted_step_ms=statistics.median(per_rank.values()) / 1000.0,
                      predicted_peak_memory_bytes=ctx.memory.peak_bytes(()), graph_nodes=g.size,
                      per_rank_ms={r: v / 1000.0 for r, v in per_rank.items()})


def _horovod_predict(ctx: Context, loop: HorovodLoop, units: list[tuple[list[str], int, float]], threshold: float,
                     cycle_ms: float, cache_capacity: int = HVD_DEFAULT_CACHE,
                     phases: int = HVD_PHASES) -> tuple[float, list[list[str]], Prediction]:
    """Mean replayed step (ms) over cycle phases, the buffers of the median phase, and its prediction."""
    cycle_us = cycle_ms * 1000.0
    names = [n for u in units for n in u[0]]
    uncached = frozenset(names[max(0, cache_capacity):])
    runs = []
    for i in range(phases if cycle_us > 0 else 1):
        buffers = horovod_cycles(units, threshold, cycle_us, (i + 0.5) / phases * cycle_us,
                                 lambda nbytes: loop.comm.allreduce_us(nbytes), loop.wake_us,
                                 loop.memcpy_us_per_byte, buffer_gap_us=loop.buffer_gap_us,
                                 negotiate_us=loop.negotiate_us, uncached=uncached)
        knobs = {"HOROVOD_FUSION_THRESHOLD": int(threshold), "HOROVOD_CYCLE_TIME": cycle_ms,
                 "HOROVOD_CACHE_CAPACITY": cache_capacity}
        runs.append((_replay_buffers(ctx, loop.comm, buffers, knobs), buffers))
    mean = statistics.fmean(p.predicted_step_ms for p, _ in runs)
    prediction, buffers = sorted(runs, key=lambda r: r[0].predicted_step_ms)[len(runs) // 2]
    return mean, [b[0] for b in buffers], prediction


def _units(ctx: Context, groups: list[list[str]] | None = None) -> list[tuple[list[str], int, float]]:
    ready = gradient_ready_us(ctx)
    sizes = dict(ctx.gradients)
    order = {n: i for i, (n, _) in enumerate(ctx.gradients)}
    grouped = {n for g in groups or [] for n in g}
    units = [(list(g), sum(sizes[n] for n in g), max(ready[n] for n in g)) for g in groups or [] if g]
    units += [([n], sizes[n], ready[n]) for n, _ in ctx.gradients if n not in grouped]
    return sorted(units, key=lambda u: (u[2], order[u[0][0]]))


def _in_force(ctx: Context) -> tuple[float, float, int]:
    """Fusion threshold (bytes), cycle time (ms) and response cache capacity of the recorded run."""
    try:
        threshold = float(ctx.knobs.get("HOROVOD_FUSION_THRESHOLD", HVD_DEFAULT_THRESHOLD))
    except (TypeError, ValueError):
        threshold = float(HVD_DEFAULT_THRESHOLD)
    try:
        cycle = float(ctx.knobs.get("HOROVOD_CYCLE_TIME", HVD_DEFAULT_CYCLE_MS))
    except (TypeError, ValueError):
        cycle = HVD_DEFAULT_CYCLE_MS
    try:
        cache = int(ctx.knobs.get("horovod.cache_capacity", HVD_DEFAULT_CACHE))
    except (TypeError, ValueError):
        cache = HVD_DEFAULT_CACHE
    return threshold, cycle, cache


def horovod_hierarchical(ctx: Context) -> tuple[bool, str]:
    """Whether hierarchical allreduce / allgather could apply (several hosts, several ranks on one), and why."""
    hosts = list((ctx.run.meta or {}).get("hosts") or []) if ctx.run is not None else []
    per_host: dict[str, int] = {}
    for h in hosts:
        per_host[h] = per_host.get(h, 0) + 1
    if len(per_host) <= 1:
        return False, ("not applicable: every rank is on one host, where hierarchical allreduce/allgather is "
                       "the flat ring")
    if max(per_host.values()) == 1:
        return False, ("not applicable: one rank per host, so the local reduction is empty and "
                       "HOROVOD_HIERARCHICAL_ALLREDUCE / ALLGATHER equal the flat ring")
    return True, (f"{len(per_host)} hosts with up to {max(per_host.values())} ranks: hierarchical allreduce "
                  "could apply, but dpro measures no intra-host bandwidth apart from the ring's, so it is "
                  "not priced (try HOROVOD_HIERARCHICAL_ALLREDUCE=1 and compare)")


def horovod_fusion(ctx: Context, thresholds_mb: tuple[float, ...] = HVD_THRESHOLDS_MB,
                   cycles_ms: tuple[float, ...] = HVD_CYCLES_MS) -> list[dict[str, Any]]:
    """Search ``HOROVOD_FUSION_THRESHOLD`` x ``HOROVOD_CYCLE_TIME`` by replay of a model of Horovod's loop.

    Each candidate's buffers come from ``horovod_cycles`` with the loop calibrated by ``horovod_loop``
    (gradients ready at the end of the backward op producing them, on the slowest rank); the step is
    regrouped into them (``whatif.regroup``) and replayed, averaged over ``HVD_PHASES`` cycle phases.
    The setting in force is evaluated the same way (``"in_force": True``), so gains compare like with
    like. Returns one dict per candidate, best first: ``threshold_bytes``, ``cycle_time_ms``,
    ``predicted_step_ms``, ``buffers`` (gradient names per fused buffer, one cycle phase). The best also
    gets ``tensor_groups`` (``best_grouping``'s groups, for ``hvd.DistributedOptimizer(groups=)``),
    ``tensor_groups_predicted_step_ms`` (those groups as units under the best setting), ``comm_model``
    (the calibrated loop) and ``cache`` (the step with the response cache in force, holding every
    tensor, and off).
    """
    loop = horovod_loop(ctx)
    units = _units(ctx)
    threshold0, cycle0, cache0 = _in_force(ctx)
    cache = max(cache0, len(ctx.gradients)) if cache0 > 0 else 0
    results: list[dict[str, Any]] = []
    grid = [(t * MB, c) for t in thresholds_mb for c in cycles_ms]
    if not any(abs(t - threshold0) < 1 and abs(c - cycle0) < 1e-9 for t, c in grid):
        grid.append((threshold0, cycle0))
    for threshold, cycle in grid:
        in_force = abs(threshold - threshold0) < 1 and abs(cycle - cycle0) < 1e-9
        mean, buffers, _ = _horovod_predict(ctx, loop, units, threshold, cycle, cache0 if in_force else cache)
        results.append({"threshold_bytes": int(threshold), "threshold_mb": threshold / MB, "cycle_time_ms": cycle,
                        "predicted_step_ms": mean, "buffers": buffers, "in_force": in_force,
                        "cache_capacity": cache0 if in_force else cache})
    results.sort(key=lambda r: (round(r["predicted_step_ms"], 6), -r["threshold_bytes"], r["cycle_time_ms"]))
    best = results[0]
    groups, _ = best_grouping(ctx)
    grouped, _, _ = _horovod_predict(ctx, loop, _units(ctx, groups), best["threshold_bytes"], best["cycle_time_ms"],
                                     best["cache_capacity"])
    best["tensor_groups"] = groups
    best["tensor_groups_predicted_step_ms"] = grouped
    best["comm_model"] = loop.describe()
    off, _, _ = _horovod_predict(ctx, loop, units, best["threshold_bytes"], best["cycle_time_ms"], 0)
    best["cache"] = {"capacity": best["cache_capacity"], "tensors": len(ctx.gradients),
                     "predicted_step_ms": best["predicted_step_ms"], "off_predicted_step_ms": off}
    return results


def search(ctx: Context, *, memory_budget_bytes: int | None = None,
           allow_compression: bool = False) -> OptimizeResult:
    """``optimize`` for a Horovod run: fusion threshold, cycle time and response cache (knobs ``env``),
    explicit groups (``tensor_groups``, for ``hvd.DistributedOptimizer(groups=)``) and recomputation under
    a budget; hierarchical allreduce/allgather are explained, not recommended (see ``horovod_hierarchical``).

    The model of Horovod's loop (``horovod_fusion``) prices the differences between settings; the
    replay of the measured step sets the level, so every time reported is the baseline replay plus
    the modelled difference from the setting in force."""
    began = time.perf_counter()
    baseline = predict(ctx, {})
    results = horovod_fusion(ctx)
    best = results[0]
    current = next(r for r in results if r["in_force"])
    level = baseline.predicted_step_ms - current["predicted_step_ms"]
    explain: list[dict[str, Any]] = []
    gain = current["predicted_step_ms"] - best["predicted_step_ms"]
    chosen = best if gain > HOROVOD_MIN_GAIN * current["predicted_step_ms"] else current
    env = {"HOROVOD_FUSION_THRESHOLD": str(chosen["threshold_bytes"]),
           "HOROVOD_CYCLE_TIME": f"{chosen['cycle_time_ms']:g}"}
    knobs: dict[str, Any] = {"env": env}
    described = (f"{chosen['threshold_mb']:g} MB / {chosen['cycle_time_ms']:g} ms: "
                 f"{len(chosen['buffers'])} allreduce buffer(s) per step")
    space = (f"{len(results)} settings replayed: thresholds {HVD_THRESHOLDS_MB[0]:g}-{HVD_THRESHOLDS_MB[-1]:g} MB x "
             f"cycles {HVD_CYCLES_MS[0]:g}-{HVD_CYCLES_MS[-1]:g} ms")
    if chosen is best:
        explain.append({"knob": "env", "predicted_gain_ms": gain,
                        "why": f"HOROVOD_FUSION_THRESHOLD / HOROVOD_CYCLE_TIME {described}; the setting in force "
                               f"({current['threshold_mb']:g} MB / {current['cycle_time_ms']:g} ms) replays at "
                               f"{baseline.predicted_step_ms:.2f} ms, this one at "
                               f"{best['predicted_step_ms'] + level:.2f} ms ({space})"})
    else:
        explain.append({"knob": "env", "predicted_gain_ms": 0.0,
                        "why": f"the Horovod setting in force ({described}) is already within "
                               f"{HOROVOD_MIN_GAIN:.0%} of the best ({best['threshold_mb']:g} MB / "
                               f"{best['cycle_time_ms']:g} ms: {best['predicted_step_ms'] + level:.2f} ms vs "
                               f"{baseline.predicted_step_ms:.2f} ms; {space}); kept"})
    cache = best["cache"]
    _, _, cache0 = _in_force(ctx)
    if chosen is best and cache["capacity"] != cache0:
        env["HOROVOD_CACHE_CAPACITY"] = str(cache["capacity"])
    cache_why = (f"response cache: {cache['capacity']} entries for {cache['tensors']} tensors, so every request is "
                 f"cached and a cycle agrees on them with one small bit-vector allreduce; without it "
                 f"(HOROVOD_CACHE_CAPACITY=0) each cycle negotiates ({cache['off_predicted_step_ms'] + level:.2f} ms)")
    if cache0 <= 0 or cache0 < cache["tensors"]:
        cache_why += f"; the capacity in force ({cache0}) misses tensors" + (
            "" if "HOROVOD_CACHE_CAPACITY" in env else ", but the setting in force was kept")
    explain.append({"knob": "horovod.cache_capacity", "predicted_gain_ms": 0.0, "why": cache_why})
    applies, why = horovod_hierarchical(ctx)
    explain.append({"knob": "horovod.hierarchical", "predicted_gain_ms": 0.0,
                    "why": "HOROVOD_HIERARCHICAL_ALLREDUCE / HOROVOD_HIERARCHICAL_ALLGATHER: " + why})
    final_ms = chosen["predicted_step_ms"] + level
    group_gain = chosen["predicted_step_ms"] - best["tensor_groups_predicted_step_ms"]
    groups = best["tensor_groups"]
    if chosen is best and group_gain > HOROVOD_MIN_GAIN * chosen["predicted_step_ms"]:
        knobs["tensor_groups"] = groups
        final_ms -= group_gain
    applied = "tensor_groups" in knobs
    grouped_ms = best["tensor_groups_predicted_step_ms"] + level
    explain.append({"knob": "tensor_groups", "predicted_gain_ms": max(0.0, group_gain) if applied else 0.0,
                    "why": f"optimal grouping by dynamic programming ({len(groups)} groups) as "
                           f"hvd.DistributedOptimizer(groups=): {grouped_ms:.2f} ms under "
                           f"{best['threshold_mb']:g} MB / {best['cycle_time_ms']:g} ms"
                           + ("" if applied else f"; not applied (gain under {HOROVOD_MIN_GAIN:.0%} or setting kept)")})
    explain.append({"knob": "gradient_compression", "predicted_gain_ms": 0.0,
                    "why": "not searched for Horovod (hvd.Compression.fp16 is not applied by dpro)"})
    predicted = Prediction(knobs=dict(knobs), predicted_step_ms=final_ms,
                           predicted_peak_memory_bytes=ctx.memory.peak_bytes(()), graph_nodes=baseline.graph_nodes,
                           per_rank_ms={})
    if memory_budget_bytes is not None:
        choice = best_recompute(ctx, memory_budget_bytes, {})
        if choice.modules and choice.prediction is not None:
            knobs["recompute"] = choice.modules
            extra = choice.prediction.predicted_step_ms - baseline.predicted_step_ms
            predicted = dataclasses.replace(predicted, predicted_step_ms=final_ms + extra,
                                            predicted_peak_memory_bytes=choice.prediction.predicted_peak_memory_bytes)
            explain.append({"knob": "recompute", "predicted_gain_ms": -extra,
                            "why": f"checkpointing {', '.join(choice.modules)} brings the peak to "
                                   f"{choice.prediction.predicted_peak_memory_bytes / MB:.1f} MiB"})
        else:
            explain.append({"knob": "recompute", "predicted_gain_ms": 0.0, "why": choice.note})
    return OptimizeResult(knobs=knobs, baseline=baseline, predicted=predicted, explain=explain,
                          search_seconds=time.perf_counter() - began,
                          measured_step_ms=ctx.base.measured_step_us / 1000.0)
