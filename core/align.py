"""Stage 2, align: put every rank on one clock.

Ranks of one host share CLOCK_MONOTONIC, so their offset is zero unless the measurements say
otherwise (an injected skew, a host name shared by two machines). Offsets come from the recording
handshake (timestamps taken as each of a few all_reduce calls returned, near-simultaneously on all
ranks) and are refined with collective end times: an allreduce ends at the same instant on every rank.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from dpro.load import Run

SAME_HOST_TOLERANCE_US = 1000.0  # handshake noise on one host is tens of µs; beyond this, trust the data


@dataclass
class Alignment:
    """Per-rank clock offsets (µs): a rank's aligned time is its recorded time minus ``offset_us[rank]``."""

    offset_us: dict[int, float] = field(default_factory=dict)
    method: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def handshake_offsets(run: Run) -> dict[int, float]:
    """Offset of each rank to rank 0 from the recording handshake (median over rounds)."""
    marks: dict[int, list[float]] = {}
    clocks = (run.meta or {}).get("clocks", {}).get("handshake_us", {})
    for key, values in clocks.items():
        marks[int(key)] = list(values)
    for rank, trace in run.ranks.items():
        values = (trace.clock or {}).get("handshake_us")
        if values and rank not in marks:
            marks[rank] = list(values)
    if 0 not in marks:
        return {}
    ref = marks[0]
    out = {}
    for rank, values in marks.items():
        n = min(len(values), len(ref))
        if n:
            out[rank] = statistics.median(values[i] - ref[i] for i in range(n))
    return out


def collective_offsets(run: Run, prior: dict[int, float]) -> dict[int, float]:
    """Refine offsets so that every collective ends at the same instant on all ranks.

    Uses, per rank, the median over collectives of (its end - rank 0's end), after ``prior``.
    """
    ends: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for rank, trace in run.ranks.items():
        for e in trace.events:
            if e["cat"] == "COMM":
                ends[(e["name"], e["args"].get("step"))][rank] = e["ts"] + e["dur"] - prior.get(rank, 0.0)
    diffs: dict[int, list[float]] = defaultdict(list)
    for members in ends.values():
        if 0 in members:
            for rank, end in members.items():
                diffs[rank].append(end - members[0])
    return {rank: prior.get(rank, 0.0) + statistics.median(d) for rank, d in diffs.items() if d}


def align(run: Run, *, refine: bool = True) -> Alignment:
    """Estimate every rank's clock offset to rank 0 (see module docstring)."""
    result = Alignment()
    hosts = (run.meta or {}).get("hosts") or []
    host0 = hosts[0] if hosts else None
    shake = handshake_offsets(run)
    refined = collective_offsets(run, shake) if refine and shake else {}
    for rank in sorted(run.ranks):
        same_host = bool(hosts) and rank < len(hosts) and hosts[rank] == host0
        estimate = refined.get(rank, shake.get(rank))
        if estimate is None:
            result.offset_us[rank] = 0.0
            result.method[rank] = "none (no handshake recorded)"
            if rank != 0:
                result.notes.append(f"rank {rank}: no clock handshake; assuming its clock equals rank 0's")
        elif same_host and abs(estimate) < SAME_HOST_TOLERANCE_US:
            result.offset_us[rank] = 0.0
            result.method[rank] = "same host"
        else:
            result.offset_us[rank] = estimate
            result.method[rank] = "handshake + collectives" if rank in refined else "handshake"
            if same_host:
                result.notes.append(f"rank {rank} shares host {host0} with rank 0 but its clock is "
                                    f"{estimate / 1000:.3f} ms off; corrected")
    return result
