"""Stage 3, the step model: the profiled steps of every rank (aligned clocks) summarised into one mean step (each
op's mean start and duration per rank, the collectives' calibrated transfers), steps far outside the others left
out; ``dpro.dag.wiring`` turns it into a ``Graph``."""

from __future__ import annotations

import math
import statistics
from array import array
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpro.dag.align import Alignment
from dpro.dag.wiring import WiredStep, wire_once
from dpro.errors import GraphError
from dpro.io.events import EventTable
from dpro.io.load import RankTrace, Run, format_steps
from dpro.record.trace import CATEGORIES

STEP_CODE = CATEGORIES.index("STEP")
NESTING_CODES = [CATEGORIES.index("FW"), CATEGORIES.index("BW")]  # modules nest; collectives in flight together do not
StepEvent = tuple[str, str, int, float, float, dict[str, Any]]  # name, category, tid, ts, dur, args

__all__ = ["MIN_MODEL_STEPS", "ExchangePart", "OpStats", "RankStep", "StepModel", "far_out_steps", "model_steps",
           "occurrence_name", "rank_steps", "step_model",
           "wired_step_model"]


@dataclass(slots=True)  # a thousand ranks' mean step holds hundreds of thousands of these
class OpStats:
    """One op of one rank, summarised over the profiled steps (means)."""

    name: str
    category: str
    queue: str
    rank: int
    order: float                 # mean start offset within the step (sorts program order)
    duration: float
    gap: float | None                 # None: derived from measured times when the graph is built
    args: dict = field(default_factory=dict)
    samples: list[float] = field(default_factory=list)  # its duration in each profiled step (µs; scale-out draws)


@dataclass
class ExchangePart:
    """One part of a parameter-server key: every rank's push to the server, the server's work once all pushes
    are in, and its answer to every rank. Each push and answer is a message on its worker's connection to the
    server, over the links it crosses (a host's outgoing and the other host's incoming link; none between
    processes of one host), shared with the other connections crossing them; the server's work takes its host's
    queue."""

    server_queue: str
    server_us: float
    push: dict[int, tuple[float, tuple[str, ...]]]   # rank -> (µs with the links to itself, links)
    pull: dict[int, tuple[float, tuple[str, ...]]]   # rank -> (µs with the links to itself, links)
    server: str                                      # the server process (one connection per worker and way)
    # the links the server's work takes a share of (its host's CPUs: ``StepModel.link_capacity``), its requests
    # one after another in the order they became ready; none: the server's work takes ``server_queue``
    server_links: tuple[str, ...] = ()


