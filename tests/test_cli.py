"""The ``dpro`` command line: ``dpro info`` on hand-written run directories, in-process and as a process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from run_builder import write_journal

from dpro.cli import build_parser, main
from dpro.io.load import load_run
from dpro.report.info import summarize_run
from dpro.report.tables import format_bytes, format_table


def _rank_rows(text: str) -> dict[int, list[str]]:
    """The rows of the ``ranks`` table, by rank."""
    lines = text.split("ranks\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert lines[0].split()[:4] == ["rank", "host", "state", "steps"]
    return {int(cells[0]): cells for cells in (line.split() for line in lines[1:])}


def test_info_prints_engine_world_size_and_ranks(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "engine      torch-ddp" in out and "world size  2" in out and "framework   torch" in out
    assert "asked 3..7; recorded 3..7" in out
    assert "4 gradients, 12.0 KiB in 2 buckets" in out
    assert "torch.ddp.bucket_cap_mb  25.0" in out
    rows = _rank_rows(out)
    assert sorted(rows) == [0, 1]
    assert rows[0] == ["0", "node-a", "complete", "3..7", "10", "10", "10", "5", "5", "5", "0", "9.00",
                       "12.0", "KiB"]
    assert "problems: none" in out


def test_info_columns_are_aligned(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["info", str(run_dir)])
    table = capsys.readouterr().out.split("ranks\n", 1)[1].split("\n\n", 1)[0].splitlines()
    state_col = table[0].index("state")
    assert all(line[state_col:].startswith(("state", "complete")) for line in table)
    assert len({len(line) for line in table}) == 1  # right-aligned last column ends at the same place


def test_info_json_parses(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json", str(run_dir)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["engine"] == "torch-ddp" and summary["world_size"] == 2
    assert summary["steps_asked"] == summary["steps_recorded"] == [3, 4, 5, 6, 7]
    assert [r["state"] for r in summary["ranks"]] == ["complete", "complete"]
    assert summary["ranks"][1]["events"] == {"FW": 10, "BW": 10, "COMM": 10, "UPDATE": 5, "IO": 5, "STEP": 5,
                                             "RECOMPUTE": 0}
    assert summary["ranks"][1]["step_ms_median"] == 9.0
    assert summary["ranks"][1]["comm_bytes_per_step"] == 12288
    assert summary["model"] == {"gradients": 4, "gradient_bytes": 12288, "buckets": 2, "modules": 3,
                                "recorded_modules": 2, "param_bytes": 12288}
    assert summary["problems"] == []


def test_summary_is_plain_data(run_dir: Path) -> None:
    summary = summarize_run(load_run(run_dir))
    assert json.loads(json.dumps(summary)) == summary


def test_info_reports_a_missing_rank(new_run, capsys: pytest.CaptureFixture[str]) -> None:
    root = new_run(world_size=3, ranks=[0, 2])
    assert main(["info", str(root)]) == 0
    out = capsys.readouterr().out
    assert _rank_rows(out)[1][:4] == ["1", "node-a", "missing", "-"]
    assert "problems (1)\n  - rank 1: no trace (rank-1.json missing) — did it crash before recording?" in out


def test_info_says_a_journal_only_rank_did_not_finish(new_run, capsys: pytest.CaptureFixture[str]) -> None:
    root = new_run(ranks=[0])
    write_journal(root / "rank-1.partial.jsonl", 1, 2, [3, 4], cut_step=5)
    assert main(["info", str(root)]) == 0
    out = capsys.readouterr().out
    assert _rank_rows(out)[1][:8] == ["1", "node-a", "partial", "3,", "4", "4", "4", "4"]
    assert "rank 1 did not finish: steps 3, 4 recorded of 3..7" in out
    assert "line 4 is cut off" in out
    assert "recorded 3, 4 on every rank with a trace" in out


def test_info_without_run_and_model_json(new_run, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(new_run(meta=False, model=False))]) == 0
    out = capsys.readouterr().out
    assert "engine      ?" in out and "model       unknown (no model.json)" in out
    assert "run.json is missing" in out


def test_error_prints_one_line_and_returns_2(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run_dir / "rank-0.json").write_text('{"schema": "dpro.trace/1", "traceEvents": [')
    assert main(["info", str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("dpro: error: ") and captured.err.count("\n") == 1
    assert "rank-0.json" in captured.err and "invalid JSON" in captured.err and "truncated" in captured.err


def test_parser_needs_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_parser_lists_info() -> None:
    parser = build_parser()
    assert parser.prog == "dpro"
    args = parser.parse_args(["info", "some/run", "--json"])
    assert args.command == "info" and args.run == "some/run" and args.json


def test_python_dash_m_dpro_runs_info(run_dir: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dpro", "info", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "torch-ddp" in proc.stdout and "world size  2" in proc.stdout
    assert sorted(_rank_rows(proc.stdout)) == [0, 1]


def test_python_dash_m_dpro_error_exit_status(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dpro", "info", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == f"dpro: error: {tmp_path}: not a dpro run directory " \
                          "(no run.json, model.json or rank-<r>.json)\n"
    assert "Traceback" not in proc.stderr


def test_format_table_aligns_columns() -> None:
    text = format_table(["name", "n"], [["a", "1"], ["long name", "100"]], align="<>")
    assert text.splitlines() == ["name         n", "a            1", "long name  100"]


@pytest.mark.parametrize(
    ("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB")]
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_verbose_adds_the_traceback_for_bug_reports(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run_dir / "rank-0.json").write_text('{"schema": "dpro.trace/1", "traceEvents": [')
    assert main(["info", str(run_dir), "-v"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.splitlines()[-1].startswith("dpro: error: ")
    assert "rank-0.json" in err.splitlines()[-1]

