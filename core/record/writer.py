"""Writing a run directory: each rank's trace (journal per finished step, then ``rank-<r>.json``), and rank 0's
``run.json`` and ``model.json``. Every file is written atomically; a rank that dies leaves its journal, which
the reader turns into the steps it finished.

Multi-host runs need no shared filesystem: each host writes the files of its own ranks into its own
copy of the run directory; the file names never collide, so copying them into one directory
(e.g. ``rsync host:run/ run/``) gives the whole run.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # the journal line of every recorded step is encoded on the recorder's builder thread: several times faster
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is optional (the MXNet venv has none)
    _orjson = None

from dpro import __version__
from dpro.errors import UsageError
from dpro.record.trace import (
    MODEL_FILE,
    MODEL_SCHEMA,
    RUN_FILE,
    RUN_SCHEMA,
    TRACE_SCHEMA,
    busy_file,
    journal_file,
    queue_metadata,
    rank_file,
    row_event,
    write_json_atomic,
)

__all__ = ["RankTraceWriter", "collector_paused", "model_document", "run_document", "write_model_json",
           "write_run_json"]


def run_document(*, framework: str, engine: str, versions: dict[str, str], world_size: int, hosts: list[str],
                 steps: list[int], knobs: dict[str, Any], fingerprint: str, probe: list[list[float]],
                 pingpong: dict[int, list[list[float]]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The content of ``run.json`` (schema ``dpro.run/1``); ``extra`` holds engine-specific sections."""
    return {
        "schema": RUN_SCHEMA,
        "dpro_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "framework": framework,
        "engine": engine,
        "versions": versions,
        "world_size": world_size,
        "hosts": hosts,
        "profiled_steps": steps,
        "knobs": knobs,
        "model_fingerprint": fingerprint,
        "comm_probe": {"op": "allreduce", "world_size": world_size,
                       "note": "[bytes, µs] of allreduces on the job's process group, after a barrier (a recorder "
                               "that probes after the window writes them when the window ends)",
                       "samples": probe},
        "clocks": {
            "source": "CLOCK_MONOTONIC",
            "note": "ranks on one host share this clock; pingpong_us[r] holds [t0, t1, t2, t3] exchanges: "
                    "rank 0 sends at t0, rank r receives at t1 and answers at t2, rank 0 receives at t3",
            "pingpong_us": {str(r): rounds for r, rounds in pingpong.items()},
        },
        **(extra or {}),
    }


def write_run_json(run_dir: Path, doc: dict[str, Any]) -> Path:
    path = Path(run_dir) / RUN_FILE
    write_json_atomic(path, doc)
    return path


def model_document(*, fingerprint: str, gradients: list[dict[str, Any]], buckets: list[dict[str, Any]],
                   modules: list[dict[str, Any]]) -> dict[str, Any]:
    """The content of ``model.json`` (schema ``dpro.model/1``): gradients in ready order (name, bytes, shape,
    dtype, module, computed_by, ready_us), the communication groups seen, and the module tree."""
    return {
        "schema": MODEL_SCHEMA,
        "model_fingerprint": fingerprint,
        "param_bytes": sum(int(g["bytes"]) for g in gradients),
        "gradients": gradients,
        "buckets": sorted(buckets, key=lambda b: b["index"]),
        "modules": modules,
    }


def write_model_json(run_dir: Path, doc: dict[str, Any]) -> Path:
    path = Path(run_dir) / MODEL_FILE
    write_json_atomic(path, doc)
    return path


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's garbage collector off while the block runs (as it was before, after). Writing a rank's trace, or
    reading and modelling a thousand ranks, makes many small objects that live until the block ends; each
    collection they set off walks every object alive (torch's, the whole loaded run) again. They hold no cycles, so
    reference counting frees them; workers forked inside the block inherit the pause."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class RankTraceWriter:
    """Writes one rank's trace: a journal line per finished step, then ``rank-<r>.json`` at the end.

    Args:
        run_dir: the run directory (already claimed).
        rank: this process's rank; ``world_size`` the number of ranks.
        header: what the rank knows about itself (host, pid, clock, ...); stored in both files.
    """

    run_dir: Path
    rank: int
    world_size: int
    header: dict[str, Any]
    steps_done: list[int] = field(default_factory=list)
    finished: bool = False
    # each finished step's journal line: strings, which the garbage collector does not traverse (rows kept as lists
    # and dicts would add a few objects per event to every full collection of the training process)
    _lines: list[str] = field(default_factory=list, repr=False)

    @property
    def rows(self) -> list[list[Any]]:
        """Every finished step's events, in the order they were journaled."""
        return [row for line in self._lines for row in json.loads(line)["rows"]]

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        final = self.run_dir / rank_file(self.rank)
        if final.exists():
            raise UsageError(f"{final} already exists; dpro never overwrites a recorded rank trace")
        # "x": two processes claiming the same rank in one directory is an error, not a merge.
        self._journal = open(self.run_dir / journal_file(self.rank), "x")  # noqa: SIM115
        self._write_line({"schema": TRACE_SCHEMA, "rank": self.rank, "world_size": self.world_size,
                          "header": self.header})

    def _write_line(self, obj: dict[str, Any]) -> str:
        if _orjson is not None:
            try:
                line = _orjson.dumps(obj).decode()
            except TypeError:  # what orjson does not encode (an int over 64 bits, a subclass) json does
                line = json.dumps(obj, separators=(",", ":"))
        else:
            line = json.dumps(obj, separators=(",", ":"))
        self._journal.write(line + "\n")
        self._journal.flush()
        return line

    def end_step(self, step: int, rows: list[list[Any]]) -> None:
        """Record a finished step's events (``dpro.record.trace.event_row`` rows): journaled at once, kept."""
        self._lines.append(self._write_line({"step": step, "rows": rows}))
        self.steps_done.append(step)

    @contextlib.contextmanager
    def inside(self, what: str) -> Iterator[None]:
        """While the block runs, ``rank-<r>.busy.txt`` says ``what`` the rank is doing: if the process dies
        there (a framework call that aborts), the file tells the reader and the launcher where."""
        path = self.run_dir / busy_file(self.rank)
        path.write_text(what + "\n")
        try:
            yield
        finally:
            path.unlink(missing_ok=True)

    def finish(self, *, complete: bool, note: str = "") -> Path:
        """Write ``rank-<r>.json`` atomically with every finished step and remove the journal."""
        if self.finished:
            return self.run_dir / rank_file(self.rank)
        self.finished = True
        with collector_paused():  # a few objects per event, all alive until the file is written
            return self._write_rank_file(complete=complete, note=note)

    def _write_rank_file(self, *, complete: bool, note: str) -> Path:
        doc = {
            "schema": TRACE_SCHEMA,
            "dpro_version": __version__,
            "rank": self.rank,
            "world_size": self.world_size,
            "complete": complete,
            "note": note,
            "steps": self.steps_done,
            **self.header,
            "displayTimeUnit": "ms",
            "traceEvents": queue_metadata(self.rank, str(self.header.get("host", "?")))
            + [row_event(row, self.rank) for row in self.rows],
        }
        path = self.run_dir / rank_file(self.rank)
        write_json_atomic(path, doc)
        self._journal.close()
        (self.run_dir / journal_file(self.rank)).unlink(missing_ok=True)
        return path
