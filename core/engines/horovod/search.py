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
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from dpro.dag.align import align
from dpro.dag.wiring import graph_from_steps
from dpro.engines.horovod.knobs import CYCLE, DEFAULT_CYCLE_TIME_MS, DEFAULT_FUSION_THRESHOLD, THRESHOLD
from dpro.sim.choices import (
    OptimizeResult,
    best_grouping,
    best_recompute,
    clears,
    gradient_ready_us,
    step_stderr_ms,
)
from dpro.sim.cost import CommModel, fit_comm_model, robust_line, scale_to_reach
from dpro.sim.interference import TransferSlowdown
from dpro.sim.replay import plan_levels, replay
from dpro.sim.whatif import MB, Context, Prediction, predict

__all__ = [
    "HOROVOD_MIN_GAIN",
    "HVD_CYCLES_MS",
    "HVD_DEFAULT_CACHE",
    "HVD_DEFAULT_CYCLE_MS",
    "HVD_DEFAULT_THRESHOLD",
    "HVD_FIXED_COST_QUANTILE",
    "HVD_STARTS",
    "HVD_THRESHOLDS_MB",
    "HVD_TRIM",
    "HVD_WARM_STEPS",
    "HorovodLoop",
    "LoopRun",
    "horovod_comm_model",
    "horovod_cycles",
    "horovod_fusion",
    "horovod_hierarchical",
    "horovod_loop",
    "horovod_memcpy_us_per_byte",
    "horovod_predict",
    "horovod_steps",
    "interfered_loop",
    "recorded_launches",
    "search",
    "simulate_loop",
]

# A Horovod setting is recommended for a predicted 1% (every other engine: optimize.search.MIN_GAIN, 3%): the loop
# model prices buffers from the fixed cost and bandwidth fitted through the step's own buffers (horovod_comm_model),
# not the probe's slope, so smaller gains are resolvable; it also prices the settings Horovod's autotune finds below
# what they save, and a 3% rule would turn them all down (docs/measurements.md).
HOROVOD_MIN_GAIN = 0.01
# A buffer's allreduce phase in the timeline also holds any wait for the other rank's data (a late rank only
# lengthens it): the fixed cost of one more buffer is the lower quartile of what the buffers took beyond their bytes,
# not the median: when many buffers wait for a late rank, the median prices every extra buffer far too dear.
HVD_FIXED_COST_QUANTILE = 0.25


# The space Horovod's autotuner explores (0.28.1: fusion threshold, cycle time, response cache, hierarchical
# allreduce / allgather), searched with a model of Horovod's background loop.
HVD_THRESHOLDS_MB = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
HVD_CYCLES_MS = (0.5, 1, 2.5, 5, 10, 15, 20, 25, 50)
HVD_DEFAULT_THRESHOLD = DEFAULT_FUSION_THRESHOLD
HVD_DEFAULT_CYCLE_MS = DEFAULT_CYCLE_TIME_MS
HVD_DEFAULT_CACHE = 1024           # HOROVOD_CACHE_CAPACITY
HVD_STARTS = 2                     # the loop's starting phase and the lag between the ranks' loops: 2 x 2 values
HVD_WARM_STEPS = 6                 # simulated steps before the loop's steady state is read (at least)
HVD_TRIM = 0.1                     # simulated step times: mean without the top and bottom 10%
INTERFERENCE_ROUNDS = 3            # simulations that settle the launches moved by overlap's slowdown
LOOP_SCALES = (0.1, 10.0)          # how far a timeline-less loop's fixed cost is scaled to take the recorded step

