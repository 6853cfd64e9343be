"""Progress: a redrawn bar on a terminal, a start and an end line otherwise, stage lines, nothing when quiet."""

from __future__ import annotations

import io
import logging

from dpro.logs import set_verbosity
from dpro.progress import Progress, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gets_a_start_and_an_end_line():
    out = io.StringIO()
    with Progress(30, "optimize", stream=out, quiet=False) as bar:
        for _ in range(30):
            bar.advance(note="x")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[dpro] optimize: started (30 in all)"
    assert lines[1].startswith("[dpro] optimize: done, 30/30 in ") and len(lines) == 2


def test_a_terminal_gets_one_redrawn_bar():
    out = Terminal()
    bar = Progress(4, "load", stream=out, quiet=False, interval=0.0)
    for _ in range(4):
        bar.advance(note="rank-0.json")
    bar.close()
    text = out.getvalue()
    assert text.count("\r\x1b[K") == 4 and text.endswith("\n")
    assert "[########################] 4/4 load: rank-0.json" in text


def test_unknown_total_counts_without_a_bar():
    out = Terminal()
    bar = Progress(None, "optimize", stream=out, quiet=False, interval=0.0)
    bar.advance(note="bucket=5")
    assert "[1] optimize: bucket=5" in out.getvalue()


def test_stage_lines_off_a_terminal():
    out = io.StringIO()
    stages = Progress(2, "dpro-launch", stream=out, quiet=False, lines=True)
    stages.advance(0, note="stage 1: run")
    stages.advance(note="stage 2: optimize")
    stages.advance()
    stages.close()
    assert out.getvalue().splitlines()[:2] == ["[dpro] dpro-launch: [1/2] stage 1: run",
                                               "[dpro] dpro-launch: [2/2] stage 2: optimize"]
    assert "done, 2/2" in out.getvalue()


def test_quiet_follows_the_log_level():
    try:
        set_verbosity(quiet=1)
        out = io.StringIO()
        for _ in progress(range(3), label="x", stream=out):
            pass
        assert out.getvalue() == ""
    finally:
        set_verbosity()
    assert logging.getLogger("dpro").isEnabledFor(logging.INFO)
    out = io.StringIO()
    list(progress(range(3), label="x", stream=out))
    assert "done, 3/3" in out.getvalue()


def test_a_broken_stream_silences_progress():
    out = io.StringIO()
    bar = Progress(2, "x", stream=out, quiet=False)
    out.close()
    bar.advance()
    bar.close()
    assert bar.quiet
