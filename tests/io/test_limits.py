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


# ---- size and value counts -----------------------------------------------------------------------------------


def test_a_file_over_the_size_limit_is_refused_naming_it(run_dir, monkeypatch):
    from dpro.io.limits import FILE_SIZE_ENV

    doc = json.loads((run_dir / "rank-1.json").read_text())
    doc["note"] = "x" * 1_500_000
    (run_dir / "rank-1.json").write_text(json.dumps(doc))
    monkeypatch.setenv(FILE_SIZE_ENV, "1")
    with pytest.raises(TraceError, match=r"rank-1\.json: larger than 1 MB.*DPRO_MAX_FILE_MB"):
        load_run(run_dir)
    monkeypatch.setenv(FILE_SIZE_ENV, "2")
    assert load_run(run_dir).ranks[1].header["note"] == "x" * 1_500_000


def test_an_endless_device_stops_at_the_limit(monkeypatch):
    from dpro.io.limits import FILE_SIZE_ENV

    monkeypatch.setenv(FILE_SIZE_ENV, "4")
    with pytest.raises(ConfigError, match=r"/dev/zero: larger than 4 MB"):
        read_config("/dev/zero")


def test_a_gzip_bomb_stops_at_the_limit_and_a_cut_gzip_is_named(tmp_path, monkeypatch):
    import gzip

    from dpro.io.limits import FILE_SIZE_ENV, read_bounded

    monkeypatch.setenv(FILE_SIZE_ENV, "2")
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b" " * 50_000_000))  # 50 MB from ~50 kB
    with pytest.raises(TraceError, match=r"bomb\.json\.gz: decompresses to more than 2 MB"):
        load_kineto(bomb)
    good = gzip.compress(b'{"a": 1}') + gzip.compress(b"  ")  # two members, as gzip allows
    assert read_bounded(_write(tmp_path / "two.gz", good), TraceError) == b'{"a": 1}  '
    with pytest.raises(TraceError, match="truncated gzip"):
        read_bounded(_write(tmp_path / "cut.gz", good[:12]), TraceError)
    with pytest.raises(TraceError, match="corrupt gzip"):
        read_bounded(_write(tmp_path / "bad.gz", good[:10] + b"\xff" * 20), TraceError)


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_a_document_of_too_many_values_is_refused_before_parsing(monkeypatch):
    from dpro.io.limits import JSON_VALUES_ENV

    monkeypatch.setenv(JSON_VALUES_ENV, "1000")
    with pytest.raises(TraceError, match=r"x\.json: JSON of more than 1,000 values"):
        parse_bounded_json("[" + ",".join(["0"] * 5000) + "]", "x.json", TraceError)
    assert len(parse_bounded_json("[" + ",".join(["0"] * 500) + "]", "x.json", TraceError)) == 500


def test_nan_written_by_python_still_parses():
    assert parse_bounded_json('{"a": NaN}', "x.json", TraceError)["a"] != 0


@pytest.mark.parametrize(("groups", "says"), [
    ([["fc1.weight"]], r"tensor groups name 1 of the 4 gradients; .*missing: fc2.bias, fc2.weight, fc1.bias"),
    ([["fc1.weight", "fc1.bias"], ["fc1.bias", "fc2.weight", "fc2.bias"]], r"'fc1.bias' appears twice"),
    ([["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "conv9.weight"]], r"unknown gradient 'conv9.weight'"),
])
def test_tensor_groups_must_name_every_gradient_once(run_dir, groups, says):
    from dpro.sim.whatif import context, predict

    ctx = context(load_run(run_dir))
    with pytest.raises(UsageError, match=says):
        predict(ctx, parse_settings([f"tensor_groups={json.dumps(groups)}"]))
    whole = [["fc2.bias", "fc2.weight"], ["fc1.bias", "fc1.weight"]]
    assert predict(ctx, parse_settings([f"tensor_groups={json.dumps(whole)}"])).predicted_step_ms > 0