Unit = tuple[list[str], int, float]                    # gradient names, bytes, ready µs
Buffer = tuple[list[str], float, float, float]         # gradient names, ready µs (last member), start, end


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
    wake_us: float                  # a cycle with work: from the cycle's start (last rank) to its first buffer
    buffer_gap_us: float            # between buffers run back to back in one cycle
    negotiate_us: float             # added to a cycle holding a tensor the response cache does not hold
    source: str = ""
    transfer: TransferSlowdown | None = None  # a buffer's allreduce beside the step's compute (the transfer probe)

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

    When the step's buffers come in sizes at least twofold apart, slope and fixed cost are a robust line
    through them (``dpro.sim.cost.robust_line``, the fixed cost at ``HVD_FIXED_COST_QUANTILE`` of the residuals):
    what one more buffer costs in this job, with the bandwidth it achieved in the step. A probe's slope
    (all_reduce alone, before the window) is a few percent off the in-step bandwidth, and on a 16-32 MB buffer
    that error alone looks like milliseconds of fixed cost; a plain least-squares line is pulled by the few
    buffers that waited for a late rank. Otherwise the slope
    is ``fit_comm_model``'s and the fixed cost the median, over the buffers, of what each took beyond its
    bytes. (The least, the lower envelope, prices a buffer as if the background threads always ran at
    once; on a busy CPU-only machine they wait to be scheduled.) Without a timeline that median is the probe's,
    bounded by the shortest allreduce the recorded steps saw (``_shortest_recorded_allreduce``).
    """
    transfers = [(float(b["bytes"]), float(b["allreduce_us"])) for b in _hvd_buffers(ctx)
                 if b.get("bytes") and b.get("allreduce_us") is not None]
    probe = ((ctx.run.meta or {}).get("comm_probe", {}).get("samples", [])) if ctx.run is not None else []
    if not transfers and not probe:
        return ctx.comm
    fitted = fit_comm_model(transfers, probe, ctx.world_size)
    n = max(ctx.world_size, 2)
    frac, hops = 2 * (n - 1) / n, 2 * (n - 1)
    line = robust_line(transfers, intercept_quantile=HVD_FIXED_COST_QUANTILE)
    if line is not None:
        intercept, slope = line
        # the smallest buffers' bytes cost next to nothing, so what they took is the fixed cost of a buffer; the
        # line can put it lower (a token-bucket link passes mid-sized buffers at several times its rate), and a
        # buffer priced at 0 makes no fusion look free
        smallest = min(b for b, _ in transfers)
        small = sorted(us - slope * b for b, us in transfers if b <= 2 * smallest)
        intercept = max(intercept, small[int(HVD_FIXED_COST_QUANTILE * (len(small) - 1))])
        return dataclasses.replace(fitted, latency_us=intercept / hops, us_per_byte=slope / frac,
                                   source=f"robust line through the step's {len(transfers)} buffers")
    samples = transfers or [(float(b), float(us)) for b, us in probe]
    typical = max(0.0, statistics.median(us - frac * b * fitted.us_per_byte for b, us in samples))
    source = fitted.source + ", fixed cost: median of the step's buffers"
    bound = _shortest_recorded_allreduce(ctx) if not transfers else None
    if bound is not None and typical > bound:
        typical, source = bound, fitted.source + (f", fixed cost: the shortest allreduce the steps recorded "
                                                  f"({bound:.0f} us), below the probe's")
    return dataclasses.replace(fitted, latency_us=typical / hops, source=source)


def _shortest_recorded_allreduce(ctx: Context) -> float | None:
    """The shortest launch-to-completion of a gradient's allreduce in the recorded steps (the recorder's per-tensor
    COMM events): no allreduce's fixed cost exceeds it, since a tensor completes only after its buffer's allreduce
    ran, whole. A probe after the window that a neighbour slowed reads fixed costs several times that, and a
    what-if of many small buffers then multiplies the error."""
    if ctx.run is None:
        return None
    durations = [float(e["dur"]) for trace in ctx.run.ranks.values() for e in trace.events
                 if e["cat"] == "COMM" and "hvd_name" in e["args"] and e["dur"] > 0]
    return min(durations) if durations else None


def horovod_memcpy_us_per_byte(ctx: Context) -> float:
    """Time per byte to copy a fused buffer in and out of Horovod's fusion buffer (timeline phases)."""
    copied, took = 0.0, 0.0
    for b in _hvd_buffers(ctx):
        if len(b.get("tensors", [])) > 1 and b.get("bytes"):
            copied += float(b["bytes"])
            took += float(b.get("memcpy_in_us", 0.0)) + float(b.get("memcpy_out_us", 0.0))
    return took / copied if copied else 0.0


def recorded_launches(ctx: Context) -> list[dict[str, float]]:
    """Per recorded step that follows a recorded step: when each gradient was launched on its last rank,
    µs after the previous step's last fused buffer ended (the timeline's end). What happens in between
    (the optimizer, the forward, the backward) does not depend on Horovod's knobs, and its jitter from step
    to step decides, with a long cycle, which cycle a gradient catches. Without a merged timeline: one
    vector, from the replay of the recorded step (``_ready_after_comm``)."""
    replayed = _ready_after_comm(ctx)
    buffers = _hvd_buffers(ctx)
    if ctx.run is None or not buffers:
        return [replayed]

    shifts = align(ctx.run).offset_us
    ends: dict[int, float] = {}
    for b in buffers:
        ends[b["step"]] = max(ends.get(b["step"], float("-inf")), float(b["end_us"]))
    launched: dict[int, dict[str, float]] = defaultdict(dict)
    for rank, trace in ctx.run.ranks.items():
        shift = shifts.get(rank, 0.0)
        for e in trace.events:
            if e["cat"] == "COMM" and "hvd_name" in e["args"]:
                step = e["args"].get("step")
                for name in e["args"].get("tensors", []):
                    t = e["ts"] - shift
                    launched[step][name] = max(launched[step].get(name, float("-inf")), t)
    out = []
    for step in sorted(launched):
        if step - 1 in ends:
            vector = {n: max(0.0, t - ends[step - 1]) for n, t in launched[step].items()}
            out.append({n: vector.get(n, replayed.get(n, 0.0)) for n, _ in ctx.gradients})
    return out or [replayed]


