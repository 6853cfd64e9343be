"""Replay the recorded steps one after another, each with its own durations, gaps and transfers.

The median step (``dag.graph.step_model``) is one step built from each op's median. When the ranks' steps vary a
lot and independently (CPU jobs, TensorFlow's executor), a collective in a real step starts when the *later* rank of
*that* step arrives; in the median step it starts at the later of the ranks' *medians*, which is earlier. Replaying
each recorded step as it was, chained on every rank, keeps which rank was late in which step, and the replayed steps
can be compared with the measured ones one by one.

Both sides are summarised by ``dag.graph.typical_step_us``, the mean of the middle half of the steps: unlike the
median, it is not moved by time that the replay shifts from one step to the next (a rank's step boundary replayed a
little earlier or later than it was measured).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from dataclasses import dataclass

from dpro.dag.align import Alignment
from dpro.dag.graph import Graph, StepModel, graph_from_step_sequence, step_model, typical_step_us
from dpro.io.load import Run
from dpro.sim.replay import Schedule, plan_levels, replay

__all__ = ["MAX_REPLAYED_STEPS", "StepReplay", "replay_recorded_steps"]

MAX_REPLAYED_STEPS = 256  # a longer window is thinned to this many evenly spaced steps (the graph grows per step)


@dataclass
class StepReplay:
    """Each recorded step, measured and replayed (µs), per rank, in step order."""

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


def _single_step_runs(run: Run, steps: list[int]) -> list[Run]:
    """One ``Run`` per step holding only that step's events (read once, not once per step)."""
    events: dict[tuple[int, int], list[dict]] = defaultdict(list)
    wanted = set(steps)
    for rank, trace in run.ranks.items():
        for e in trace.events:
            step = e["args"].get("step")
            if step in wanted:
                events[(rank, step)].append(e)
    return [dataclasses.replace(run, ranks={
        rank: dataclasses.replace(trace, steps=[step], events=events[(rank, step)])
        for rank, trace in run.ranks.items()}) for step in steps]


def replay_recorded_steps(run: Run, alignment: Alignment, model: StepModel) -> StepReplay:
    """Replay ``model.steps`` (the steps every rank recorded) in order, each from its own measurements.

    A step's replayed time on a rank runs from the end of its previous step to its own end there, so the first
    recorded step is only the others' start: how the ranks entered it depends on steps before the window. It is
    compared only when it is the one step recorded (then replayed twice).
    """
    steps = model.steps
    if len(steps) > MAX_REPLAYED_STEPS:
        stride = len(steps) / MAX_REPLAYED_STEPS
        steps = [steps[int(i * stride)] for i in range(MAX_REPLAYED_STEPS)]
    models = [step_model(one, alignment) for one in _single_step_runs(run, steps)]
    if len(models) == 1:
        models = models * 2
    g = graph_from_step_sequence(models)
    schedule = replay(g, plan_levels(g))
    ranks = sorted(model.ops)
    predicted = {r: [float(schedule.end[g.step_end[(r, it)]] - schedule.end[g.step_end[(r, it - 1)]])
                     for it in range(1, len(models))] for r in ranks}
    measured = {r: [m.step_us_by_rank[r] for m in models[1:]] for r in ranks}
    return StepReplay(steps=steps[-len(models) + 1:], measured_us=measured, predicted_us=predicted, graph=g,
                      schedule=schedule)
