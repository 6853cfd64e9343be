"""Prediction accuracy on PyTorch profiler (Kineto) traces: measured vs predicted step time per trace.

For each trace (one rank each): the profiled steps, the measured step (median ProfilerStep#N), the
predicted one (each step replayed with every op's mean time over the other steps: leave-one-step-out) and its
error, the first half of the steps predicting the second (out of sample), the exact replay of every step with its
own times (the DAG's wiring) and the predicted time to the step's last GPU op end. A second table checks that the
DAG is causal, not a copy of the timeline: the host step replayed again with every GPU op twice as long (a
GPU-bound job slows down, a host-bound one does not).

    python bench/kineto_accuracy.py [TRACE.json[.gz] ...]   (default: tests/data/kineto/*.json.gz)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from dpro.analyze import error_pct
from dpro.analyze.traces import analyze_traces, split_prediction
from dpro.dag.kineto import graph_from_kineto
from dpro.io.kineto import load_kineto
from dpro.report.tables import format_table
from dpro.sim.replay import replay

DEFAULT = sorted((Path(__file__).resolve().parents[1] / "tests" / "data" / "kineto").glob("*.json.gz"))
GPU_CATEGORIES = ("KERNEL", "MEMCPY", "MEMSET", "NCCL")


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def accuracy_row(path: Path) -> list[str]:
    """file, steps, measured ms, predicted ms (leave-one-step-out), error %, first half -> second half error %,
    exact replay ms, predicted device-end ms, seconds."""
    t0 = time.perf_counter()
    trace = load_kineto(path)
    a = analyze_traces([trace])
    seconds = time.perf_counter() - t0
    predicted, measured = split_prediction([trace])
    steps = f"#{trace.steps[0].number}..#{trace.steps[-1].number}"
    return [path.name, steps, _fmt(a.measured_step_ms), _fmt(a.predicted_step_ms), _fmt(a.error_pct, "+.3f"),
            _fmt(error_pct(predicted, measured), "+.3f"), _fmt(a.per_rank[0].get("replayed_step_ms")),
            _fmt(a.per_rank[0]["predicted_device_end_ms"]), f"{seconds:.2f}"]


def sensitivity_row(path: Path, factor: float = 2.0) -> list[str]:
    """file, replayed host step, the same with GPU ops ``factor`` times longer, the ratio."""
    g, info = graph_from_kineto([load_kineto(path)])
    gpu = np.array([c in GPU_CATEGORIES for c in g.category])

    def host_ms() -> float:
        s = replay(g)
        return statistics.median(float(s.end[g.step_end[k]] - s.start[b]) for k, b in info.step_begin.items()) / 1e3

    base = host_ms()
    g.duration[gpu] *= factor
    slower = host_ms()
    return [path.name, f"{base:.2f}", f"{slower:.2f}", f"{slower / base:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path, default=DEFAULT)
    args = parser.parse_args()
    rows = [accuracy_row(p) for p in args.traces]
    print(format_table(["file", "steps", "measured ms", "predicted ms (host)", "error %", "1st half -> 2nd %",
                        "exact replay ms", "predicted device-end ms", "analyze s"], rows, align="<<>>>>>>>"))
    print()
    rows = [sensitivity_row(p) for p in args.traces]
    print(format_table(["file", "host step ms (all steps)", "with GPU ops x2", "ratio"], rows, align="<>>>"))


if __name__ == "__main__":
    main()