def horovod_cycles(units: list[Unit], threshold: float, cycle_us: float, phase_us: float, cost_us: Any,
                   coordinate_us: float, memcpy_us_per_byte: float = 0.0, *, buffer_gap_us: float = 0.0,
                   negotiate_us: float = 0.0, uncached: frozenset[str] = frozenset(),
                   lag_us: float = 0.0) -> list[Buffer]:
    """Horovod's background loop over one step: every cycle (start ``phase_us + k * cycle_us``, or at once
    when the previous cycle's work ran over), the requests ready so far are fused, in ready order, into
    buffers of at most ``threshold`` bytes (a larger request goes alone; threshold 0: no fusion); after
    ``coordinate_us`` (plus ``negotiate_us`` when a ready tensor is ``uncached``: not in the response
    cache) the buffers are reduced one after the other, ``buffer_gap_us`` apart, each priced by
    ``cost_us(bytes)`` plus, for a buffer of several tensors, the copies into and out of the fusion buffer
    (``memcpy_us_per_byte``).

    Every rank runs the loop, each sleeping until its own last cycle start plus the cycle, and a cycle
    takes the requests every rank had queued when it started; ``lag_us`` is how much later than the first
    the last rank's cycle starts (the cycle's agreement, an allreduce, waits for it): a request must be
    ready by the first rank's cycle start, and the buffers start from the last one's. Work that runs over
    the cycle brings all ranks to the next cycle together (lag 0).

    ``units`` are (gradient names, bytes, ready µs) in ready order; a unit is never split (one tensor,
    or an explicit group of ``hvd.DistributedOptimizer(groups=)``).
    Returns the buffers: (names, ready µs of the last member, start µs, end µs).
    """
    return _loop_run(units, threshold, cycle_us, (phase_us, phase_us + lag_us), cost_us, coordinate_us,
                     memcpy_us_per_byte, buffer_gap_us, negotiate_us, uncached)[0]


def _loop_run(units: list[Unit], threshold: float, cycle_us: float, pops: tuple[float, float], cost_us: Any,
              coordinate_us: float, memcpy_us_per_byte: float, buffer_gap_us: float, negotiate_us: float,
              uncached: frozenset[str], finish: Callable[..., float] | None = None,
              ) -> tuple[list[Buffer], tuple[float, float]]:
    """``horovod_cycles`` from a loop whose next cycle starts at ``pops`` (the first and the last rank);
    also returns when the next cycle after the step's last work starts (the loop goes on into the next
    step). ``finish(start, work, wakes=)``: when a buffer that takes ``work`` µs alone ends (the compute beside
    it slows it; ``wakes``: the cycle's first buffer, for which the background thread wakes; the others run on
    from the one before); ``start + work`` without."""
    first, last = min(pops), max(pops)
    remaining = sorted(units, key=lambda u: u[2])
    out: list[Buffer] = []
    while remaining:
        ready = [u for u in remaining if u[2] <= first]
        if not ready:
            upcoming = remaining[0][2]
            skip = (upcoming - first) if cycle_us <= 0 else math.ceil((upcoming - first) / cycle_us) * cycle_us
            first, last = first + skip, last + skip
            continue
        remaining = [u for u in remaining if u[2] > first]
        cursor = last + coordinate_us
        if uncached and any(n in uncached for u in ready for n in u[0]):
            cursor += negotiate_us
        buffers: list[list[Unit]] = []
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
            work = cost_us(nbytes) + (memcpy_us_per_byte * nbytes if len(names) > 1 else 0.0)
            end = finish(start, work, wakes=k == 0) if finish is not None else start + work
            out.append((names, max(u[2] for u in buf), start, end))
            cursor = end
        if cycle_us > 0:
            first, last = sorted((max(first + cycle_us, cursor), max(last + cycle_us, cursor)))
        else:
            first = last = cursor
    return out, (first, last)


