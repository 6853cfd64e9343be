"""Replay the recorded steps as they were, one after another, each with its own durations, gaps and transfers.

Every recorded step becomes a one-step ``StepModel`` of its own (on the aligned clock: a collective starts when the
rank that arrived last *in that step* arrives, and each rank sees it end when it did), and
``graph_from_step_sequence`` chains them on every rank. Replayed this way a run reproduces its own steps, so this
checks the DAG's wiring (which op waits for which), not a prediction: an op waiting for something it did not wait
for shows up as replayed steps longer than measured. ``dpro analyze`` notes it next to its prediction.

Both sides are summarised by ``typical_step_us``, the mean of the middle half of the steps: an outlier moves it
little, and unlike a median it does not move when the replay shifts time from one step to the next.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from dpro.dag.align import Alignment
from dpro.dag.graph import Graph
from dpro.dag.step_model import StepModel, step_model, wired_step_model
from dpro.dag.wiring import WiredStep, graph_from_step_sequence, stitch
from dpro.io.load import Run
from dpro.io.pool import jobs_wanted, map_shared
from dpro.sim.replay import Schedule, plan_levels, replay

__all__ = ["MAX_STEPS", "StepReplay", "one_step_models", "replay_recorded", "replay_recorded_run", "typical_step_us"]

MAX_STEPS = 256  # a longer window is thinned to this many evenly spaced steps (each is a model of its own)


@dataclass
class StepReplay:
    """Replayed step times (µs) per rank, one per iteration after the first, and the measured ones."""

    steps: list[int]
    measured_us: dict[int, list[float]]
    predicted_us: dict[int, list[float]]
    graph: Graph
    schedule: Schedule

    @property
    def measured_step_us(self) -> float:
        return statistics.median(typical_step_us(v) for v in self.measured_us.values())

    @property
    def predicted_step_us(self) -> float:
        return statistics.median(typical_step_us(v) for v in self.predicted_us.values())


def typical_step_us(durations: list[float]) -> float:
    """The mean of the middle half of ``durations`` (all of them when there are fewer than 4)."""
    values = sorted(durations)
    if not values:
        raise ValueError("no step durations")
    cut = len(values) // 4
    return statistics.fmean(values[cut:len(values) - cut])


def one_step_models(run: Run, alignment: Alignment, steps: list[int]) -> tuple[list[int], list[StepModel]]:
    """A ``StepModel`` of each step (up to ``MAX_STEPS``, evenly spaced), on the aligned clock."""
    if len(steps) > MAX_STEPS:
        stride = len(steps) / MAX_STEPS
        steps = [steps[int(i * stride)] for i in range(MAX_STEPS)]
    return steps, [step_model(run, alignment, steps=[step]) for step in steps]


PARALLEL_EVENTS = 1_000_000  # runs with this many events build their steps' models on several cores


def replay_recorded_run(run: Run, alignment: Alignment, steps: list[int], *, jobs: int | None = None) -> StepReplay:
    """``replay_recorded(*one_step_models(run, alignment, steps))``, holding one step's model at a time: each is
    wired once and dropped, and the replay chains the wirings (``dpro.dag.wiring.stitch``). The steps' models are
    built in ``jobs`` forked processes (``dpro.io.pool``; by default when the run holds ``PARALLEL_EVENTS``)."""
    if len(steps) > MAX_STEPS:
        stride = len(steps) / MAX_STEPS
        steps = [steps[int(i * stride)] for i in range(MAX_STEPS)]
    workers = min(jobs_wanted(jobs), len(steps))
    if jobs is None and sum(len(t.table) for t in run.ranks.values()) < PARALLEL_EVENTS:
        workers = 1
    parts: list[WiredStep] = []
    step_us: list[dict[int, float]] = []
    ranks: set[int] | None = None
    for wired, us, modelled in map_shared(_wired_step, (run, alignment), steps, workers):
        if wired is None:  # not stitched: the models are wired together
            return replay_recorded(*one_step_models(run, alignment, steps))
        parts.append(wired)
        step_us.append(us)
        ranks = modelled if ranks is None else ranks & modelled
    ordered = sorted(ranks or ())
    if len(parts) == 1:
        parts, step_us = parts * 2, step_us * 2
    g = stitch(parts)
    schedule = replay(g, plan_levels(g))
    measured = {r: [us[r] for us in step_us[1:]] for r in ordered}
    return StepReplay(steps[-len(parts) + 1:], measured, _periods(g, schedule, ordered, len(parts)), g, schedule)


def _wired_step(shared: tuple[Run, Alignment], step: int) -> tuple[WiredStep | None, dict[int, float], set[int]]:
    """One recorded step's model, wired (None where it cannot be stitched), its step times and its ranks."""
    run, alignment = shared
    model, wired = wired_step_model(run, alignment, steps=[step])
    if model.exchanges or model.transfer_queues:
        return None, {}, set()
    return wired, model.step_us_by_rank, set(model.ops)


def _periods(g: Graph, schedule: Schedule, ranks: list[int], iterations: int) -> dict[int, list[float]]:
    return {r: [float(schedule.end[g.step_end[(r, it)]] - schedule.end[g.step_end[(r, it - 1)]])
                for it in range(1, iterations)] for r in ranks}


def replay_recorded(steps: list[int], models: list[StepModel]) -> StepReplay:
    """Replay the recorded steps in order, each with its own times (a check of the DAG's wiring: a step's replayed
    time runs from the end of the step before it, so the first step is not compared)."""
    ranks = sorted(set.intersection(*(set(m.ops) for m in models)))
    sequence = models if len(models) > 1 else models * 2
    g = graph_from_step_sequence(sequence)
    schedule = replay(g, plan_levels(g))
    measured = {r: [m.step_us_by_rank[r] for m in sequence[1:]] for r in ranks}
    return StepReplay(steps[-len(sequence) + 1:], measured, _periods(g, schedule, ranks, len(sequence)), g, schedule)
