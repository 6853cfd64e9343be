"""RankTraceWriter: a rank's trace is written with the garbage collector paused, and its state is left as it was."""

from __future__ import annotations

import gc
import json

import pytest

from dpro.record.trace import event_row
from dpro.record.writer import RankTraceWriter


@pytest.mark.parametrize("enabled", [True, False])
def test_finish_pauses_the_collector_and_leaves_it_as_it_was(tmp_path, monkeypatch, enabled):
    writer = RankTraceWriter(tmp_path, 0, 1, {"host": "h"})
    writer.end_step(3, [event_row("STEP", "STEP", 0, 10.0, 5.0, {"step": 3})])
    seen = []
    real_dumps = json.dumps

    def dumps(*args, **kwargs):  # the rank file is encoded while the collector is off
        seen.append(gc.isenabled())
        return real_dumps(*args, **kwargs)

    monkeypatch.setattr(json, "dumps", dumps)
    (gc.enable if enabled else gc.disable)()
    try:
        path = writer.finish(complete=True)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
    monkeypatch.undo()
    assert seen == [False]
    assert json.loads(path.read_text())["steps"] == [3]