def horovod_steps(steps: list[list[Unit]], threshold: float, cycle_us: float, loop: HorovodLoop,
                  phase_us: float = 0.0, uncached: frozenset[str] = frozenset(),
                  lag_us: float = 0.0) -> list[tuple[float, list[Buffer]]]:
    """Consecutive steps under Horovod's loop, which runs on from one step into the next.

    ``steps[i]`` are step i's units, ready ``u[2]`` µs after the previous step's last allreduce ended (what
    the step does in between: optimizer, forward, backward). The loop is not aligned with the steps at
    random: a cycle whose work (the step's last buffer) runs over starts the next cycle at once, so the
    next step's gradients meet cycles at fixed offsets from it, and with a long cycle a step lasts a whole
    number of cycles plus its buffers. Returns per step its time (µs, from the previous step's last end
    to its own) and its buffers relative to the previous step's last end; ``phase_us`` is the first
    rank's first cycle and ``lag_us`` how much later the last rank's is (see ``horovod_cycles``).
    """
    anchor, pops = 0.0, (phase_us, phase_us + lag_us)
    out = []
    for units in steps:
        # the step computes (update, forward, backward) from the previous step's last allreduce to its last launch
        busy = [(anchor, anchor + max((r for _, _, r in units), default=0.0))]
        finish = partial(loop.transfer.end, busy=busy) if loop.transfer is not None else None
        buffers, pops = _loop_run([(n, b, anchor + r) for n, b, r in units], threshold, cycle_us, pops,
                                  loop.comm.allreduce_us, loop.wake_us, loop.memcpy_us_per_byte, loop.buffer_gap_us,
                                  loop.negotiate_us, uncached, finish)
        end = max((b[3] for b in buffers), default=anchor)
        out.append((end - anchor, [(names, ready - anchor, start - anchor, stop - anchor)
                                   for names, ready, start, stop in buffers]))
        anchor = end
    return out


def _loop_delay(buffers: list[Buffer], first_could: float | None = None) -> float:
    """What the loop added to a step's buffers: each buffer's start beyond the later of its last launch and
    the previous buffer's end."""
    total, previous_end = 0.0, first_could
    for _, ready, start, end in buffers:
        total += max(0.0, start - (ready if previous_end is None else max(ready, previous_end)))
        previous_end = end
    return total


def _trimmed_mean(values: list[float], trim: float = HVD_TRIM) -> float:
    ordered = sorted(values)
    cut = int(len(ordered) * trim)
    kept = ordered[cut:len(ordered) - cut] or ordered
    return statistics.fmean(kept)


@dataclass
class LoopRun:
    """A setting simulated over the recorded steps: step times (µs), loop delays, a typical step's buffers."""

    step_us: float                  # trimmed mean over the simulated steps
    delay_us: float                 # median of the loop's added delay per step
    buffers: list[Buffer]


def simulate_loop(loop: HorovodLoop, steps: list[list[Unit]], threshold: float, cycle_ms: float,
                  uncached: frozenset[str] = frozenset()) -> LoopRun:
    """``horovod_steps`` over the recorded steps (their launch times, in order), after a warm-up pass, from
    ``HVD_STARTS`` x ``HVD_STARTS`` starting phases and lags spread over a cycle (set when the job starts)."""
    cycle_us = cycle_ms * 1000.0
    n = HVD_STARTS if cycle_us > 0 else 1
    warm = [steps[k % len(steps)] for k in range(max(len(steps), HVD_WARM_STEPS))]
    times, delays, samples = [], [], []
    for i in range(n):
        for j in range(n):
            out = horovod_steps(warm + steps, threshold, cycle_us, loop, (i + 0.5) / n * cycle_us, uncached,
                                (j + 0.5) / n * cycle_us)[len(warm):]
            for step_us, buffers in out:
                times.append(step_us)
                delays.append(_loop_delay(buffers))
                samples.append((step_us, buffers))
    middle = statistics.median(times)
    typical = min(samples, key=lambda s: abs(s[0] - middle))[1]
    return LoopRun(_trimmed_mean(times), statistics.median(delays), typical)


def _busy_before(buffers: list[Buffer], t: float) -> float:
    """µs of the step's first ``t`` µs in which one of ``buffers`` (run one after the other) was being reduced."""
    return sum(max(0.0, min(end, t) - max(start, 0.0)) for _, _, start, end in buffers if start < t)


