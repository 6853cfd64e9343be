"""Readers bound how deeply the JSON they read may nest: a hostile file ends in one clear error naming it, not in
Python's RecursionError."""

from __future__ import annotations

import json

import pytest

from dpro.config import read_config
from dpro.errors import ConfigError, TraceError, UsageError
from dpro.io.kineto import load_kineto
from dpro.io.limits import JSON_DEPTH_ENV, json_depth, parse_bounded_json
from dpro.io.load import load_run
from dpro.sim.whatif import parse_settings

DEEP = "[" * 100_000 + "]" * 100_000  # beyond Python's parser
NESTED = "[" * 80 + "]" * 80           # parsed, but deeper than the default limit


def test_depth_is_counted_without_recursion():
    assert json_depth(json.loads(NESTED), 1000) == 80
    assert json_depth({"a": [1, {"b": 2}]}, 10) == 3 and json_depth(5, 10) == 0


@pytest.mark.parametrize("text", [DEEP, NESTED])
def test_a_document_nested_too_deep_is_refused_naming_it(text, monkeypatch):
    with pytest.raises(TraceError, match="nested .*levels|nested deeper"):
        parse_bounded_json(text, "x.json", TraceError)
    monkeypatch.setenv(JSON_DEPTH_ENV, "100")
    if text is NESTED:
        assert json_depth(parse_bounded_json(text, "x.json", TraceError), 1000) == 80


def test_every_reader_refuses_deep_json(run_dir, tmp_path):
    (run_dir / "run.json").write_text(DEEP)
    with pytest.raises(TraceError, match="run.json.*nested"):
        load_run(run_dir)
    config = tmp_path / "config.json"
    config.write_text('{"schema": "dpro.config/1", "knobs": ' + NESTED + "}")
    with pytest.raises(ConfigError, match="config.json.*nested more than 64"):
        read_config(config)
    trace = tmp_path / "trace.json"
    trace.write_text('{"traceEvents": ' + DEEP + "}")
    with pytest.raises(TraceError, match="trace.json.*nested"):
        load_kineto(trace)
    with pytest.raises(UsageError, match="--set tensor_groups: JSON nested"):
        parse_settings(["tensor_groups=" + DEEP])


def _edit(path, change):
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def test_a_huge_world_size_is_refused_at_once(run_dir, monkeypatch):
    _edit(run_dir / "run.json", lambda d: d.update(world_size=10**12))
    with pytest.raises(TraceError, match="run.json.*'world_size' 1000000000000 is above the 65,536 ranks"):
        load_run(run_dir)
    monkeypatch.setenv("DPRO_MAX_WORLD_SIZE", "1")
    _edit(run_dir / "run.json", lambda d: d.update(world_size=2))
    with pytest.raises(TraceError, match="above the 1 ranks"):  # the limit is the environment's
        load_run(run_dir)


@pytest.mark.parametrize(("change", "says"), [
    (lambda d: d.update(clocks=5), "'clocks' must be an object"),
    (lambda d: d["clocks"].update(pingpong_us={"1": [[1, 2, [3], 4]]}), "four finite numbers"),
    (lambda d: d["clocks"].update(pingpong_us={"1": [[1, 2, 3, float("nan")]]}), "four finite numbers"),
    (lambda d: d["clocks"].update(pingpong_us={"x": []}), "keys must be rank numbers"),
])
def test_clock_exchanges_are_checked_when_run_json_is_read(run_dir, change, says):
    _edit(run_dir / "run.json", change)
    with pytest.raises(TraceError, match=says):
        load_run(run_dir)


def test_a_gradient_shape_and_a_recorded_knob_of_the_wrong_kind_name_their_file(run_dir):
    from dpro.sim.whatif import context

    _edit(run_dir / "run.json", lambda d: d.setdefault("knobs", {}).update(world_size="two"))
    with pytest.raises(TraceError, match=r"run.json \(knobs.world_size\)"):
        context(load_run(run_dir))
    _edit(run_dir / "model.json", lambda d: d["gradients"][0].update(shape="x"))
    with pytest.raises(TraceError, match=r"model.json \(gradients\[0\]\): 'shape' must be a list of sizes"):
        load_run(run_dir)