@dataclass
class StepModel:
    """Per-rank op lists of one step, ready to be wired into a graph."""

    ops: dict[int, list[OpStats]]                       # rank -> ops in program order
    transfer: dict[str, float]                          # collective name -> transfer µs (last arrival)
    measured_step_us: float
    step_us_by_rank: dict[int, float]
    steps: list[int]
    # rank -> the mean step's end after the end of the ops it waits for (filled in when the graph is built)
    tail_us: dict[int, float] = field(default_factory=dict)
    arrivals: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict)  # (COMM, step) -> rank -> t
    # collectives launched without waiting for the previous one's transfer (an engine that enqueues
    # requests and runs them from a background loop, one after another): arrivals follow only program order and the
    # compute that feeds them, and each transfer waits for the one before it
    async_launch: bool = False
    step_spans: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # (rank, step) -> aligned
    # collective -> its calibrated end in the mean step (µs from step start; "in-step" transfers): what the
    # ops after it measure their gap from, on every rank
    transfer_end: dict[str, float] = field(default_factory=dict)
    # each collective is launched only once the one before it has completed (TensorFlow chains its collectives
    # with ordering tokens): an arrival waits for the previous transfer (``Engine.chained_launch``)
    chained_launch: bool = False
    # the gradients' collectives start only once the whole backward is done (``Engine.comm_after_backward``)
    comm_after_backward: bool = False
    # collective -> the queues its transfer occupies (a parameter server's ``server<k>``: a server answers one
    # request after another); a collective without queues follows the one before it (``async_launch``)
    transfer_queues: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # collective -> its parts as point-to-point exchanges with servers (a what-if of a parameter server); such a
    # collective has no shared transfer: each rank's copy ends when its answers are back
    exchanges: dict[str, list[ExchangePart]] = field(default_factory=dict)
    # rank -> the link its compute takes a share of while it runs (its host's CPUs, shared with the servers there)
    compute_links: dict[int, str] = field(default_factory=dict)
    link_capacity: dict[str, float] = field(default_factory=dict)  # link -> connections it carries at full rate
    link_weight: dict[str, float] = field(default_factory=dict)  # link -> how much of it one message takes
    # collective -> rank -> how long after the collective's end that rank saw it end (a model of one recorded step)
    done_after: dict[str, dict[int, float]] = field(default_factory=dict)
    # collectives whose transfer a fitted CommModel priced alone (a what-if's regrouping) rather than the step
    # measured it beside the compute: the ones the transfer side of interference slows (``dpro.sim.interference``)
    priced_transfers: set[str] = field(default_factory=set)
    # step -> its duration (µs, median over ranks): steps far outside the others, in neither the model nor the
    # measured step (``far_out_steps``)
    left_out_steps: dict[int, float] = field(default_factory=dict)


FAR_OUT_IQR = 3.0  # Tukey's "far out": beyond the quartiles by 3 interquartile ranges
FAR_OUT_MIN_STEPS = 8  # fewer steps give no quartiles to judge by
FAR_OUT_RATIO = 2.0  # with fewer: a step more than twice the median of the others (a stall, a compile)


MIN_MODEL_STEPS = 3  # steps the step model is built from, at least, before set-aside steps are used


def far_out_steps(run: Run, steps: list[int]) -> dict[int, float]:
    """Steps whose duration (median over ranks) lies beyond ``FAR_OUT_IQR`` interquartile ranges outside the
    quartiles of the others: a collection, a checkpoint, a neighbour taking the CPU. Their ops would move every op's
    mean; they are left out of the step model and of the measured step alike, and the analysis names them.
    With fewer than ``FAR_OUT_MIN_STEPS`` steps (3 at least) there are no quartiles to judge by: a step longer than
    ``FAR_OUT_RATIO`` times the median of the others is far out, fewer than half of the steps at most."""
    if len(steps) < 3:
        return {}
    wanted = set(steps)
    by_step: dict[int, list[float]] = defaultdict(list)
    for trace in run.ranks.values():
        t = trace.table
        marks = np.flatnonzero(t.cat == STEP_CODE)
        for step, dur in zip(t.step[marks].tolist(), t.dur[marks].tolist(), strict=True):
            if step in wanted:
                by_step[step].append(dur)
    durations = {step: statistics.median(v) for step, v in by_step.items()}
    if len(durations) < 3:
        return {}
    if len(durations) < FAR_OUT_MIN_STEPS:
        out = {step: d for step, d in sorted(durations.items())
               if d > FAR_OUT_RATIO * statistics.median(o for s, o in durations.items() if s != step)}
        return out if 2 * len(out) < len(durations) else {}
    q1, _, q3 = statistics.quantiles(durations.values(), n=4)
    fence = FAR_OUT_IQR * (q3 - q1)
    return {step: d for step, d in sorted(durations.items()) if d > q3 + fence or d < q1 - fence}