def interfered_loop(loop: HorovodLoop, steps: list[list[Unit]], threshold: float, cycle_ms: float,
                    uncached: frozenset[str], slowdown: float, recorded: LoopRun | None) -> LoopRun:
    """``simulate_loop`` with compute slowed by the allreduces that overlap it (``dpro.sim.interference``).

    The recorded launch times already hold the slowdown of the recorded setting's overlap (``recorded``: that
    setting simulated). Compute of ``t`` µs, ``b`` of them overlapped, ran ``slowdown * b / (1 + slowdown * b / t)``
    longer than it would alone (``d0 * (1 + k f)`` with ``f = b / t``): under another setting a gradient is launched
    later by what its allreduce time before it adds, less what the recorded one's added (earlier, when it adds
    less). The shift moves the buffers, so it is settled over a few rounds."""
    run = simulate_loop(loop, steps, threshold, cycle_ms, uncached)
    if slowdown <= 0.0 or recorded is None:
        return run

    def added(busy: float, elapsed: float) -> float:
        return slowdown * busy / (1.0 + slowdown * busy / elapsed) if elapsed > 0 else 0.0

    shifted = steps
    for _ in range(INTERFERENCE_ROUNDS):
        shifted = [[(names, nbytes, ready + added(_busy_before(run.buffers, now), now) -
                     added(_busy_before(recorded.buffers, ready), ready))
                    for (names, nbytes, ready), (_, _, now) in zip(units, moved, strict=True)]
                   for units, moved in zip(steps, shifted, strict=True)]
        run = simulate_loop(loop, shifted, threshold, cycle_ms, uncached)
    return run


def _transfer(ctx: Context) -> TransferSlowdown | None:
    """The transfer probe's stretch of an allreduce beside compute, when what-ifs apply it: a buffer reduced while
    the step still computes (no fusion: one per tensor, all through the backward) waits for a core and moves
    slower, as a DDP bucket does."""
    transfer = ctx.interference.transfer
    return transfer if transfer is not None and transfer.applies else None


def _slowdown(ctx: Context) -> float:
    """The fitted slowdown of overlapped compute when what-ifs apply it (``Interference.applies``), else 0."""
    return ctx.interference.slowdown if ctx.interference.applies else 0.0


def _unit_steps(ctx: Context, launches: list[dict[str, float]], groups: list[list[str]] | None = None,
                ) -> list[list[Unit]]:
    return [_units(ctx, groups, ready) for ready in launches]


def horovod_loop(ctx: Context, launches: list[dict[str, float]] | None = None) -> HorovodLoop:
    """Calibrate ``HorovodLoop`` from the recorded run.

    Per step, each buffer could start when its last tensor was launched on every rank and the buffer
    before it had finished; it started later. Two buffers agreed on in the same cycle (the timeline's
    negotiation of the second ended before the first started) ran back to back: the median of their
    distance is the gap between buffers. The wake time (from the cycle's start on the last rank to its
    first buffer) is the one with which the loop model (``simulate_loop`` over the recorded steps' launch
    times, under the setting in force) adds as much delay per step as the recording did (medians over
    steps): it holds the ranks' agreement and, on a busy machine, the time the background threads wait to
    be scheduled.
    """
    comm = horovod_comm_model(ctx)
    memcpy = horovod_memcpy_us_per_byte(ctx)
    coordinate = comm.allreduce_us(0)
    threshold, cycle_ms, cache = knobs_in_force(ctx)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for b in _hvd_buffers(ctx):
        if all(k in b for k in ("start_us", "end_us", "last_launch_us")):
            by_step.setdefault(b["step"], []).append(b)
    gaps, added = [], []
    for buffers in by_step.values():
        buffers.sort(key=lambda b: b["start_us"])
        added.append(_loop_delay([(b["tensors"], b["last_launch_us"], b["start_us"], b["end_us"]) for b in buffers]))
        for previous, b in zip(buffers, buffers[1:], strict=False):
            if b.get("negotiated_us", float("inf")) <= previous["start_us"]:
                gaps.append(b["start_us"] - previous["end_us"])
    gap = max(0.0, statistics.median(gaps)) if gaps else 0.0
    steps = _unit_steps(ctx, launches if launches is not None else recorded_launches(ctx))
    names = [n for n, _ in ctx.gradients]
    uncached = frozenset(names[max(0, cache):])
    if not added:
        return _loop_to_recorded_step(ctx, comm, memcpy, steps, uncached)
    target = statistics.median(added)

    def delay_with(wake: float) -> float:
        trial = HorovodLoop(comm, memcpy, wake, gap, 2 * max(coordinate, wake), transfer=_transfer(ctx))
        return simulate_loop(trial, steps, threshold, cycle_ms, uncached).delay_us

    lo, hi = 0.0, max(target, 1.0)
    if delay_with(lo) >= target:
        wake = lo
    else:
        while delay_with(hi) < target and hi < 1e7:
            hi *= 2
        for _ in range(20):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if delay_with(mid) < target else (lo, mid)
        wake = (lo + hi) / 2
    # without the response cache a cycle sends the requests to rank 0 and the responses back: two more
    # rounds of the background threads, each priced like the cycle's own agreement (not measured)
    return HorovodLoop(comm, memcpy, wake, gap, 2 * max(coordinate, wake), transfer=_transfer(ctx), source=
                       f"{sum(len(v) for v in by_step.values())} buffers of {len(by_step)} steps (timeline): "
                       f"{target / 1000:.2f} ms of loop delay per step; {comm.source}")


