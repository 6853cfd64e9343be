"""Stage 2, align: put every rank on one clock.

Ranks of one host share CLOCK_MONOTONIC, so their offset is zero unless the measurements say
otherwise (an injected skew, a host name shared by two machines). Offsets come from NTP-style
ping-pong exchanges between rank 0 and every rank when recording starts; collective end times (an
allreduce ends at the same instant on every rank) give an estimate where no exchange was recorded.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from dpro.io.load import Run
from dpro.record.trace import CATEGORIES

__all__ = [
    "Alignment",
    "SAME_HOST_TOLERANCE_US",
    "align",
    "collective_offsets",
    "pingpong_offsets",
]


COMM_CODE = CATEGORIES.index("COMM")
SAME_HOST_TOLERANCE_US = 1000.0  # ping-pong noise on one host is tens of µs; beyond this, trust the data


@dataclass
class Alignment:
    """Per-rank clock offsets (µs): a rank's aligned time is its recorded time minus ``offset_us[rank]``."""

    offset_us: dict[int, float] = field(default_factory=dict)
    method: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def pingpong_offsets(run: Run) -> dict[int, tuple[float, float]]:
    """Offset of each rank's clock to rank 0's, and the round-trip time it was measured with.

    From NTP-style exchanges recorded at the start (see run.json "clocks"): for each sample
    offset = ((t1 - t0) + (t2 - t3)) / 2; the sample with the shortest round trip wins.
    """
    clocks = (run.meta or {}).get("clocks", {}).get("pingpong_us", {})
    out: dict[int, tuple[float, float]] = {0: (0.0, 0.0)}
    for key, samples in clocks.items():
        best = None
        for t0, t1, t2, t3 in samples:
            rtt = (t3 - t0) - (t2 - t1)
            if best is None or rtt < best[1]:
                best = (((t1 - t0) + (t2 - t3)) / 2.0, rtt)
        if best is not None:
            out[int(key)] = best
    return out


def collective_offsets(run: Run, prior: dict[int, float]) -> dict[int, float]:
    """Refine offsets so that every collective ends at the same instant on all ranks.

    Uses, per rank, the median over collectives of (its end - rank 0's end), after ``prior``.
    """
    ends: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for rank, trace in run.ranks.items():
        t = trace.table
        comm = np.flatnonzero(t.cat == COMM_CODE)
        shift = prior.get(rank, 0.0)
        for name, step, ts, dur in zip(t.name[comm].tolist(), t.step[comm].tolist(), t.ts[comm].tolist(),
                                       t.dur[comm].tolist(), strict=True):
            ends[(t.names[name], step)][rank] = ts + dur - shift
    diffs: dict[int, list[float]] = defaultdict(list)
    for members in ends.values():
        if 0 in members:
            for rank, end in members.items():
                diffs[rank].append(end - members[0])
    return {rank: prior.get(rank, 0.0) + statistics.median(d) for rank, d in diffs.items() if d}


def align(run: Run, *, refine: bool = False) -> Alignment:
    """Estimate every rank's clock offset to rank 0 (see module docstring).

    The ping-pong exchange is the primary estimate (accurate to about half the round-trip
    asymmetry); ``refine`` also shifts ranks so that collectives end together, which helps
    only where no exchange was recorded.
    """
    result = Alignment()
    hosts = (run.meta or {}).get("hosts") or []
    host0 = hosts[0] if hosts else None
    measured = pingpong_offsets(run)
    prior = {r: off for r, (off, _) in measured.items()}
    refined = collective_offsets(run, prior) if refine or len(measured) < len(run.ranks) else {}
    for rank in sorted(run.ranks):
        same_host = bool(hosts) and rank < len(hosts) and hosts[rank] == host0
        if rank in measured:
            estimate, method = measured[rank][0], f"ping-pong (rtt {measured[rank][1]:.0f} us)"
            if refine and rank in refined:
                estimate, method = refined[rank], method + " + collectives"
        elif rank in refined:
            estimate, method = refined[rank], "collective end times"
        else:
            estimate, method = 0.0, "none"
            if rank != 0:
                result.notes.append(f"rank {rank}: no clock exchange or shared collective; assuming rank 0's clock")
        if same_host and abs(estimate) < SAME_HOST_TOLERANCE_US:
            result.offset_us[rank] = 0.0
            result.method[rank] = "same host (shared clock)"
            continue
        result.offset_us[rank] = estimate
        result.method[rank] = method
        if same_host:
            result.notes.append(f"rank {rank} shares host {host0} with rank 0 but its clock is "
                                f"{estimate / 1000:.3f} ms off; corrected")
    return result
