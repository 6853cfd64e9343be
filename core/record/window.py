"""What every plugin's recorder does the same way: the window's lifecycle (``WindowRecorder``), the rank's trace
when the window opens (its header says whose clock the times are on) and, when it closes, which steps are missing
and why, what recording cost the training thread (``recording_overhead``) and the trace written. The framework
parts (hooks, profilers, probes, the rows of a step) stay in each plugin's recorder."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from dpro.record.protocol import Transport, check_window_fits, parse_steps, recording_overhead, step_ended
from dpro.record.writer import RankTraceWriter

__all__ = ["WindowEnd", "WindowRecorder", "close_window", "open_trace"]


def open_trace(run_dir: Path, rank: int, world_size: int, *, host: str, device: str) -> RankTraceWriter:
    """This rank's trace writer, its header naming the host, the process and the clock (``device``: what the times
    were read from, e.g. ``"cuda-events"`` or ``"host (TensorFlow profiler)"``)."""
    header = {"host": host, "pid": os.getpid(), "clock": {"source": "CLOCK_MONOTONIC", "unit": "us", "device": device}}
    return RankTraceWriter(run_dir, rank, world_size, header)


def close_window(writer: RankTraceWriter, steps: Iterable[int], *, error: BaseException | None = None,
                 problems: Iterable[str] = (), step_ends: dict[int, tuple[float, float]] | None = None,
                 overhead_extra: Mapping[str, Any] | None = None) -> list[int]:
    """Finish ``writer``'s trace: complete when every step of ``steps`` was written, else with a note saying why
    (``error`` that stopped the job, ``problems`` the recorder met, or the run ending early), and with what
    recording cost (``recording_overhead`` of ``step_ends``, plus ``overhead_extra``) when it can be told.
    Returns the missing steps."""
    window = list(steps)
    missing = [s for s in window if s not in writer.steps_done]
    reasons = [f"stopped by {type(error).__name__}: {error}"] if error is not None else []
    note = "; ".join([*reasons, *(p for p in problems if p)])
    if missing and not note:
        note = f"the run ended before steps {missing[0]}..{missing[-1]}"
    overhead = recording_overhead(step_ends, window) if step_ends is not None else None
    if overhead is not None:
        writer.header["recording_overhead"] = {**overhead, **(overhead_extra or {})}
    writer.finish(complete=not missing, note=note)
    return missing


@dataclass
class WindowEnd:
    """What a recorder says of its window as it closes: the problems it met (the trace's note) and what else its
    recording cost (``recording_overhead``'s extra entries)."""

    problems: list[str] = field(default_factory=list)
    overhead_extra: Mapping[str, Any] | None = None


class WindowRecorder:
    """The lifecycle of a recorder, written once (a framework's recorder implements its hooks, rows and extras):

    - ``begin_step()`` at the start of an iteration: nothing once closed; the window opens (``_begin_window``, which
      sets ``_writer``) at its first step; then ``_on_step_begin()``.
    - ``end_step()`` at its end: nothing once closed; ``_on_step_end()``, then the overhead's clock
      (``step_ended``, when ``measures_overhead``), the iteration counted, and ``close()`` after the window's last.
    - ``close(error)``, safe to call twice: leaves the active set, ``_on_close()``; a window that never opened only
      ``_close_unstarted()``; else ``_end_window(error)`` (the framework's last rows), the trace finished with its
      note and overhead (``close_window``), and ``_after_window(error)``.

    ``active``: a framework's recorders alive in this process (a subclass names its own set), so that its
    auto-attach leaves alone a script that records itself.
    """

    active: ClassVar[weakref.WeakSet[WindowRecorder] | None] = None
    measures_overhead: ClassVar[bool] = True
    """Whether the steps' ends are timed for ``recording_overhead`` (the training thread's cost of recording)."""

    def __init__(self, steps: Iterable[int], *, total_steps: int | None, who: str) -> None:
        """``steps``: the iterations to record, counted from 0; a window beyond ``total_steps`` (when known) is
        refused at once, in the words of ``who`` (the API the user called)."""
        self.who = who
        self.steps = parse_steps(steps)
        check_window_fits(self.steps, total_steps, who)
        self.window = frozenset(self.steps)
        self.iteration = 0
        self.run_dir: Path | None = None
        self.transport: Transport | None = None
        self._writer: RankTraceWriter | None = None
        self._closed = False
        self._step_ends: dict[int, tuple[float, float]] = {}  # iteration -> (wall, thread CPU) at its end
        if self.active is not None:
            self.active.add(self)

    @property
    def started(self) -> bool:
        """The window has opened (this rank's trace is being written)."""
        return self._writer is not None

    # ---- step boundaries ---------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """At the start of an iteration."""
        if self._closed:
            return
        if self.iteration == self.steps[0] and not self.started:
            self._begin_window()
        self._on_step_begin()

    def end_step(self) -> None:
        """At the end of an iteration."""
        if self._closed:
            return
        self._on_step_end()
        if self.measures_overhead:
            step_ended(self._step_ends, self.iteration, self.steps)  # the overhead's clock
        self.iteration += 1
        if self.iteration > self.steps[-1]:
            self.close()

    # ---- close ---------------------------------------------------------------------------------------------------

    def close(self, error: BaseException | None = None) -> Path | None:
        """End recording: finish this rank's trace (complete, or with a note saying why not). Safe to call twice.
        Returns the run directory, or None when the window never opened."""
        if self._closed:
            return self.run_dir
        self._closed = True
        if self.active is not None:
            self.active.discard(self)
        self._on_close()
        if self._writer is None:
            self._close_unstarted()
            return None
        end = self._end_window(error)
        close_window(self._writer, self.steps, error=error, problems=end.problems, step_ends=self._step_ends,
                     overhead_extra=end.overhead_extra)
        self._after_window(error)
        return self.run_dir

    def _close_transport(self) -> None:
        closer = getattr(self.transport, "close", None)
        if callable(closer):
            closer()

    # ---- the hooks a framework's recorder implements ------------------------------------------------------------

    def _begin_window(self) -> None:
        """Open the window: agree with the other ranks, write run.json, start timing; set ``_writer``."""
        raise NotImplementedError

    def _on_step_begin(self) -> None:
        """What the framework does as an iteration begins (after the window opened, if it opens now)."""

    def _on_step_end(self) -> None:
        """What the framework does as an iteration ends (its rows, before the iteration is counted)."""

    def _on_close(self) -> None:
        """What the framework undoes first on close, window opened or not (its hooks)."""

    def _close_unstarted(self) -> None:
        """Close a recorder whose window never opened."""
        self._close_transport()

    def _end_window(self, error: BaseException | None) -> WindowEnd:
        """The framework's last work on the window (stop profilers, build and write the last rows)."""
        return WindowEnd()

    def _after_window(self, error: BaseException | None) -> None:
        """After the trace is finished: model.json, probes, the transport closed."""
        self._close_transport()
