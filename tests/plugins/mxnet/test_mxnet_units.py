"""The Gluon recorder's pure parts (run in the MXNet venv: ``make test`` runs them there): backward spans from
gradient readiness, block paths and units, gradient names."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mxnet")

from dpro.plugins.mxnet.recorder import gradient_names, recorded_units, split_backward, spread  # noqa: E402


def test_backward_spans_run_from_one_units_gradients_to_the_next():
    spans = split_backward([("2", 105.0, 1.0), ("1", 300.0, 1.0), ("0", 600.0, 1.0)], start_us=100.0)
    assert [(u, round(a), round(b)) for u, a, b, _ in spans] == [("2", 100, 105), ("1", 105, 300), ("0", 300, 600)]
    assert len({seg for *_, seg in spans}) == 3  # each ready well after the one before: a segment each


def test_a_bulked_segment_is_shared_by_forward_time():
    spans = split_backward([("2", 1000.0, 1.0), ("1", 1010.0, 3.0), ("0", 2000.0, 5.0)], start_us=0.0)
    first, second, third = spans
    assert first[3] == second[3] != third[3]
    assert second[2] == pytest.approx(1010.0) and (second[2] - second[1]) == pytest.approx(3 * (first[2] - first[1]))
    assert third[1:3] == (1010.0, 2000.0)
    assert spread(0.0, 10.0, [("a", 0.25), ("b", 0.75)]) == [("a", 0.0, 2.5), ("b", 2.5, 10.0)]


def test_units_are_blocks_with_parameters_and_hybridized_blocks_as_a_whole():
    from mxnet import gluon

    net = gluon.nn.HybridSequential()
    with net.name_scope():
        inner = gluon.nn.HybridSequential()
        inner.add(gluon.nn.Dense(4, in_units=3), gluon.nn.Dense(2, in_units=4))
        net.add(inner, gluon.nn.Dense(1, in_units=2))
    net.initialize()
    inner.hybridize()
    params = list(gluon.Trainer(net.collect_params(), "sgd")._params)
    units = recorded_units(net, params)
    assert [u.path for u in units] == ["0", "1"]
    assert [p for p, _ in units[0].pieces()] == ["0.0", "0.1"]  # its blocks share its time
    names = gradient_names(net, params)
    assert sorted(names.values()) == ["0.0.bias", "0.0.weight", "0.1.bias", "0.1.weight", "1.bias", "1.weight"]
