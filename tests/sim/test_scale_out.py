"""World-size what-ifs past the recorded ranks build the N-rank DAG: each rank draws its op times from the recorded
steps (seeded), so a slow step on any rank holds up every collective; the prediction has a spread over draws."""

from __future__ import annotations

import json

import pytest
from run_builder import make_run_of, step_events

from dpro.cli import main
from dpro.io.load import load_run
from dpro.sim.whatif import context, predict, ranks_drawn


def jittery(rank: int, step: int) -> list[dict]:
    """The hand-built step, one step in five with a 3 ms slower backward (and what follows it later)."""
    slow = 3000.0 if step % 5 == 0 else 0.0
    out = []
    for e in step_events(rank, step):
        e = dict(e)
        if e["name"] == "BW.fc1":
            e["dur"] += slow
        elif e["name"] in ("COMM.bucket1.allreduce", "UPDATE.sgd"):
            e["ts"] += slow
        elif e["name"] == "STEP":
            e["dur"] += slow
        out.append(e)
    return out


@pytest.fixture
def ctx(tmp_path):
    return context(load_run(make_run_of(tmp_path / "run", jittery, steps=range(3, 13))))


def test_ranks_draw_their_op_times_from_the_recorded_steps(ctx):
    model = ranks_drawn(ctx.base, 16, seed=1)
    assert sorted(model.ops) == list(range(16))
    backward = {r: next(op.duration for op in ops if op.name == "BW.fc1") for r, ops in model.ops.items()}
    assert set(backward.values()) <= {2000.0, 5000.0} and len(set(backward.values())) == 2
    assert ranks_drawn(ctx.base, 16, seed=1).ops[5][0].duration == model.ops[5][0].duration  # seeded


def test_more_ranks_wait_for_the_slowest(ctx):
    recorded = predict(ctx, {})
    two = predict(ctx, {"world_size": 2})
    many = predict(ctx, {"world_size": 64})
    assert not two.spread and many.spread and len(many.spread["seeds"]) == 5
    assert many.spread["p50"] <= many.spread["p90"]
    # with 64 ranks some rank is in a slow step: the step is at least the slow backward longer than recorded
    assert many.predicted_step_ms > recorded.predicted_step_ms + 2.5
    assert many.graph_nodes > 64 * 8


def test_a_thousand_ranks_of_the_recorded_run(ctx):
    p = predict(ctx, {"world_size": 1024})
    assert p.predicted_step_ms > predict(ctx, {"world_size": 64}).predicted_step_ms
    assert p.graph_nodes > 1024 * 8


def test_whatif_prints_the_spread(tmp_path, capsys):
    run = make_run_of(tmp_path / "run", jittery, steps=range(3, 13))
    assert main(["whatif", str(run), "--set", "world_size=32", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["spread"]["p90"] >= doc["spread"]["p50"] > 0
    assert main(["whatif", str(run), "--set", "world_size=32"]) == 0
    assert "p90" in capsys.readouterr().out
