"""The Gluon recorder's pure parts (run in the MXNet venv: ``make test`` runs them there): block paths and units,
gradient names."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mxnet")

from dpro.plugins.mxnet.recorder import gradient_names, recorded_units, spread  # noqa: E402


def test_spread_cuts_a_span_by_shares():
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
    assert [p for p, _ in units[0].pieces()] == ["0.0", "0.1"]  # its blocks share its forward time
    # its backward: block by block in reverse, each with its own parameters
    assert [(path, len(ps)) for path, ps in units[0].backward_pieces()] == [("0.1", 2), ("0.0", 2)]
    assert [path for path, _ in units[1].backward_pieces()] == ["1"]
    names = gradient_names(net, params)
    assert sorted(names.values()) == ["0.0.bias", "0.0.weight", "0.1.bias", "0.1.weight", "1.bias", "1.weight"]
