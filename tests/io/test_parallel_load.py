"""Rank files read in worker processes and kept as columns: the same run as a serial read, the same errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from run_builder import make_run, make_wide_run, write_json

from dpro.errors import TraceError, UsageError
from dpro.io.events import events_of, table_from_events
from dpro.io.load import load_run
from dpro.io.pool import JOBS_ENV, jobs_wanted

RECORDED = Path(__file__).resolve().parents[1] / "data" / "mxnet" / "mlp-2workers-2servers"
COLUMNS = ("name", "cat", "tid", "ts", "dur", "step", "arg", "ints")


def _same_runs(a, b) -> None:
    assert a.problems == b.problems and a.meta == b.meta and a.model == b.model and a.set_aside == b.set_aside
    assert sorted(a.ranks) == sorted(b.ranks)
    for rank, ta in a.ranks.items():
        tb = b.ranks[rank]
        for key in COLUMNS:
            assert np.array_equal(getattr(ta.table, key), getattr(tb.table, key)), (rank, key)
        assert ta.table.names == tb.table.names and ta.table.arg_sets == tb.table.arg_sets
        assert (ta.steps, ta.queues, ta.header, ta.complete, ta.skipped_steps) == \
            (tb.steps, tb.queues, tb.header, tb.complete, tb.skipped_steps)
        assert ta.events == tb.events


def test_parallel_and_serial_loads_agree_on_a_recorded_run(tmp_path):
    run = shutil.copytree(RECORDED, tmp_path / "run")
    serial, parallel = load_run(run, jobs=1), load_run(run, jobs=2)
    _same_runs(serial, parallel)
    raw = json.loads((run / "rank-1.json").read_text())["traceEvents"]
    assert parallel.ranks[1].events == [e for e in raw if e.get("ph") == "X"]  # as the file holds them


def test_a_bad_file_read_by_a_worker_is_the_serial_read_error(tmp_path):
    run = make_wide_run(tmp_path / "run", world_size=6, layers=10)
    doc = json.loads((run / "rank-4.json").read_text())
    doc["traceEvents"][-1]["dur"] = -1.0
    write_json(run / "rank-4.json", doc)
    with pytest.raises(TraceError) as serial:
        load_run(run, jobs=1)
    with pytest.raises(TraceError, match="rank-4.json.*negative duration") as parallel:
        load_run(run, jobs=2)
    assert str(parallel.value) == str(serial.value) and parallel.value.path == serial.value.path


def test_events_survive_the_columns_as_read():
    events = [
        {"name": "FW.a", "cat": "FW", "ph": "X", "ts": 10, "dur": 2.5, "pid": 0, "tid": 0, "args": {"step": 1}},
        {"name": "FW.a", "cat": "FW", "ts": 12.5, "dur": 1, "tid": 0, "args": {"step": 1}},  # no ph, no pid
        {"cat": "COMM", "name": "COMM.b", "ph": "X", "ts": 13.0, "dur": 4.0, "pid": 0, "tid": 1,  # other key order
         "args": {"step": 1, "bytes": 8, "tensors": ["a.weight"]}},
        {"name": "STEP", "cat": "STEP", "ph": "X", "ts": 2**60, "dur": 0, "pid": 0, "tid": 2, "args": {"step": 1}},
        {"name": "FW.a", "cat": "FW", "ph": "X", "ts": 20.0, "dur": 2.0, "pid": 0, "tid": 0, "args": {"step": 1},
         "id": 7},
    ]
    table = table_from_events(events, 0)
    assert events_of(table, 0) == events
    assert [type(e["ts"]) for e in events_of(table, 0)] == [int, float, float, int, float]
    assert len(table.arg_sets) == 2  # the two {"step": 1} are one object
    copied = events_of(table, 0)
    copied[0]["args"]["step"] = 99
    assert events_of(table, 0) == events  # handed-out events are the caller's own


def test_changed_events_are_what_the_columns_say(tmp_path):
    run = load_run(make_run(tmp_path / "run"))
    trace = run.ranks[0]
    trace.events[3]["dur"] = 1234.0
    assert trace.table.dur[3] == 1234.0
    trace.compact()
    assert trace.table.dur[3] == 1234.0 and trace.events[3]["dur"] == 1234.0


def test_jobs_come_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.setenv(JOBS_ENV, "3")
    assert jobs_wanted(None) == 3 and jobs_wanted(1) == 1
    monkeypatch.setenv(JOBS_ENV, "many")
    with pytest.raises(UsageError, match="DPRO_JOBS"):
        jobs_wanted(None)
    monkeypatch.delenv(JOBS_ENV)
    assert jobs_wanted(None) >= 1
    with pytest.raises(UsageError, match="at least 1"):
        jobs_wanted(0)


def test_traces_parsed_in_workers_are_the_traces_parsed_here(tmp_path):
    """Kineto traces, one per rank, parsed in worker processes: the same traces, and the same first error."""
    from dpro.io.kineto import load_traces

    data = Path(__file__).resolve().parents[1] / "data" / "kineto"
    paths = [data / "ddp2_rank0_nccl.json.gz", data / "single_gpu_rank0.json.gz"]
    assert load_traces(paths, jobs=2) == load_traces(paths, jobs=1)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(TraceError) as serial:
        load_traces([paths[0], bad], jobs=1)
    with pytest.raises(TraceError) as parallel:
        load_traces([paths[0], bad], jobs=2)
    assert str(parallel.value) == str(serial.value)


def test_queue_ids_and_steps_must_fit_the_columns():
    from dpro.io.load import validate_events

    event = {"name": "FW.a", "cat": "FW", "ph": "X", "ts": 1.0, "dur": 1.0, "pid": 0, "tid": 2**70, "args": {"step": 1}}
    with pytest.raises(TraceError, match="'tid' int 1180591620717411303424 is beyond 64 bits"):
        validate_events(Path("rank-0.json"), [event], rank=0)
    event.update(tid=0, args={"step": -(2**64)})
    with pytest.raises(TraceError, match="args.step .* is beyond 64 bits"):
        validate_events(Path("rank-0.json"), [event], rank=0)
