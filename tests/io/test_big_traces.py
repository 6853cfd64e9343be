"""Big rank files: only the last $DPRO_MAX_STEPS steps are read, and a file of $DPRO_STREAM_MB or more is read
from its end; the analysis equals that of a run holding just those steps, whatever the JSON layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_builder import make_run_of, step_events, write_journal

from dpro.analyze import analyze_run
from dpro.errors import TraceError
from dpro.io.load import load_rank_file, load_run

STEPS = range(3, 2403)   # ~4 MB per rank file
KEEP = 40


def varied(rank: int, step: int) -> list[dict]:
    """The hand-built step, its backward ops stretched differently from step to step."""
    out = []
    for e in step_events(rank, step):
        if e["cat"] == "BW":
            e = {**e, "dur": e["dur"] * (1 + (step % 7) / 20)}
        out.append(e)
    return out


@pytest.fixture
def limits(monkeypatch):
    monkeypatch.setenv("DPRO_MAX_STEPS", str(KEEP))
    monkeypatch.setenv("DPRO_STREAM_MB", "1")


def reference(tmp_path: Path) -> Path:
    return make_run_of(tmp_path / "ref", varied, steps=STEPS[-KEEP:])


def assert_same_analysis(run_dir: Path, ref_dir: Path) -> None:
    got, want = analyze_run(load_run(run_dir)).analysis, analyze_run(load_run(ref_dir)).analysis
    assert got.measured_step_ms == pytest.approx(want.measured_step_ms, rel=1e-12)
    assert got.predicted_step_ms == pytest.approx(want.predicted_step_ms, rel=1e-12)


def test_a_big_file_is_read_from_its_end(tmp_path, limits):
    run_dir = make_run_of(tmp_path / "run", varied, steps=STEPS)
    assert (run_dir / "rank-0.json").stat().st_size > 3_000_000
    run = load_run(run_dir)
    for trace in run.ranks.values():
        assert trace.steps == list(STEPS[-KEEP:])
        assert {e["args"]["step"] for e in trace.events} == set(STEPS[-KEEP:])
        assert trace.skipped_steps == len(STEPS) - KEEP
        assert trace.queues[1] == "comm"
    assert any(f"only the last {KEEP} steps that every rank reached are read" in p for p in run.problems)
    assert_same_analysis(run_dir, reference(tmp_path))


def test_indented_json_is_read_from_its_end_too(tmp_path, limits):
    run_dir = make_run_of(tmp_path / "run", varied, steps=STEPS)
    for rank in (0, 1):
        path = run_dir / f"rank-{rank}.json"
        path.write_text(json.dumps(json.loads(path.read_text()), indent=1))
    trace = load_rank_file(run_dir / "rank-0.json", 0)
    assert trace.steps == list(STEPS[-KEEP:]) and trace.skipped_steps == len(STEPS) - KEEP
    assert_same_analysis(run_dir, reference(tmp_path))


def test_separators_inside_names_fall_back_to_the_whole_file(tmp_path, limits):
    def tricky(rank: int, step: int) -> list[dict]:
        return [{**e, "name": e["name"] + '},{"x": 1}, {'} if e["cat"] == "FW" else e for e in varied(rank, step)]

    run_dir = make_run_of(tmp_path / "run", tricky, steps=STEPS)
    ref = make_run_of(tmp_path / "ref", tricky, steps=STEPS[-KEEP:])
    trace = load_rank_file(run_dir / "rank-0.json", 0)
    assert trace.steps == list(STEPS[-KEEP:])
    assert any(e["name"].endswith('},{"x": 1}, {') for e in trace.events)
    assert_same_analysis(run_dir, ref)


def test_small_files_keep_the_last_steps_too(tmp_path, monkeypatch):
    monkeypatch.setenv("DPRO_MAX_STEPS", "5")
    run_dir = make_run_of(tmp_path / "run", varied, steps=range(3, 30))
    run = load_run(run_dir)
    assert run.ranks[0].steps == list(range(25, 30)) and run.ranks[0].skipped_steps == 22
    assert_same_analysis(run_dir, make_run_of(tmp_path / "ref", varied, steps=range(25, 30)))


def test_a_bad_event_in_the_steps_read_names_where_it_is(tmp_path, limits):
    def broken(rank: int, step: int) -> list[dict]:
        out = varied(rank, step)
        if step == STEPS[-3]:
            out[2] = {**out[2], "dur": "soon"}
        return out

    run_dir = make_run_of(tmp_path / "run", broken, steps=STEPS)
    with pytest.raises(TraceError, match=r"rank-0\.json.*bytes \d+\.\.\d+, event \d+.*'dur' must be a number"):
        load_rank_file(run_dir / "rank-0.json", 0)


def test_a_cut_off_big_file_is_refused_as_before(tmp_path, limits):
    run_dir = make_run_of(tmp_path / "run", varied, steps=STEPS)
    path = run_dir / "rank-0.json"
    path.write_bytes(path.read_bytes()[:-5000])
    with pytest.raises(TraceError, match="invalid JSON"):
        load_rank_file(path, 0)


def test_journals_keep_the_last_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("DPRO_MAX_STEPS", "3")
    path = write_journal(tmp_path / "rank-0.partial.jsonl", 0, 2, range(3, 12))
    from dpro.io.load import load_journal

    trace, _ = load_journal(path, 0)
    assert trace.steps == [9, 10, 11] and trace.skipped_steps == 6


def test_a_rank_that_stopped_early_still_shares_steps_with_the_others(tmp_path, limits):
    from run_builder import rank_doc, write_json

    run_dir = make_run_of(tmp_path / "run", varied, steps=STEPS)
    short = range(3, 503)  # rank 1 stopped at step 502 (its final file says so)
    doc = rank_doc(1, 2, short, complete=False, note="killed")
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e["ph"] == "M"] + [e for s in short for e in varied(1, s)]
    write_json(run_dir / "rank-1.json", doc)
    run = load_run(run_dir)
    assert run.ranks[0].steps == list(range(503 - KEEP, 503)) == run.ranks[1].steps
    ref = make_run_of(tmp_path / "ref", varied, steps=range(503 - KEEP, 503))
    assert_same_analysis(run_dir, ref)
