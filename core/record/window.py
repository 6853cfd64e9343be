"""What every plugin's recorder does the same way when its window opens and closes: the rank's trace (its header
says whose clock the times are on) and, at the end, which steps are missing and why, what recording cost the
training thread (``recording_overhead``) and the trace written. The framework parts (hooks, profilers, probes)
stay in each plugin's recorder."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dpro.record.protocol import recording_overhead
from dpro.record.writer import RankTraceWriter

__all__ = ["close_window", "open_trace"]


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
