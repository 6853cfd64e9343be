"""Iterations stitched from one wiring (``dpro.dag.wiring.stitch``) are the graph wired iteration by iteration, and
the analysis built on them is the same whether its steps' models are built in worker processes or here."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from run_builder import horovod_timeline_events, horovod_timeline_text, make_horovod_run, make_run, make_wide_run

from dpro.analyze.run import analyze_run
from dpro.dag.align import align
from dpro.dag.graph import Graph, GraphBuilder
from dpro.dag.step_model import step_model
from dpro.dag.wiring import _share_cpus, _wire_iteration, graph_from_step_sequence, graph_from_steps
from dpro.engines import load_prepared
from dpro.sim.steps import one_step_models

RECORDED = Path(__file__).resolve().parents[1] / "data" / "mxnet" / "mlp-2workers-2servers"


def _wired_in_one_go(models) -> Graph:
    """What graph_from_step_sequence built before it stitched: every iteration wired into one builder."""
    b = GraphBuilder()
    ranks = sorted(models[0].ops)
    prev_end = dict.fromkeys(ranks)
    for it, model in enumerate(models):
        _wire_iteration(b, model, it, ranks, prev_end, {})
    _share_cpus(b, models[-1])
    return b.build()


def _same_graphs(a: Graph, b: Graph) -> None:
    for key in ("rank", "iteration", "queue", "duration", "gap", "pred_ptr", "pred_idx"):
        assert np.array_equal(getattr(a, key), getattr(b, key)), key
    assert (a.names, a.category, a.queue_names, a.step_end) == (b.names, b.category, b.queue_names, b.step_end)


def _runs(tmp_path: Path) -> list[Path]:
    return [make_run(tmp_path / "basic"), make_wide_run(tmp_path / "wide", world_size=4, layers=30, per_bucket=7),
            make_horovod_run(tmp_path / "hvd", horovod_timeline_text(horovod_timeline_events([3, 4])))]


def test_stitched_iterations_are_the_iterations_wired_in_one_go(tmp_path):
    for root in _runs(tmp_path):
        run = load_prepared(root)
        alignment = align(run)
        model = step_model(run, alignment)
        _same_graphs(graph_from_steps(model, iterations=4), _wired_in_one_go([model] * 4))
        _, singles = one_step_models(run, alignment, model.steps)
        _same_graphs(graph_from_step_sequence(singles), _wired_in_one_go(singles))


def test_analysis_in_workers_is_the_analysis_here(tmp_path):
    for root in [*_runs(tmp_path), shutil.copytree(RECORDED, tmp_path / "mxnet")]:
        here = analyze_run(load_prepared(root, jobs=1), jobs=1)
        workers = analyze_run(load_prepared(root, jobs=2), jobs=2)
        assert here.analysis == workers.analysis, root
        _same_graphs(here.graph, workers.graph)