def _same_collective_order(ops: dict[int, list[OpStats]]) -> None:
    """Issue collectives in one order on every rank (engines require it; means can disagree).

    Each rank keeps the positions of its COMM ops; they are refilled in the order of the mean
    measured launch time over ranks.
    """
    launches: dict[str, list[float]] = defaultdict(list)
    for rank_ops in ops.values():
        for op in rank_ops:
            if op.category == "COMM":
                launches[op.name].append(op.order)
    canonical = sorted(launches, key=lambda name: (statistics.fmean(launches[name]), name))
    rank_of = {name: i for i, name in enumerate(canonical)}
    for rank_ops in ops.values():
        slots = [i for i, op in enumerate(rank_ops) if op.category == "COMM"]
        comm = sorted((rank_ops[i] for i in slots), key=lambda op: rank_of[op.name])
        for i, op in zip(slots, comm, strict=True):
            rank_ops[i] = op


def _transfer_times(comm_by_step: dict[tuple[str, int], dict[int, tuple[float, float]]], order: list[str],
                    steps: list[int], n_ranks: int) -> dict[str, float]:
    """Transfer time of each collective: from the moment it could start (the last rank has arrived
    and the previous collective has finished somewhere, so the engine is free) to its end on the
    last-arriving rank. Early ranks' durations hold waiting, and a collective queued behind another
    holds that one's time: neither is transfer. Times are aligned; medians over steps."""
    samples: dict[str, list[float]] = defaultdict(list)
    for step in steps:
        previous_end = float("-inf")
        for name in order:
            members = comm_by_step.get((name, step), {})
            if len(members) < n_ranks:
                continue
            late_start, late_end = max(members.values(), key=lambda se: se[0])
            begin = max(late_start, previous_end)
            samples[name].append(max(0.0, late_end - begin))
            previous_end = min(end for _, end in members.values())
    return {name: statistics.median(v) for name, v in samples.items()}


def occurrence_name(name: str, earlier: int) -> str:
    """The node name of an op's run in a step after ``earlier`` runs of it: ``FW.fc1``, ``FW.fc1#2``, ...
    An op runs several times per step under gradient accumulation (one forward and backward per
    micro-batch) or when a module is called twice; each run is a node of its own."""
    return name if earlier == 0 else f"{name}#{earlier + 1}"


def _transfer_times_in_step(comm_by_step: dict[tuple[str, int], dict[int, tuple[float, float]]], order: list[str],
                            steps: list[int], step_start: dict[tuple[int, int], float],
                            launched: dict[str, tuple[int, float]],
                            queues: dict[str, tuple[str, ...]] | None = None,
                            frame: dict[int, float] | None = None,
                            ) -> tuple[dict[str, float], dict[str, float], dict[str, dict[int, float]]]:
    """Transfer times such that the mean step's collectives end when they end, on average, in the recorded steps.

    For engines that decide at run time which collectives run together (an engine that fuses the tensors
    ready in one cycle, differently from step to step), a collective's transfer in one step is either
    empty (it completed with the one before it) or the whole fused buffer; the median of such a
    mixture, summed over a chain, is no step's. Here the mean step starts a collective when its
    latest rank launches it (``launched``: that rank and its mean launch, relative to its step
    start); the collective's end ``e`` is the mean over steps of its end on that rank, relative to
    that rank's step start; its transfer is ``e - max(launch, e of the collective before it)``: what
    remains after the later of the two, so the replayed chain ends each collective at its mean end.

    A collective with ``queues`` (the servers holding a parameter-server key) follows the one before it on those
    queues only, not the one before it in the step.

    ``frame``: when each rank's step started, on a clock common to the ranks (one recorded step: the aligned step
    starts, as the rank that launched last may differ from one collective to the next); none: every rank's step
    starts at 0 (the mean step). Ends are returned on that clock. With a frame, a collective ends when the first
    rank saw it end, and each rank that saw it end later gets how much later (a process descheduled on a busy host
    takes its result late; the others have moved on).

    Returns (transfer µs, ``e`` µs) per collective, and (with a frame) rank -> µs it saw the end later.
    """
    out: dict[str, float] = {}
    ends: dict[str, float] = {}
    done_after: dict[str, dict[int, float]] = {}
    chain = float("-inf")
    queue_end: dict[str, float] = {}
    for name in order:
        own = (queues or {}).get(name, ())
        previous = max((queue_end.get(q, float("-inf")) for q in own), default=float("-inf")) if own else chain
        if name not in launched:
            continue
        rank, launch = launched[name]
        samples = [members[rank][1] - step_start[(rank, step)] for step in steps
                   if rank in (members := comm_by_step.get((name, step), {})) and (rank, step) in step_start]
        if not samples:
            continue
        if frame is None:
            e = statistics.fmean(samples)
        else:  # one step: the collective ends when its first rank sees it end; the others see it later (done_after)
            seen = {r: end - step_start[(r, step)] + frame.get(r, 0.0) for step in steps
                    for r, (_, end) in comm_by_step.get((name, step), {}).items() if (r, step) in step_start}
            e = min(seen.values())
            done_after[name] = {r: t - max(e, previous) for r, t in seen.items() if t > max(e, previous)}
            launch += frame.get(rank, 0.0)
        out[name] = max(0.0, e - max(launch, previous))
        ends[name] = max(e, previous)
        if own:
            queue_end.update(dict.fromkeys(own, ends[name]))
        else:
            chain = ends[name]
    return out, ends, done_after


