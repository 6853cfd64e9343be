"""A recording that cannot start says so once and ends the job with status 2, not a traceback per rank."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dpro.errors import RecordingRefused, UsageError
from dpro.record.protocol import LocalTransport, agree_run_dir


def test_a_run_directory_holding_a_run_is_refused_as_a_usage_error(tmp_path, capsys):
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(RecordingRefused) as refused:
        agree_run_dir(LocalTransport(), tmp_path, "Profiler")
    assert isinstance(refused.value, UsageError) and refused.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dpro: error: Profiler: run_dir ") and "not empty" in err


def test_uncaught_it_ends_the_process_with_status_2_and_one_line(tmp_path):
    (tmp_path / "rank-0.json").write_text("{}")
    code = ("import sys; from dpro.record.protocol import LocalTransport, agree_run_dir; "
            f"agree_run_dir(LocalTransport(), {str(tmp_path)!r}, 'Profiler')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1 and "not empty" in proc.stderr


def test_a_rank_other_than_0_raises_without_printing(tmp_path, capsys):
    class Rank1(LocalTransport):
        def broadcast_text(self, text: str, root: int = 0) -> str:
            return "error:run_dir x is not empty"

    with pytest.raises(RecordingRefused):
        agree_run_dir(Rank1(rank=1, world_size=2), tmp_path, "Profiler")
    assert capsys.readouterr().err == ""
