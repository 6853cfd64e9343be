"""Transfers over shared links (``dpro.sim.links``): hand-built graphs with answers worked out by hand."""

from __future__ import annotations

import pytest

from dpro.dag.graph import GraphBuilder
from dpro.errors import GraphError
from dpro.sim.links import crowding_by_op, scale_for_crowding
from dpro.sim.replay import replay

AB = ("link-out@A", "link-in@B")
BA = ("link-out@B", "link-in@A")


def _transfer(b: GraphBuilder, name: str, us: float, connection: str, links: tuple[str, ...],
              preds: list[int] | None = None, gap: float = 0.0) -> int:
    node = b.add(name, "XFER", 0, 0, None, us, gap, preds)
    b.share_links(node, connection, links)
    return node


def test_two_connections_on_one_link_share_it_evenly():
    b = GraphBuilder()
    push = _transfer(b, "push", 100, "w0->s1", AB)
    answer = _transfer(b, "answer", 100, "s0->w1", AB)
    s = replay(b.build())
    assert s.end[push] == pytest.approx(200) and s.end[answer] == pytest.approx(200)


def test_one_connection_sends_its_messages_in_turn():
    b = GraphBuilder()
    first = _transfer(b, "first", 100, "w0->s1", AB)
    second = _transfer(b, "second", 50, "w0->s1", AB)
    s = replay(b.build())
    assert s.end[first] == pytest.approx(100)
    assert s.end[second] == pytest.approx(150)


def test_opposite_ways_run_side_by_side():
    b = GraphBuilder()
    there = _transfer(b, "there", 100, "w0->s1", AB)
    back = _transfer(b, "back", 100, "w1->s0", BA)
    s = replay(b.build())
    assert s.end[there] == pytest.approx(100) and s.end[back] == pytest.approx(100)


def test_a_later_transfer_shares_only_from_when_it_starts():
    b = GraphBuilder()
    early = _transfer(b, "early", 100, "w0->s1", AB)
    before = b.add("compute", "FW", 0, 0, "r0/compute", 50)
    late = _transfer(b, "late", 100, "s0->w1", AB, preds=[before])
    s = replay(b.build())
    # 0-50 alone (half done), then both at half speed: early ends at 150, late has 50 left and ends at 200
    assert s.start[late] == pytest.approx(50)
    assert s.end[early] == pytest.approx(150)
    assert s.end[late] == pytest.approx(200)


def test_a_transfer_moves_at_its_share_of_its_busiest_link():
    b = GraphBuilder()
    to_b = _transfer(b, "to B", 100, "w0->s1", ("link-out@A", "link-in@B"))
    also_to_b = _transfer(b, "C to B", 100, "w2->s1", ("link-out@C", "link-in@B"))
    a_to_d = _transfer(b, "A to D", 100, "w0->s3", ("link-out@A", "link-in@D"))
    s = replay(b.build())
    # link-out@A and link-in@B carry two connections each: every transfer moves at half speed
    assert [s.end[n] for n in (to_b, also_to_b, a_to_d)] == pytest.approx([200, 200, 200])


def test_what_waits_for_a_shared_transfer_starts_after_it_and_its_gap():
    b = GraphBuilder()
    push = _transfer(b, "push", 100, "w0->s1", AB)
    other = _transfer(b, "other", 100, "s0->w1", AB)
    server = b.add("server", "XFER", -1, 0, "server@B", 10, 0.0, [push])
    answer = _transfer(b, "answer", 30, "s1->w0", BA, preds=[server], gap=5)
    after = b.add("FW", "FW", 0, 1, "r0/compute", 1, 0.0, [answer, other])
    s = replay(b.build())
    assert s.start[server] == pytest.approx(200)
    assert s.start[answer] == pytest.approx(215) and s.end[answer] == pytest.approx(245)
    assert s.start[after] == pytest.approx(245)


def test_without_shared_links_a_graph_replays_as_before():
    b = GraphBuilder()
    x = b.add("x", "XFER", 0, 0, None, 100)
    y = b.add("y", "XFER", 0, 0, None, 100)
    g = b.build()
    assert g.flows is None
    s = replay(g)
    assert s.end[x] == 100 and s.end[y] == 100