def _gradient_launches(events: list[StepEvent]) -> dict[str, float]:
    """Gradient -> when the first collective carrying it was launched (µs, the rank's clock)."""
    out: dict[str, float] = {}
    for e in events:
        if e[1] == "COMM":
            for grad in e[5].get("tensors") or ():
                out[grad] = min(out.get(grad, e[3]), e[3])
    return out


def _with_ready_times(ts: float, dur: float, args: dict, launch_of: dict[str, float]) -> dict:
    """A backward event's args with ``_ts`` and a ready time per gradient: the recorded one (its op's end when none
    is), or the launch of the collective carrying the gradient when that came first, since a collective cannot start
    before its gradient exists (a recorder that marks a whole layer's gradients ready at the layer's end; TensorFlow
    computes the weight gradient before the input's)."""
    grads = args["grads"]
    ready = args.get("grads_ready_us") or []
    if len(ready) != len(grads):
        ready = [ts + dur] * len(grads)
    ready = [min(t, launch_of[g]) if ts < launch_of.get(g, float("-inf")) < t else t
             for g, t in zip(grads, ready, strict=True)]
    return {**args, "_ts": ts, "grads_ready_us": ready}


@dataclass(slots=True)
class _OpSamples:
    """One op of one rank over the steps read: its start in each step (packed doubles: millions of them, alive only
    until the means), its duration, its args."""

    starts: array
    durations: list[float]
    args: list[dict]


def _median_ready_offsets(samples: list[dict]) -> dict[str, float]:
    """When each gradient of a backward op is ready, from the op's start (median over steps): a collective of a
    gradient can start then, before the op ends (it goes on computing other gradients and its input's)."""
    if not any(args.get("grads") for args in samples):
        return {}
    offsets: dict[str, list[float]] = defaultdict(list)
    for args in samples:
        t0 = args.get("_ts")
        ready = args.get("grads_ready_us") or []
        if t0 is None or len(ready) != len(args.get("grads") or []):
            continue
        for grad, t in zip(args["grads"], ready, strict=True):
            offsets[grad].append(t - t0)
    return {grad: statistics.median(v) for grad, v in offsets.items()}


@dataclass
class RankStep:
    """One rank's one recorded step as the step model reads it: its STEP mark (the rank's clock) and its ops in start
    order, each ``(node name, category, queue, start in the step, duration, args, ts)``; a backward op's args carry
    its gradients' ready times (``_with_ready_times``)."""

    t0: float
    duration: float
    ops: list[tuple[str, str, str, float, float, dict, float]]


