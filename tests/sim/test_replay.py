"""Replay of small hand-built DAGs with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from dpro.dag.graph import GraphBuilder
from dpro.errors import GraphError
from dpro.sim.replay import critical_path, plan_levels, replay


def test_serial_chain_on_one_queue_adds_durations_and_gaps():
    b = GraphBuilder()
    for i, (dur, gap) in enumerate([(10, 0), (5, 2), (7, 1)]):
        b.add(f"op{i}", "FW", 0, 0, "r0/compute", dur, gap)
    g = b.build()
    s = replay(g)
    assert s.start.tolist() == [0, 12, 18]
    assert s.end.tolist() == [10, 17, 25]
    assert critical_path(g, s) == [0, 1, 2]


def test_communication_overlaps_compute_on_another_queue():
    b = GraphBuilder()
    bw1 = b.add("BW.a", "BW", 0, 0, "r0/compute", 10)
    comm = b.add("COMM.a", "COMM", 0, 0, "r0/comm", 15, preds=[bw1])
    bw2 = b.add("BW.b", "BW", 0, 0, "r0/compute", 10)
    upd = b.add("UPDATE", "UPDATE", 0, 0, "r0/compute", 2, preds=[comm])
    g = b.build()
    s = replay(g)
    assert s.start[comm] == 10 and s.end[comm] == 25   # runs while BW.b computes
    assert s.start[bw2] == 10 and s.end[bw2] == 20
    assert s.start[upd] == 25 and s.end[upd] == 27      # waits for the slower of the two
    assert critical_path(g, s) == [bw1, comm, upd]


def test_collective_waits_for_the_straggler():
    b = GraphBuilder()
    fast = b.add("BW", "BW", 0, 0, "r0/compute", 5)
    slow = b.add("BW", "BW", 1, 0, "r1/compute", 20)
    arrive0 = b.add("COMM.x", "COMM", 0, 0, "r0/comm", 0, preds=[fast])
    arrive1 = b.add("COMM.x", "COMM", 1, 0, "r1/comm", 0, preds=[slow])
    xfer = b.add("COMM.x.transfer", "XFER", -1, 0, None, 8, preds=[arrive0, arrive1])
    b.occupy("r0/comm", xfer)
    b.occupy("r1/comm", xfer)
    next0 = b.add("COMM.y", "COMM", 0, 0, "r0/comm", 3)  # queued behind the transfer
    g = b.build()
    s = replay(g)
    assert s.end[arrive0] == 5 and s.end[arrive1] == 20
    assert s.start[xfer] == 20 and s.end[xfer] == 28   # starts when the last rank arrives
    assert s.start[next0] == 28
    assert critical_path(g, s) == [slow, arrive1, xfer, next0]


def test_levels_cover_every_node_once_and_respect_edges():
    rng = np.random.default_rng(0)
    b = GraphBuilder()
    for i in range(300):
        preds = sorted({int(p) for p in rng.integers(0, i, size=3)}) if i > 3 else []
        b.add(f"n{i}", "FW", i % 4, 0, f"r{i % 4}/compute" if i % 5 else None, float(rng.uniform(1, 9)),
              preds=preds)
    g = b.build()
    plan = plan_levels(g)
    order = np.concatenate(plan.nodes)
    assert sorted(order.tolist()) == list(range(g.size))
    s = replay(g, plan)
    for node in range(g.size):
        for p in g.preds(node):
            assert s.start[node] >= s.end[p] - 1e-9


def test_cycle_is_reported():
    b = GraphBuilder()
    a = b.add("a", "FW", 0, 0, None, 1)
    c = b.add("c", "FW", 0, 0, None, 1, preds=[a])
    b.preds[a].append(c)
    with pytest.raises(GraphError, match="cycle"):
        plan_levels(b.build())
