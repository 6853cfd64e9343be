"""``dpro export``: a run directory's or profiler traces' DAG in the formats other tools read.

* ``chakra``: one Chakra execution trace per NPU, ``<out>/<name>.<npu>.et`` (``dpro.report.chakra``), for ASTRA-sim;
* ``perfetto``: the measured and replayed timeline, ``<out>/<name>.json`` (``dpro.report.perfetto``; for a run the
  same file as ``analysis/replay.json``, for profiler traces the replayed side, the traces being the measured one).
"""

from __future__ import annotations

from pathlib import Path

from dpro.analyze.run import DEFAULT_ITERATIONS, analyze_run
from dpro.dag.kineto import graph_from_kineto
from dpro.dag.wiring import graph_from_steps
from dpro.engines import load_prepared
from dpro.errors import UsageError
from dpro.io.kineto import load_traces
from dpro.report.chakra import CommInfo, comm_info_of_model, et_nodes, write_chakra
from dpro.report.perfetto import write_analyzed_replay, write_graph_trace
from dpro.sim.replay import replay

__all__ = ["CHAKRA_ITERATIONS", "FORMATS", "export_run", "export_traces"]

FORMATS = ("chakra", "perfetto")
CHAKRA_ITERATIONS = 1  # one mean step: a simulator repeats it as it likes


def _check(fmt: str, name: str) -> None:
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if not name or "/" in name or name.startswith("."):
        raise UsageError(f"--name {name!r}: expected a plain file name prefix such as 'dpro'")


def export_run(run_dir: str | Path, out_dir: str | Path, fmt: str, *, name: str = "dpro",
               iterations: int | None = None) -> list[Path]:
    """Write a run directory's DAG as ``fmt``; returns the files written.

    Args:
        iterations: consecutive steps in the graph (default: 1 for chakra, the mean step; ``dpro analyze``'s 4 for
            perfetto).

    Raises:
        UsageError: an unknown format or name, fewer than 1 iteration, mlc-chakra missing (chakra).
    """
    _check(fmt, name)
    its = iterations or (CHAKRA_ITERATIONS if fmt == "chakra" else DEFAULT_ITERATIONS)
    if its < 1:
        raise UsageError(f"--iterations {its}: expected at least 1")
    run = load_prepared(run_dir)
    result = analyze_run(run, its if fmt == "perfetto" else DEFAULT_ITERATIONS)
    out = Path(out_dir)
    if fmt == "perfetto":
        return [write_analyzed_replay(out / f"{name}.json", result)]
    g = graph_from_steps(result.model, its)
    meta = {"source": str(Path(run_dir)), "engine": str((run.meta or {}).get("engine", "")),
            "world_size": str(run.world_size), "iterations": str(its)}
    return write_chakra(out, name, et_nodes(g, comm_info_of_model(result.model)), meta)


def export_traces(paths: list[Path], out_dir: str | Path, fmt: str, *, name: str = "dpro") -> list[Path]:
    """Write PyTorch profiler traces' DAG (every profiled step) as ``fmt``; returns the files written.

    Raises:
        UsageError: an unknown format or name, mlc-chakra missing (chakra).
    """
    _check(fmt, name)
    g, info = graph_from_kineto(load_traces(paths))
    out = Path(out_dir)
    if fmt == "perfetto":
        return [write_graph_trace(out / f"{name}.json", g, replay(g))]
    comms = {node: CommInfo(op=op, nbytes=nbytes) for node, (op, nbytes) in info.comm.items()}
    meta = {"source": ", ".join(str(p) for p in paths), "world_size": str(len(info.ranks)),
            "steps": ",".join(map(str, info.steps))}
    return write_chakra(out, name, et_nodes(g, node_comms=comms), meta)
