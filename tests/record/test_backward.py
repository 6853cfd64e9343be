"""Backward spans from gradient readiness (dpro.record.backward), shared by the torch and MXNet recorders."""

from __future__ import annotations

import pytest

from dpro.record.backward import split_backward


def test_backward_spans_run_from_one_units_gradients_to_the_next():
    spans = split_backward([("2", 105.0, 1.0), ("1", 300.0, 1.0), ("0", 600.0, 1.0)], start_us=100.0, segment_us=50)
    assert [(u, round(a), round(b)) for u, a, b, _ in spans] == [("2", 100, 105), ("1", 105, 300), ("0", 300, 600)]
    assert len({seg for *_, seg in spans}) == 3  # each ready well after the one before: a segment each


def test_a_bulked_segment_is_shared_by_forward_time():
    spans = split_backward([("2", 1000.0, 1.0), ("1", 1010.0, 3.0), ("0", 2000.0, 5.0)], start_us=0.0, segment_us=50)
    first, second, third = spans
    assert first[3] == second[3] != third[3]
    assert second[2] == pytest.approx(1010.0) and (second[2] - second[1]) == pytest.approx(3 * (first[2] - first[1]))
    assert third[1:3] == (1010.0, 2000.0)


def test_units_without_gradients_share_the_span_of_the_next_unit_with_some():
    # backward order of Linear, ReLU, Linear: the ReLU has no gradient of its own
    spans = split_backward([("fc2", 100.0, 2.0), ("relu", None, 1.0), ("fc1", 400.0, 3.0)], start_us=0.0)
    assert [(u, a, b) for u, a, b, _ in spans] == [("fc2", 0.0, 100.0), ("relu", 100.0, 175.0), ("fc1", 175.0, 400.0)]
    assert spans[1][3] == spans[2][3] != spans[0][3]
    # a unit without gradients after the last one with some: nothing bounds it
    assert [u for u, *_ in split_backward([("fc", 50.0, 1.0), ("flatten", None, 1.0)], start_us=0.0)] == ["fc"]


def test_work_recomputed_inside_a_span_comes_before_its_units():
    spans = split_backward([("head", 100.0, 1.0), ("block", 500.0, 1.0)], start_us=0.0, busy=[(120.0, 300.0)])
    assert spans[0][1:3] == (0.0, 100.0)
    assert spans[1][1:3] == (300.0, 500.0)  # the checkpointed block's forward ran again first
    assert all(b >= a for _, a, b, _ in split_backward([("x", 10.0, 1.0), ("y", 5.0, 1.0)], start_us=20.0))