def _loop_to_recorded_step(ctx: Context, comm: CommModel, memcpy: float, steps: list[list[Unit]],
                           uncached: frozenset[str]) -> HorovodLoop:
    """The loop of a run without a Horovod timeline: a buffer's fixed cost (and the cycle's agreement, priced like
    it) scaled so that the setting in force, simulated over the recorded launches, takes the recorded step within
    twice its standard error (to the nearer edge: a setting whose step hardly depends on that cost, a few fused
    buffers after the backward, would otherwise turn a small mismatch into a large one).

    Without the timeline that fixed cost is a guess (the probe's, or the shortest allreduce the steps recorded,
    which holds the queueing of an unfused job); a loop that runs the recorded setting 40% longer or shorter
    than the step it models prices every other setting's difference from a wrong base."""
    threshold, cycle_ms, _ = knobs_in_force(ctx)
    recorded = predict(ctx, {}).predicted_step_ms * 1000.0
    band = 2000.0 * step_stderr_ms(ctx)

    def loop_at(scale: float) -> HorovodLoop:
        scaled = dataclasses.replace(comm, latency_us=comm.latency_us * scale)
        coordinate = scaled.allreduce_us(0)
        return HorovodLoop(scaled, memcpy, coordinate, 0.0, 2 * coordinate, transfer=_transfer(ctx))

    def step_at(scale: float) -> float:
        return simulate_loop(loop_at(scale), steps, threshold, cycle_ms, uncached).step_us

    as_fitted = step_at(1.0) if comm.latency_us > 0 and steps else recorded
    if abs(as_fitted - recorded) <= band:
        return dataclasses.replace(loop_at(1.0), source=f"no Horovod timeline: {comm.source} (the setting in force "
                                   "takes the recorded step within twice its standard error)")
    target = recorded + band if as_fitted > recorded else recorded - band
    scale = scale_to_reach(step_at, target, *LOOP_SCALES, rounds=20)
    return dataclasses.replace(loop_at(scale), source=f"no Horovod timeline: a buffer's fixed cost "
                               f"{comm.latency_us * scale * 2 * (comm.world_size - 1):.0f} us (x{scale:.2f} of "
                               f"{comm.source}), so the setting in force takes the recorded step")


def _ready_after_comm(ctx: Context) -> dict[str, float]:
    """When each gradient is launched on its last rank, µs after the previous step's last allreduce ended,
    in the replay of the recorded step."""
    g = graph_from_steps(ctx.base, iterations=4)
    sched = replay(g, plan_levels(g))
    last = int(g.iteration.max())
    ends = [sched.end[n] for n in range(g.size) if g.iteration[n] == last - 1 and g.category[n] == "XFER"]
    anchor = max(ends) if ends else min(sched.end[n] for (_, it), n in g.step_end.items() if it == last - 1)
    tensors = {op.name: op.args.get("tensors") or [] for ops in ctx.base.ops.values() for op in ops
               if op.category == "COMM"}
    ready: dict[str, float] = {}
    for n in range(g.size):
        if g.iteration[n] == last and g.category[n] == "COMM" and g.rank[n] >= 0:
            for t in tensors.get(g.names[n], []):
                ready[t] = max(ready.get(t, float("-inf")), float(sched.end[n]) - anchor)
    if len(ready) < len(ctx.gradients):  # no per-tensor launches: the ends of the backward ops
        by_bw = gradient_ready_us(ctx)
        step_start = min(sched.end[n] for (_, it), n in g.step_end.items() if it == last - 1)
        for name, _ in ctx.gradients:
            ready.setdefault(name, by_bw[name] + step_start - anchor)
    return ready


def _units(ctx: Context, groups: list[list[str]] | None = None,
           ready: dict[str, float] | None = None) -> list[Unit]:
    ready = ready or gradient_ready_us(ctx)
    sizes = dict(ctx.gradients)
    order = {n: i for i, (n, _) in enumerate(ctx.gradients)}
    grouped = {n for g in groups or [] for n in g}
    units = [(list(g), sum(sizes[n] for n in g), max(ready[n] for n in g)) for g in groups or [] if g]
    units += [([n], sizes[n], ready[n]) for n, _ in ctx.gradients if n not in grouped]
    return sorted(units, key=lambda u: (u[2], order[u[0][0]]))