def rank_steps(trace: RankTrace, steps: Iterable[int]) -> dict[int, RankStep | None]:
    """Each of ``steps`` of one rank, read off its columns (None: the rank has no STEP event for it): its STEP mark
    (the first), and its other events in start order, each event containing another on its queue left out
    (``_contained``, on the columns)."""
    t = trace.table
    wanted = sorted(set(steps))
    index = np.flatnonzero(np.isin(t.step, wanted))
    index = index[np.argsort(t.step[index], kind="stable")]  # by step, file order within a step
    is_mark = t.cat[index] == STEP_CODE
    marks = index[is_mark]
    first_mark = dict(zip(t.step[marks][::-1].tolist(), marks[::-1].tolist(), strict=True))  # the first one wins
    work = index[~is_mark]
    work = work[~_contained_columns(t, work)]
    work = work[np.lexsort((t.ts[work], t.step[work]))]  # start order within each step (stable: file order on ties)
    cuts = np.searchsorted(t.step[work], wanted, side="left").tolist() + [work.size]
    names, arg_sets, queues = t.names, t.arg_sets, trace.queues
    rows = list(zip([names[n] for n in t.name[work].tolist()], [CATEGORIES[c] for c in t.cat[work].tolist()],
                    t.tid[work].tolist(), t.ts[work].tolist(), t.dur[work].tolist(),
                    [arg_sets[a] for a in t.arg[work].tolist()], strict=True))
    out: dict[int, RankStep | None] = {}
    for k, s in enumerate(wanted):
        mark = first_mark.get(s)
        out[s] = None if mark is None else _rank_step(float(t.ts[mark]), float(t.dur[mark]),
                                                      rows[cuts[k]:cuts[k + 1]], queues)
    return out


def _contained_columns(t: EventTable, work: np.ndarray) -> np.ndarray:
    """``_contained`` over the events ``work`` of several steps (by step, file order within one): a mask of the FW/BW
    events that contain the next one on their queue, in (start, longest first) order within their step."""
    out = np.zeros(work.size, dtype=bool)
    nesting = np.flatnonzero(np.isin(t.cat[work], NESTING_CODES))
    if nesting.size < 2:
        return out
    ev = work[nesting]
    ts, dur = t.ts[ev], t.dur[ev]
    order = np.lexsort((-dur, ts, t.tid[ev], t.step[ev]))  # stable: the list's order on ties
    ts, dur, step, tid = ts[order], dur[order], t.step[ev][order], t.tid[ev][order]
    a, b = slice(None, -1), slice(1, None)
    inside = (step[a] == step[b]) & (tid[a] == tid[b]) & (ts[b] + dur[b] <= ts[a] + dur[a] + 1e-3) & (ts[b] >= ts[a])
    out[nesting[order[:-1][inside]]] = True
    return out


def _rank_step(t0: float, duration: float, work: list[StepEvent], queues: dict[int, str]) -> RankStep:
    launch_of = _gradient_launches(work)
    runs: dict[str, int] = defaultdict(int)
    ops = []
    for name, cat, tid, ts, dur, args in work:
        node = occurrence_name(name, runs[name])
        runs[name] += 1
        if cat == "BW" and args.get("grads"):
            args = _with_ready_times(ts, dur, args, launch_of)
        ops.append((node, cat, queues.get(tid, str(tid)), ts - t0, dur, args, ts))
    return RankStep(t0, duration, ops)


def model_steps(run: Run) -> tuple[list[int], dict[int, float]]:
    """The steps ``step_model`` summarises (those every rank recorded, less those the engine set aside while
    ``MIN_MODEL_STEPS`` others remain, less those far outside the others), and the far-out ones (``far_out_steps``).

    Raises:
        GraphError: the ranks have no recorded step in common.
    """
    steps = sorted(set.intersection(*(set(t.steps) for t in run.ranks.values()))) if run.ranks else []
    if not steps:
        listed = ", ".join(f"rank {r}: {format_steps(t.steps)}" for r, t in sorted(run.ranks.items()))
        raise GraphError(f"{run.path}: the ranks have no profiled step in common ({listed}); "
                         "record the same window on every rank")
    kept = [step for step in steps if step not in run.set_aside]
    if len(kept) >= MIN_MODEL_STEPS:
        steps = kept
    left_out = far_out_steps(run, steps)
    return [step for step in steps if step not in left_out], left_out


