"""Framework-neutral recording: the step window, the run directory, the clock and the trace files.

Every plugin records through these pieces, so every framework writes the same run directory:

- ``parse_steps`` validates the profile window a user asked for.
- ``claim_run_dir`` picks the run directory (rank 0 decides; the plugin tells the other ranks) and
  refuses to reuse one that already holds a run.
- ``Clock`` is the rank's clock (CLOCK_MONOTONIC, shared by the ranks of one host).
- ``RankTraceWriter`` appends each finished step to a journal (so a rank that dies leaves its
  finished steps readable) and writes ``rank-<r>.json`` atomically at the end of the window.

Multi-host runs need no shared filesystem: each host writes the files of its own ranks into its own
copy of the run directory; the file names never collide, so copying them into one directory
(e.g. ``rsync host:run/ run/``) gives the whole run.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpro import __version__
from dpro.errors import UsageError
from dpro.record.trace import (
    TRACE_SCHEMA,
    journal_file,
    queue_metadata,
    rank_file,
    row_event,
    write_json_atomic,
)

__all__ = [
    "Clock",
    "DEFAULT_RUN_ROOT",
    "RUN_DIR_ENV",
    "RankTraceWriter",
    "SKEW_ENV",
    "check_window_fits",
    "claim_run_dir",
    "parse_skew",
    "parse_steps",
]


SKEW_ENV = "DPRO_CLOCK_SKEW_US"
RUN_DIR_ENV = "DPRO_RUN_DIR"
DEFAULT_RUN_ROOT = "dpro-runs"


def parse_steps(steps: Iterable[int]) -> tuple[int, ...]:
    """Validate a profile window (e.g. ``range(10, 20)``) and return its sorted step indices.

    Raises:
        UsageError: the window is empty, holds negative or non-integer steps.
    """
    try:
        chosen = sorted({int(s) for s in steps})
    except (TypeError, ValueError) as err:
        raise UsageError(f"steps must be integers such as range(10, 20), got {steps!r}") from err
    if not chosen:
        raise UsageError(f"steps={steps!r} is empty: give at least one step to profile, e.g. range(10, 20)")
    if chosen[0] < 0:
        raise UsageError(f"steps={steps!r} holds negative step {chosen[0]}; steps count from 0")
    return tuple(chosen)


def check_window_fits(steps: tuple[int, ...], total_steps: int | None, who: str) -> None:
    """Refuse a window that reaches beyond a run of ``total_steps`` iterations (when that is known)."""
    if total_steps is not None and steps[-1] >= total_steps:
        raise UsageError(
            f"{who}: steps up to {steps[-1]} asked for, but the run has only {total_steps} steps "
            f"(0..{total_steps - 1}); choose a window inside the run, e.g. range({max(0, total_steps - 5)}, "
            f"{total_steps})"
        )


def _is_run_dir(path: Path) -> bool:
    return any(path.iterdir())


def claim_run_dir(run_dir: str | Path | None, *, now: _dt.datetime | None = None) -> Path:
    """Choose and create the run directory (call on rank 0 only).

    ``run_dir`` None means a new timestamped directory under ``$DPRO_RUN_DIR`` or ``./dpro-runs``.
    An explicit ``run_dir`` must not exist yet or be empty: an existing run is never overwritten.

    Raises:
        UsageError: ``run_dir`` is a file, or a non-empty directory.
    """
    if run_dir is None:
        root = Path(os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_ROOT)
        if root.exists() and not root.is_dir():
            raise UsageError(f"run root {root} is a file, not a directory")
        stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
        for n in range(1000):
            candidate = root / (stamp if n == 0 else f"{stamp}-{n}")
            try:
                candidate.mkdir(parents=True)
                return candidate
            except FileExistsError:
                continue
        raise UsageError(f"could not find a free run directory name under {root}")
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise UsageError(f"run_dir {path} is a file; give a directory (it is created if missing)")
    if path.is_dir() and _is_run_dir(path):
        raise UsageError(
            f"run_dir {path} is not empty; dpro never overwrites a recorded run. "
            f"Give a new directory, or run_dir=None for a new timestamped one under ./{DEFAULT_RUN_ROOT}"
        )
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Clock:
    """The rank's clock in microseconds: CLOCK_MONOTONIC plus an optional injected skew (for tests).

    ``DPRO_CLOCK_SKEW_US`` shifts every timestamp a rank records, as if its host's clock were off;
    alignment must undo it. Either one number (this process) or per rank: ``"1:2000000,3:-500"``.
    """

    skew_us: float = 0.0

    @classmethod
    def from_env(cls, rank: int = 0) -> Clock:
        return cls(parse_skew(os.environ.get(SKEW_ENV, ""), rank))

    def now(self) -> float:
        return time.monotonic_ns() / 1000.0 + self.skew_us


def parse_skew(text: str, rank: int) -> float:
    """The skew for ``rank`` from a ``DPRO_CLOCK_SKEW_US`` value (see ``Clock``)."""
    text = text.strip()
    if not text:
        return 0.0
    try:
        if ":" not in text:
            return float(text)
        for item in text.split(","):
            r, _, us = item.partition(":")
            if int(r) == rank:
                return float(us)
        return 0.0
    except ValueError as err:
        raise UsageError(f"{SKEW_ENV}={text!r}: expected microseconds, or RANK:US pairs such as '1:2000000'") from err


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
    rows: list[list[Any]] = field(default_factory=list)
    finished: bool = False

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        final = self.run_dir / rank_file(self.rank)
        if final.exists():
            raise UsageError(f"{final} already exists; dpro never overwrites a recorded rank trace")
        # "x": two processes claiming the same rank in one directory is an error, not a merge.
        self._journal = open(self.run_dir / journal_file(self.rank), "x")  # noqa: SIM115
        self._write_line({"schema": TRACE_SCHEMA, "rank": self.rank, "world_size": self.world_size,
                          "header": self.header})

    def _write_line(self, obj: dict[str, Any]) -> None:
        self._journal.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._journal.flush()

    def end_step(self, step: int, rows: list[list[Any]]) -> None:
        """Record a finished step's events (``dpro.trace.event_row`` rows): journaled at once, kept for the end."""
        self._write_line({"step": step, "rows": rows})
        self.steps_done.append(step)
        self.rows.extend(rows)

    def finish(self, *, complete: bool, note: str = "") -> Path:
        """Write ``rank-<r>.json`` atomically with every finished step and remove the journal."""
        if self.finished:
            return self.run_dir / rank_file(self.rank)
        self.finished = True
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