def knobs_in_force(ctx: Context) -> tuple[float, float, int]:
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
    """Whether hierarchical allreduce / allgather could apply (several hosts, several ranks on one), and why.

    Horovod's own view (``hvd.local_size()``, ``hvd.cross_size()``, recorded in run.json) when there,
    else the host names of run.json."""
    meta = (ctx.run.meta or {}) if ctx.run is not None else {}
    sizes = meta.get("horovod") or {}
    local, cross = sizes.get("local_size"), sizes.get("cross_size")
    if not (isinstance(local, int) and isinstance(cross, int)):
        per_host: dict[str, int] = {}
        for h in meta.get("hosts") or []:
            per_host[h] = per_host.get(h, 0) + 1
        local, cross = max(per_host.values(), default=1), len(per_host) or 1
    if cross <= 1:
        return False, ("not applicable: every rank is on one host, where hierarchical allreduce/allgather is "
                       "the flat ring")
    if local <= 1:
        return False, ("not applicable: one rank per host, so the local reduction is empty and "
                       "HOROVOD_HIERARCHICAL_ALLREDUCE / ALLGATHER equal the flat ring")
    return True, (f"{cross} hosts with {local} ranks each: hierarchical allreduce could apply, but dpro "
                  "measures no intra-host bandwidth apart from the ring's, so it is not priced (try "
                  "HOROVOD_HIERARCHICAL_ALLREDUCE=1 and compare)")


def _uncached(ctx: Context, capacity: int) -> frozenset[str]:
    names = [n for n, _ in ctx.gradients]
    return frozenset(names[max(0, capacity):])


def horovod_fusion(ctx: Context, thresholds_mb: tuple[float, ...] = HVD_THRESHOLDS_MB,
                   cycles_ms: tuple[float, ...] = HVD_CYCLES_MS) -> list[dict[str, Any]]:
    """Search ``HOROVOD_FUSION_THRESHOLD`` x ``HOROVOD_CYCLE_TIME`` with a model of Horovod's loop.

    Each candidate is simulated over the recorded steps (``simulate_loop``: the launch times of every
    recorded step, the loop calibrated by ``horovod_loop``; ``interfered_loop`` when a measured slowdown of
    overlapped compute applies); its value is the simulated step time. The
    setting in force is evaluated the same way (``"in_force": True``), so gains compare like with like.
    Returns one dict per candidate, best first: ``threshold_bytes``, ``cycle_time_ms``,
    ``predicted_step_ms`` (the loop model's), ``buffers`` (gradient names per fused buffer of a typical
    step). The best also gets ``tensor_groups`` (``best_grouping``'s groups, for
    ``hvd.DistributedOptimizer(groups=)``), ``tensor_groups_predicted_step_ms`` (those groups as units under
    the best setting), ``comm_model`` (the calibrated loop) and ``cache`` (the response cache in force,
    holding every tensor, and the step without it).
    """
    launches = recorded_launches(ctx)
    loop = horovod_loop(ctx, launches)
    steps = _unit_steps(ctx, launches)
    threshold0, cycle0, cache0 = knobs_in_force(ctx)
    cache = max(cache0, len(ctx.gradients)) if cache0 > 0 else 0
    slowdown = _slowdown(ctx)
    recorded = simulate_loop(loop, steps, threshold0, cycle0, _uncached(ctx, cache0)) if slowdown else None
    results: list[dict[str, Any]] = []
    grid = [(t * MB, c) for t in thresholds_mb for c in cycles_ms]
    if not any(abs(t - threshold0) < 1 and abs(c - cycle0) < 1e-9 for t, c in grid):
        grid.append((threshold0, cycle0))
    for threshold, cycle in grid:
        in_force = abs(threshold - threshold0) < 1 and abs(cycle - cycle0) < 1e-9
        capacity = cache0 if in_force else cache
        run = interfered_loop(loop, steps, threshold, cycle, _uncached(ctx, capacity), slowdown, recorded)
        results.append({"threshold_bytes": int(threshold), "threshold_mb": threshold / MB, "cycle_time_ms": cycle,
                        "predicted_step_ms": run.step_us / 1000.0, "buffers": [b[0] for b in run.buffers],
                        "in_force": in_force, "cache_capacity": capacity})
    results.sort(key=lambda r: (round(r["predicted_step_ms"], 6), -r["threshold_bytes"], r["cycle_time_ms"]))
    best = results[0]
    groups, _ = best_grouping(ctx)
    grouped = interfered_loop(loop, _unit_steps(ctx, launches, groups), best["threshold_bytes"],
                              best["cycle_time_ms"], _uncached(ctx, best["cache_capacity"]), slowdown, recorded)
    best["tensor_groups"] = groups
    best["tensor_groups_predicted_step_ms"] = grouped.step_us / 1000.0
    best["comm_model"] = loop.describe()
    off = interfered_loop(loop, steps, best["threshold_bytes"], best["cycle_time_ms"], _uncached(ctx, 0), slowdown,
                          recorded)
    best["cache"] = {"capacity": best["cache_capacity"], "tensors": len(ctx.gradients),
                     "predicted_step_ms": best["predicted_step_ms"], "off_predicted_step_ms": off.step_us / 1000.0}
    return results