def step_model(run: Run, alignment: Alignment, *, transfers: str | None = None,
               steps: list[int] | None = None) -> StepModel:
    """The step model of ``run`` (``wired_step_model``, without its wiring)."""
    return wired_step_model(run, alignment, transfers=transfers, steps=steps)[0]


def wired_step_model(run: Run, alignment: Alignment, *, transfers: str | None = None,
                     steps: list[int] | None = None) -> tuple[StepModel, WiredStep]:
    """Summarise the profiled steps of every rank (aligned clocks) into one mean step: each op's mean start and
    duration (means, not medians: a step is a sum of its ops; medians of skewed parts add up to no step, and
    replay short). Steps far outside the others are left out first
    (``far_out_steps``), so that one stall does not move every op's mean; the measured step is the mean of the
    same steps. Steps the engine set aside (``Run.set_aside``) are not used while ``MIN_MODEL_STEPS`` others are.

    ``transfers``: how collectives' transfer times are calibrated, ``"per-step"`` (medians of each
    step's transfer, ``_transfer_times``) or ``"in-step"`` (from mean arrival and end times within
    the step, ``_transfer_times_in_step``); default: what the run's engine says
    (``Engine.transfer_calibration``, ``"in-step"`` unless an engine says otherwise).

    ``steps``: a model of exactly these steps, none set aside or left out (``dpro.sim.steps``: one recorded step).
    """
    from dpro.engines import get_engine  # the registry imports engine modules, which import this one

    engine = get_engine((run.meta or {}).get("engine"))
    if transfers is None:
        transfers = engine.transfer_calibration
    chained = engine.chained_launch
    left_out: dict[int, float] = {}
    if steps is None:
        steps, left_out = model_steps(run)
    per_rank: dict[int, tuple[dict[str, _OpSamples], dict[str, str]]] = {}  # rank -> its ops' samples, queues
    step_us: dict[int, list[float]] = defaultdict(list)
    comm_by_step: dict[tuple[str, int], dict[int, tuple[float, float]]] = defaultdict(dict)
    starts: dict[tuple[int, int], float] = {}
    spans: dict[tuple[int, int], tuple[float, float]] = {}
    cat_of: dict[str, str] = {}
    transfer_queues: dict[str, tuple[str, ...]] = {}
    for rank, trace in run.ranks.items():
        shift = alignment.offset_us.get(rank, 0.0)
        recorded = rank_steps(trace, steps)
        samples_of: dict[str, _OpSamples] = {}
        queue_of: dict[str, str] = {}
        for step in steps:
            one = recorded[step]
            if one is None:
                raise GraphError(f"{run.path}: rank {rank} has events of step {step} but no STEP event marking "
                                 "its boundaries")
            starts[(rank, step)] = one.t0 - shift
            spans[(rank, step)] = (one.t0 - shift, one.t0 - shift + one.duration)
            step_us[rank].append(one.duration)
            for name, cat, q, start, dur, args, ts in one.ops:
                got = samples_of.get(name)
                if got is None:
                    got = samples_of[name] = _OpSamples(array("d"), [], [])
                got.starts.append(start)
                got.durations.append(dur)
                got.args.append(args)
                queue_of[name] = q
                cat_of[name] = cat
                if cat == "COMM":
                    comm_by_step[(name, step)][rank] = (ts - shift, ts + dur - shift)
                    queues = engine.transfer_queues(run, args)
                    if queues:
                        transfer_queues[name] = queues
        per_rank[rank] = (samples_of, queue_of)
    ops: dict[int, list[OpStats]] = defaultdict(list)
    for rank, name, samples, queue in ((rank, name, samples, queue_of[name])
                                       for rank, (samples_of, queue_of) in per_rank.items()
                                       for name, samples in samples_of.items()):
        n = len(samples.starts)
        if 2 * n < len(steps) and cat_of[name] != "COMM":
            # an op in fewer than half of the steps (a source whose ops split or merge differently from step to
            # step) is no part of the mean step: its time stays in the gap before the op after it
            continue
        order = math.fsum(samples.starts) / n  # statistics.fmean's own sum, without its per-call overhead
        duration = math.fsum(samples.durations) / n
        if transfers == "in-step" and cat_of[name] == "COMM":
            ends = [a + b for a, b in zip(samples.starts, samples.durations, strict=True)]
            duration = max(0.0, math.fsum(ends) / n - order)  # ends at its mean end
        args = dict(samples.args[-1])
        args.pop("_ts", None)
        if cat_of[name] == "BW":
            args["grads_ready_offset_us"] = _median_ready_offsets(samples.args)
        ops[rank].append(OpStats(
            name=name, category=cat_of[name], queue=queue, rank=rank,
            order=order, duration=duration, gap=None, args=args, samples=samples.durations))
    if not ops:
        raise GraphError(f"{run.path}: the profiled steps ({format_steps(steps)}) hold no operation besides their STEP "
                         "markers; nothing to replay")
    for rank in ops:
        ops[rank].sort(key=lambda o: o.order)
    _same_collective_order(ops)
    canonical = [op.name for op in next(iter(ops.values())) if op.category == "COMM"] if ops else []
    if transfers == "in-step":
        launched: dict[str, tuple[int, float]] = {}
        # the mean step starts on every rank at once; one recorded step starts when it started on each rank, so the
        # rank that arrived last is the latest in aligned time, not the one latest into its own step
        frame = {rank: starts[(rank, steps[0])] - min(starts.values()) for rank in ops} if len(steps) == 1 else None
        latest: dict[str, float] = {}
        for rank, rank_ops in sorted(ops.items()):
            at = (frame or {}).get(rank, 0.0)
            for op in rank_ops:
                if op.category == "COMM" and (op.name not in launched or at + op.order > latest[op.name]):
                    launched[op.name] = (rank, op.order)
                    latest[op.name] = at + op.order
        if len(ops) < len(run.ranks):
            launched = {}
        transfer, transfer_end, done_after = _transfer_times_in_step(
            comm_by_step, canonical, steps, starts, launched, transfer_queues, frame)
        if frame is not None:
            transfer_end = {}  # one recorded step: each rank measures the ops after a collective from its own end
    else:
        transfer, transfer_end, done_after = _transfer_times(comm_by_step, canonical, steps, len(run.ranks)), {}, {}
    measured = statistics.median(statistics.fmean(v) for v in step_us.values())
    arrivals = {key: {r: se[0] for r, se in members.items()} for key, members in comm_by_step.items()}
    model = StepModel(
        ops=dict(ops), transfer=transfer,
        measured_step_us=measured, step_us_by_rank={r: statistics.fmean(v) for r, v in step_us.items()},
        steps=steps, arrivals=arrivals,
        async_launch=transfers == "in-step", step_spans=spans, transfer_end=transfer_end, chained_launch=chained,
        comm_after_backward=engine.comm_after_backward, transfer_queues=transfer_queues, done_after=done_after,
        left_out_steps=left_out,
    )
    # wiring it once fills in the measured gaps and tails, so that a what-if's transformed copy keeps them (a tail
    # filled in on a changed step would stretch that step back to the measured one); the wiring is returned too, so
    # the replay chains copies of it (``dpro.dag.wiring.stitch``) instead of wiring the ops again
    return model, wire_once(model)