def test_a_cycle_through_shared_transfers_is_refused():
    b = GraphBuilder()
    first = _transfer(b, "first", 10, "w0->s1", AB)
    second = _transfer(b, "second", 10, "s1->w0", BA, preds=[first])
    b.preds[first].append(second)
    with pytest.raises(GraphError, match="cycle"):
        replay(b.build())


def test_a_link_of_two_lanes_carries_two_connections_at_full_rate_and_shares_beyond():
    b = GraphBuilder()
    b.link_capacity["cpu@A"] = 2
    two = [_transfer(b, f"m{i}", 100, f"server{i}", ("cpu@A",)) for i in range(2)]
    s = replay(b.build())
    assert [s.end[n] for n in two] == [pytest.approx(100)] * 2
    b = GraphBuilder()
    b.link_capacity["cpu@A"] = 2
    three = [_transfer(b, f"m{i}", 100, f"server{i}", ("cpu@A",)) for i in range(3)]
    s = replay(b.build())
    assert [s.end[n] for n in three] == [pytest.approx(150)] * 3  # 2 lanes over 3: each at 2/3


def test_messages_that_take_more_of_a_link_share_it_sooner():
    b = GraphBuilder()
    b.link_capacity["cpu@A"] = 2
    b.link_weight["cpu@A"] = 1.5  # a working server takes 1.5 CPUs of its machine's 2
    alone = _transfer(b, "alone", 100, "server0", ("cpu@A",))
    s = replay(b.build())
    assert s.end[alone] == pytest.approx(100)
    b = GraphBuilder()
    b.link_capacity["cpu@A"] = 2
    b.link_weight["cpu@A"] = 1.5
    pair = [_transfer(b, f"m{i}", 100, f"server{i}", ("cpu@A",)) for i in range(2)]
    s = replay(b.build())
    assert [s.end[n] for n in pair] == [pytest.approx(150)] * 2  # 3 CPUs asked of 2: each at 2/3


def test_a_node_taking_a_share_of_a_link_slows_its_messages_while_it_runs():
    b = GraphBuilder()
    compute = b.add("BW", "BW", 0, 0, "r0/compute", 50)
    b.take_share(compute, "cpu@A")
    message = _transfer(b, "server work", 100, "server0", ("cpu@A",))
    after = b.add("FW", "FW", 0, 0, "r0/compute", 10, 0.0, [compute])
    g = b.build()
    s = replay(g)
    # 0-50 at half speed beside the compute (25 done), then alone: 75 more
    assert s.end[compute] == pytest.approx(50) and s.end[after] == pytest.approx(60)
    assert s.end[message] == pytest.approx(125)


def test_a_node_taking_a_share_reports_how_crowded_its_link_was_while_it_ran():
    b = GraphBuilder()
    compute = b.add("BW", "BW", 0, 0, "r0/compute", 100)
    b.take_share(compute, "cpu@A")
    _transfer(b, "server work", 25, "server0", ("cpu@A",))  # 1 lane asked twice for 50 of the compute's 100
    alone = b.add("FW", "FW", 0, 0, "r0/compute", 10, 0.0, [compute])
    b.take_share(alone, "cpu@A")
    s = replay(b.build())
    assert s.crowding[compute] == pytest.approx((50 * 2 + 50 * 1) / 100)
    assert s.crowding[alone] == pytest.approx(1.0)


def test_compute_less_crowded_than_recorded_runs_faster_and_the_cpus_are_conserved():
    def graph(server_us: float):
        b = GraphBuilder()
        compute = b.add("BW", "BW", 0, 0, "r0/compute", 100)
        b.take_share(compute, "cpu@A")
        _transfer(b, "server work", server_us, "server0", ("cpu@A",))
        return b.build(), compute

    recorded_g, _ = graph(50)  # crowded for its whole run: 2 asked of 1 lane
    recorded = crowding_by_op(recorded_g, replay(recorded_g).crowding)
    assert recorded == {(0, 0, "BW", 0): pytest.approx(2.0)}
    g, compute = graph(0.0)  # the what-if: no server work beside it
    base = g.duration.copy()
    scale_for_crowding(g, replay(g).crowding, recorded, base)
    assert g.duration[compute] == pytest.approx(50)  # half the recorded time: the CPU it shared is its own now