def horovod_predict(ctx: Context, threshold_bytes: float, cycle_ms: float,
                    cache_capacity: int | None = None) -> float:
    """Predicted step (ms) of the recorded job under one Horovod setting, as ``optimize_horovod`` reports it:
    the replay of the recorded step plus the loop model's difference from the setting in force."""
    launches = recorded_launches(ctx)
    loop = horovod_loop(ctx, launches)
    steps = _unit_steps(ctx, launches)
    threshold0, cycle0, cache0 = knobs_in_force(ctx)
    current = simulate_loop(loop, steps, threshold0, cycle0, _uncached(ctx, cache0))
    other = interfered_loop(loop, steps, threshold_bytes, cycle_ms,
                            _uncached(ctx, cache0 if cache_capacity is None else cache_capacity), _slowdown(ctx),
                            current)
    return predict(ctx, {}).predicted_step_ms + (other.step_us - current.step_us) / 1000.0


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
    worth, shown = clears(ctx, gain, current["predicted_step_ms"] + level, floor=HOROVOD_MIN_GAIN,
                          change=({THRESHOLD: current["threshold_bytes"], CYCLE: current["cycle_time_ms"]},
                                  {THRESHOLD: best["threshold_bytes"], CYCLE: best["cycle_time_ms"]}))
    worth = worth and best["predicted_step_ms"] + level > 0  # a step of no time is a model gone wrong, not a gain
    chosen = best if worth else current
    env = {"HOROVOD_FUSION_THRESHOLD": str(chosen["threshold_bytes"]),
           "HOROVOD_CYCLE_TIME": f"{chosen['cycle_time_ms']:g}"}
    knobs: dict[str, Any] = {"env": env}
    described = (f"{chosen['threshold_mb']:g} MB / {chosen['cycle_time_ms']:g} ms: "
                 f"{len(chosen['buffers'])} allreduce buffer(s) per step")
    space = (f"{len(results)} settings simulated: thresholds {HVD_THRESHOLDS_MB[0]:g}-{HVD_THRESHOLDS_MB[-1]:g} MB x "
             f"cycles {HVD_CYCLES_MS[0]:g}-{HVD_CYCLES_MS[-1]:g} ms")
    if _slowdown(ctx):
        space += (f"; backward overlapped by allreduces priced {100 * _slowdown(ctx):.0f}% slower when fully "
                  "overlapped, as the recorder's probe measured")
    if chosen is best:
        explain.append({"knob": "env", "predicted_gain_ms": gain,
                        "why": f"HOROVOD_FUSION_THRESHOLD / HOROVOD_CYCLE_TIME {described}; the setting in force "
                               f"({current['threshold_mb']:g} MB / {current['cycle_time_ms']:g} ms) replays at "
                               f"{baseline.predicted_step_ms:.2f} ms, this one at "
                               f"{best['predicted_step_ms'] + level:.2f} ms, {shown} ({space})"})
    else:
        explain.append({"knob": "env", "predicted_gain_ms": 0.0,
                        "why": f"the best setting found ({best['threshold_mb']:g} MB / {best['cycle_time_ms']:g} "
                               f"ms: {best['predicted_step_ms'] + level:.2f} ms against "
                               f"{baseline.predicted_step_ms:.2f} ms, {shown}) gains no more than the prediction "
                               f"can tell ({space}): the setting in force ({described}) is kept"})
    cache = best["cache"]
    _, _, cache0 = knobs_in_force(ctx)
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
    if chosen is best and clears(ctx, group_gain, chosen["predicted_step_ms"] + level, floor=HOROVOD_MIN_GAIN)[0]:
        knobs["tensor_groups"] = groups
        final_ms -= group_gain
    applied = "tensor_groups" in knobs
    grouped_ms = best["tensor_groups_predicted_step_ms"] + level
    explain.append({"knob": "tensor_groups", "predicted_gain_ms": max(0.0, group_gain) if applied else 0.0,
                    "why": f"optimal grouping by dynamic programming ({len(groups)} groups) as "
                           f"hvd.DistributedOptimizer(groups=): {grouped_ms:.2f} ms under "
                           f"{best['threshold_mb']:g} MB / {best['cycle_time_ms']:g} ms"
                           + ("" if applied else "; not applied (gain within the prediction's uncertainty, or the "
                                                 "setting kept)")})
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
