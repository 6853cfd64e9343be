"""Broken values in files from elsewhere end in one error naming the file and the place (found by mutating real
inputs: journal rows, Kineto trace headers)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from dpro.errors import TraceError
from dpro.io.kineto import load_kineto
from dpro.io.load import load_run

KINETO = sorted((Path(__file__).resolve().parents[1] / "data" / "kineto").glob("*.json.gz"))


def test_a_journal_row_with_text_for_times_names_its_line(run_dir):
    (run_dir / "rank-1.json").unlink()
    (run_dir / "rank-1.partial.jsonl").write_text(
        json.dumps({"schema": "dpro.trace/1", "rank": 1, "world_size": 2, "header": {}}) + "\n"
        + json.dumps({"step": 3, "rows": [["FW.fc1", "FW", 0, "x", "y", {"step": 3}]]}) + "\n")
    with pytest.raises(TraceError, match=r"rank-1.partial.jsonl \(line 2, row 0\): ts_ns and dur_ns must be numbers"):
        load_run(run_dir)


@pytest.mark.skipif(not KINETO, reason="no Kineto test trace")
@pytest.mark.parametrize(("change", "says"), [
    (lambda t: t.update(deviceProperties=5), "'deviceProperties' must be a list"),
    (lambda t: t.update(distributedInfo=[1]), "'distributedInfo' must be an object"),
    (lambda t: t.update(distributedInfo={"rank": -3}), "distributedInfo.rank -3 is not a rank"),
    (lambda t: t.update(distributedInfo={"world_size": 10**12}), "is not a world size"),
])
def test_a_kineto_header_of_the_wrong_kind_is_refused(tmp_path, change, says):
    trace = json.loads(gzip.decompress(KINETO[0].read_bytes()))
    change(trace)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    with pytest.raises(TraceError, match=says):
        load_kineto(path)


@pytest.mark.skipif(not KINETO, reason="no Kineto test trace")
def test_a_nan_rank_in_a_kineto_header_is_no_rank(tmp_path):
    trace = json.loads(gzip.decompress(KINETO[0].read_bytes()))
    trace["distributedInfo"] = {"rank": float("nan"), "world_size": float("inf")}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    loaded = load_kineto(path)
    assert loaded.rank is None and loaded.world_size is None


@pytest.mark.parametrize(("name", "args", "says"), [
    ("COMM.bucket0.allreduce", {"tensors": "fc2.weight"}, r"args.tensors must be a list of gradient names"),
    ("COMM.bucket0.allreduce", {"servers": ["a"]}, r"args.servers must be a list of server numbers"),
    ("COMM.bucket0.allreduce", {"part_bytes": [float("nan")]}, r"args.part_bytes must be a list of byte counts"),
    ("COMM.bucket0.allreduce", {"key": "k"}, r"args.key must be an integer kvstore key"),
    ("BW.fc2", {"grads": 5}, r"args.grads must be a list of gradient names"),
    ("BW.fc2", {"grads": ["fc2.weight"], "grads_ready_us": [1.0, 2.0]}, r"one time per name in args.grads"),
])
def test_event_args_the_core_reads_are_checked(run_dir, name, args, says):
    path = run_dir / "rank-1.json"
    doc = json.loads(path.read_text())
    event = next(e for e in doc["traceEvents"] if e.get("name") == name)
    event["args"].update(args)
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"rank-1\.json.*" + says):
        load_run(run_dir)


def test_run_json_engine_must_be_a_name(run_dir):
    doc = json.loads((run_dir / "run.json").read_text())
    doc["engine"] = ["torch-ddp"]
    (run_dir / "run.json").write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"run\.json.*'engine' must be a name"):
        load_run(run_dir)
