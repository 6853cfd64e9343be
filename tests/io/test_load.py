"""dpro.io.load: reading and validating run directories written by hand in the documented format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_builder import make_run, rank_doc, run_doc, step_events, write_journal, write_json

from dpro.errors import DproError, TraceError
from dpro.io.load import format_steps, interrupted_calls, load_journal, load_rank_file, load_run, step_times_ms
from dpro.record.trace import event_row
from dpro.record.writer import RankTraceWriter


def test_valid_run_loads(run_dir: Path) -> None:
    run = load_run(run_dir)
    assert run.problems == []
    assert run.world_size == 2 and run.missing_ranks == []
    assert run.meta["engine"] == "torch-ddp" and run.profiled_steps == [3, 4, 5, 6, 7]
    assert [g["name"] for g in run.model["gradients"]] == ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]
    assert sorted(run.ranks) == [0, 1]
    for rank, trace in run.ranks.items():
        assert trace.rank == rank and trace.complete and not trace.from_journal
        assert trace.path == run_dir / f"rank-{rank}.json"
        assert trace.steps == [3, 4, 5, 6, 7]
        assert trace.queues == {0: "compute", 1: "comm", 2: "host"}
        assert trace.host == "node-a" and trace.clock["source"] == "CLOCK_MONOTONIC"
        assert trace.header["pid"] == 4000 + rank and trace.world_size == 2
        assert len(trace.events) == 5 * len(step_events(rank, 3))
        assert all(e["ph"] == "X" for e in trace.events)


def test_step_times_come_from_step_events(run_dir: Path) -> None:
    trace = load_run(run_dir).ranks[1]
    assert step_times_ms(trace) == {3: 9.0, 4: 9.0, 5: 9.0, 6: 9.0, 7: 9.0}


def test_loads_what_the_record_writer_writes(tmp_path: Path) -> None:
    header = {"host": "node-b", "pid": 7, "clock": {"source": "CLOCK_MONOTONIC"}}
    writer = RankTraceWriter(tmp_path, rank=0, world_size=1, header=header)
    for step in (1, 2):
        rows = [event_row(e["name"], e["cat"], e["tid"], e["ts"], e["dur"], e["args"]) for e in step_events(0, step)]
        writer.end_step(step, rows)
    partial, problems = load_journal(tmp_path / "rank-0.partial.jsonl")
    assert partial.steps == [1, 2] and not partial.complete and problems == []
    assert partial.host == "node-b" and partial.header["world_size"] == 1
    writer.finish(complete=True)
    final = load_rank_file(tmp_path / "rank-0.json", 0)
    assert final.complete and final.steps == [1, 2] and final.events == partial.events
    assert final.queues == {0: "compute", 1: "comm", 2: "host"} and final.host == "node-b"


def test_a_rank_that_died_inside_a_framework_call_is_named_with_what_it_was_doing(tmp_path: Path) -> None:
    writer = RankTraceWriter(tmp_path, rank=1, world_size=2, header={"host": "h"})
    with writer.inside("stopping the profiler"):
        assert interrupted_calls(tmp_path) == {1: "stopping the profiler"}
    assert interrupted_calls(tmp_path) == {}  # returned: the note is gone
    with pytest.raises(RuntimeError), writer.inside("stopping the profiler"):
        raise RuntimeError("the call failed, the process lives on")
    assert interrupted_calls(tmp_path) == {}
    (tmp_path / "rank-1.busy.txt").write_text("stopping the profiler\n")  # what a killed process leaves
    problems = load_run(tmp_path).problems
    assert "rank 1 never returned from stopping the profiler" in problems


# ---- unreadable files ----------------------------------------------------------------------------


def test_truncated_rank_file_names_file_and_json(run_dir: Path) -> None:
    path = run_dir / "rank-1.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    match = r"rank-1\.json \(line 1, column \d+\): invalid JSON: .*truncated"
    with pytest.raises(TraceError, match=match) as info:
        load_run(run_dir)
    assert info.value.path == path


def test_malformed_json_gives_line_and_column(run_dir: Path) -> None:
    (run_dir / "model.json").write_text('{"schema": "dpro.model/1",\n  "gradients": [}\n')
    with pytest.raises(TraceError, match=r"model\.json \(line 2, column 17\): invalid JSON"):
        load_run(run_dir)


def test_empty_file_is_reported(run_dir: Path) -> None:
    (run_dir / "run.json").write_text("")
    with pytest.raises(TraceError, match=r"run\.json.*empty, not JSON"):
        load_run(run_dir)


def test_binary_file_is_not_a_traceback(run_dir: Path) -> None:
    (run_dir / "rank-0.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(TraceError, match=r"rank-0\.json: not UTF-8"):
        load_run(run_dir)


def test_wrong_schema_version_is_named(run_dir: Path) -> None:
    doc = rank_doc(0, 2, [3, 4])
    doc["schema"] = "dpro.trace/9"
    write_json(run_dir / "rank-0.json", doc)
    with pytest.raises(TraceError, match=r"rank-0\.json: schema 'dpro\.trace/9' is not supported; "
                                         r"this dpro reads dpro\.trace/1"):
        load_run(run_dir)


def test_missing_schema_is_named(run_dir: Path) -> None:
    doc = run_doc(2, [3])
    del doc["schema"]
    write_json(run_dir / "run.json", doc)
    with pytest.raises(TraceError, match=r"run\.json: no 'schema' key; this dpro reads dpro\.run/1"):
        load_run(run_dir)


def test_top_level_must_be_an_object(run_dir: Path) -> None:
    write_json(run_dir / "rank-0.json", [1, 2])
    with pytest.raises(TraceError, match=r"rank-0\.json: expected a JSON object at the top, found list"):
        load_run(run_dir)


def test_renamed_rank_file_is_refused(run_dir: Path) -> None:
    write_json(run_dir / "rank-1.json", rank_doc(0, 2, range(3, 8)))
    with pytest.raises(TraceError, match=r"rank-1\.json: file says rank 0, but its name is rank 1's"):
        load_run(run_dir)


def test_bad_run_json_world_size(run_dir: Path) -> None:
    doc = run_doc(2, [3])
    doc["world_size"] = "two"
    write_json(run_dir / "run.json", doc)
    with pytest.raises(TraceError, match=r"run\.json: 'world_size' must be int, found str 'two'"):
        load_run(run_dir)


def test_bad_model_entry_is_named(run_dir: Path) -> None:
    model = json.loads((run_dir / "model.json").read_text())
    del model["gradients"][2]["bytes"]
    write_json(run_dir / "model.json", model)
    match = r"model\.json \(gradients\[2\]\): 'bytes' must be int, found nothing$"
    with pytest.raises(TraceError, match=match):
        load_run(run_dir)


# ---- bad events ----------------------------------------------------------------------------------


def _break_event(run_dir: Path, index: int, change: dict, drop: str | None = None) -> None:
    """Edit traceEvents[index] of rank-0.json (entries 0-3 are metadata; 4 is STEP, 6 is FW.fc1)."""
    doc = rank_doc(0, 2, range(3, 8))
    doc["traceEvents"][index].update(change)
    if drop:
        del doc["traceEvents"][index][drop]
    write_json(run_dir / "rank-0.json", doc)


def test_event_missing_ts_is_named(run_dir: Path) -> None:
    _break_event(run_dir, 6, {}, drop="ts")
    with pytest.raises(TraceError, match=r"rank-0\.json \(event 6 'FW\.fc1'\): event lacks 'ts'"):
        load_run(run_dir)


@pytest.mark.parametrize(
    ("change", "drop", "message"),
    [
        ({"dur": "1.5"}, None, r"'dur' must be a number of microseconds, found '1\.5'"),
        ({"ts": True}, None, r"'ts' must be a number of microseconds, found True"),
        ({"dur": -3.0}, None, r"negative duration -3\.0"),
        ({"cat": "GPU"}, None, r"unknown category 'GPU'; dpro traces use FW, BW, COMM, UPDATE, IO, STEP"),
        ({}, "cat", r"event lacks 'cat'"),
        ({}, "ph", r"event lacks 'ph'"),
        ({"args": {}}, None, r"args\.step must be the integer step index, found None"),
        ({"pid": 1}, None, r"event pid 1 in the trace of rank 0"),
        ({"tid": 9}, None, r"tid 9 has no thread_name metadata"),
    ],
)
def test_bad_events_are_named(run_dir: Path, change: dict, drop: str | None, message: str) -> None:
    _break_event(run_dir, 6, change, drop)
    with pytest.raises(TraceError, match=r"rank-0\.json \(.*FW\.fc1.*\): " + message):
        load_run(run_dir)


def test_second_step_event_for_a_step_is_refused(run_dir: Path) -> None:
    doc = rank_doc(0, 2, range(3, 8))
    doc["traceEvents"].append(step_events(0, 3)[0])
    write_json(run_dir / "rank-0.json", doc)
    with pytest.raises(TraceError, match=r"step 3 has a second STEP event \(the first is event 4 'STEP'\)"):
        load_run(run_dir)


# ---- not a run directory -------------------------------------------------------------------------


def test_a_file_is_not_a_run_directory(run_dir: Path) -> None:
    with pytest.raises(TraceError, match=r"run\.json: not a dpro run directory: this is a file"):
        load_run(run_dir / "run.json")


def test_an_empty_directory_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r": not a dpro run directory \(no run\.json, model\.json or rank-"):
        load_run(tmp_path)


def test_a_missing_directory_is_reported(tmp_path: Path) -> None:
    with pytest.raises(DproError, match=r"nowhere: no such directory"):
        load_run(tmp_path / "nowhere")


# ---- recoverable problems ------------------------------------------------------------------------


def test_missing_rank_is_a_problem(new_run) -> None:
    run = load_run(new_run(world_size=3, ranks=[0, 2]))
    assert run.world_size == 3 and run.missing_ranks == [1] and sorted(run.ranks) == [0, 2]
    assert run.problems == ["rank 1: no trace (rank-1.json missing) — did it crash before recording?"]


def test_journal_only_rank_loads_its_finished_steps(new_run) -> None:
    root = new_run(ranks=[0])
    write_journal(root / "rank-1.partial.jsonl", 1, 2, [3, 4], cut_step=5)
    run = load_run(root)
    trace = run.ranks[1]
    assert not trace.complete and trace.from_journal
    assert trace.steps == [3, 4] and {e["args"]["step"] for e in trace.events} == {3, 4}
    assert step_times_ms(trace) == {3: 9.0, 4: 9.0}
    assert trace.host == "node-a" and trace.header["pid"] == 4001
    assert trace.queues == {0: "compute", 1: "comm", 2: "host"}
    assert "rank 1: rank-1.partial.jsonl: line 4 is cut off (the process died while writing it); ignored" \
        in run.problems
    assert any(p.startswith("rank 1 did not finish: steps 3, 4 recorded of 3..7") for p in run.problems)
    assert run.missing_ranks == []


def test_journal_without_cut_line_reports_no_cut(new_run) -> None:
    root = new_run(ranks=[0])
    write_journal(root / "rank-1.partial.jsonl", 1, 2, [3, 4, 5])
    run = load_run(root)
    assert run.ranks[1].steps == [3, 4, 5]
    assert not any("cut off" in p for p in run.problems)


def test_journal_is_ignored_when_the_final_file_exists(run_dir: Path) -> None:
    (run_dir / "rank-1.partial.jsonl").write_text("{ not json at all\n")
    run = load_run(run_dir)
    assert run.ranks[1].complete and run.problems == []


def test_broken_line_inside_a_journal_is_an_error(new_run) -> None:
    root = new_run(ranks=[0])
    path = write_journal(root / "rank-1.partial.jsonl", 1, 2, [3, 4, 5])
    lines = path.read_text().split("\n")
    lines[2] = lines[2][:40]
    path.write_text("\n".join(lines))
    with pytest.raises(TraceError, match=r"rank-1\.partial\.jsonl \(line 3, column \d+\): invalid JSON.*"
                                         r"in the middle of the journal"):
        load_run(root)


def test_bad_event_in_a_journal_names_line_and_event(new_run) -> None:
    root = new_run(ranks=[0])
    path = write_journal(root / "rank-1.partial.jsonl", 1, 2, [3])
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    del record["events"][4]["dur"]
    lines[1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    match = r"rank-1\.partial\.jsonl \(line 2, event 4 'BW\.fc2'\): event lacks 'dur'"
    with pytest.raises(TraceError, match=match):
        load_run(root)


def test_rank_that_stopped_with_an_error_is_a_problem(run_dir: Path) -> None:
    write_json(run_dir / "rank-1.json", rank_doc(1, 2, [3, 4], complete=False,
                                                 note="stopped by RuntimeError: boom"))
    run = load_run(run_dir)
    assert not run.ranks[1].complete and run.ranks[1].note == "stopped by RuntimeError: boom"
    assert run.problems == [
        "rank 1 did not finish: steps 3, 4 recorded of 3..7 — stopped by RuntimeError: boom"]


def test_missing_run_and_model_json_are_problems(new_run) -> None:
    run = load_run(new_run(meta=False, model=False, ranks=[0]))
    assert run.meta is None and run.model is None and run.profiled_steps == []
    assert run.world_size == 2  # from the rank file
    assert any(p.startswith("run.json is missing") for p in run.problems)
    assert any(p.startswith("model.json is missing") for p in run.problems)
    assert "rank 1: no trace (rank-1.json missing) — did it crash before recording?" in run.problems


def test_ranks_with_different_steps_are_a_problem(run_dir: Path) -> None:
    write_json(run_dir / "rank-1.json", rank_doc(1, 2, [3, 4, 5, 6]))
    run = load_run(run_dir)
    assert run.problems == ["ranks recorded different steps (rank 0: 3..7; rank 1: 3..6); "
                            "analysis uses the steps all ranks share"]


def test_run_dir_with_only_run_json_lists_every_rank_missing(tmp_path: Path) -> None:
    root = make_run(tmp_path / "run", ranks=[], model=False)
    run = load_run(root)
    assert run.ranks == {} and run.missing_ranks == [0, 1]


@pytest.mark.parametrize(
    ("steps", "text"),
    [([], ""), ([3], "3"), ([3, 4], "3, 4"), ([3, 4, 5, 6, 7], "3..7"),
     ([9, 1, 2, 3, 5, 6], "1..3, 5, 6, 9")],
)
def test_format_steps(steps: list[int], text: str) -> None:
    assert format_steps(steps) == text


def test_rank_beyond_world_size_is_a_problem(run_dir: Path) -> None:
    write_json(run_dir / "rank-4.json", rank_doc(4, 2, range(3, 8)))
    run = load_run(run_dir)
    assert sorted(run.ranks) == [0, 1, 4] and run.missing_ranks == []
    assert run.problems == ["rank 4: rank-4.json is beyond world size 2"]


def test_rank_disagreeing_on_world_size_is_a_problem(run_dir: Path) -> None:
    write_json(run_dir / "rank-1.json", rank_doc(1, 4, range(3, 8)))
    assert load_run(run_dir).problems == ["rank 1: its trace says world size 4, the run 2"]


def test_a_long_note_is_cut_to_one_line_in_problems(run_dir: Path) -> None:
    note = "stopped by RuntimeError: " + "x" * 300 + "\nAt:\n  somewhere.py(1)"
    write_json(run_dir / "rank-1.json", rank_doc(1, 2, [3], complete=False, note=note))
    run = load_run(run_dir)
    assert run.ranks[1].note == note
    (problem,) = run.problems
    assert "\n" not in problem and problem.endswith(" …") and len(problem) < 300
