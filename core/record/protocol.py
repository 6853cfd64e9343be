"""The framework-neutral recording protocol: the step window, the run directory, the clock, and the
exchanges between ranks that every plugin runs when recording starts.

A plugin brings its framework's hooks and a small ``Transport`` (its process group: broadcast and gather
of short texts, a barrier, one timed point-to-point exchange, a blocking allreduce); everything else is
here, so every framework writes the same run directory:

- ``parse_steps`` / ``check_window_fits`` validate the profile window a user asked for.
- ``agree_run_dir``: rank 0 claims the run directory (``claim_run_dir`` refuses one that holds a run)
  and the others learn its name, or rank 0's error.
- ``Clock`` is the rank's clock (CLOCK_MONOTONIC, shared by the ranks of one host); ``clock_samples``
  runs NTP-style ping-pongs between rank 0 and every rank, for alignment.
- ``allreduce_probe`` times allreduces at a few sizes on the job's own process group (the cost model's
  shape when a job has a single bucket).
- ``probes_wanted`` / ``compile_regions_wanted``: which probe passes a recorder runs after its window
  (``$DPRO_PROBES``, ``$DPRO_PROBE_COMPILE``).
- ``dpro.record.writer`` writes the files (journal per step, ``rank-<r>.json``, run.json, model.json).

Multi-host runs need no shared filesystem: each host writes the files of its own ranks into its own
copy of the run directory; the file names never collide, so copying them into one directory
(e.g. ``rsync host:run/ run/``) gives the whole run.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dpro.errors import RecordingRefused, UsageError
from dpro.record import job_env
from dpro.record.trace import ROOT_MODULE

__all__ = [
    "BASELINE_STEPS",
    "Clock",
    "DEFAULT_RUN_ROOT",
    "LocalTransport",
    "PINGPONG_ROUNDS",
    "INTERFERENCE_PAIRS",
    "PROBE_BYTES",
    "PROBE_MOST",
    "PROBE_REPEAT",
    "PROBE_SIZE_BUDGET_US",
    "RUN_DIR_ENV",
    "SKEW_ENV",
    "STEP_TIMES_ENV",
    "StepClock",
    "Transport",
    "Window",
    "agree_run_dir",
    "allreduce_probe",
    "check_window_fits",
    "claim_run_dir",
    "clock_samples",
    "compile_regions_wanted",
    "host_cpu_busy_us",
    "interference_probe",
    "transfer_probe",
    "last_block_start",
    "parse_skew",
    "parse_steps",
    "parse_window",
    "probes_wanted",
    "recording_overhead",
    "step_ended",
    "usable_cpus",
    "wall_minus_clock_ns",
    "window_from_text",
    "window_steps",
]


PINGPONG_ROUNDS = 16
STEP_TIMES_ENV = job_env.STEP_TIMES
BASELINE_STEPS = 5  # unrecorded steps just before the window that a recorder's overhead is measured against
PROBE_BYTES = (64 * 1024, 512 * 1024, 2 * 1024 * 1024, 8 * 1024 * 1024)
PROBE_REPEAT = 5  # allreduces of each probe size at least ...
PROBE_MOST = 25  # ... and at most, as many as fit PROBE_SIZE_BUDGET_US
PROBE_SIZE_BUDGET_US = 2.5e5
SKEW_ENV = job_env.CLOCK_SKEW
RUN_DIR_ENV = job_env.RUN_DIR
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


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which containers and taskset narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


PROC_STAT = Path("/proc/stat")
BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq: not idle, iowait, steal (others' time), guest


def host_cpu_busy_us(stat: Path = PROC_STAT) -> float | None:
    """CPU time the whole machine has spent busy since it started (µs summed over its CPUs, Linux ``/proc/stat``);
    None where it cannot be read. Its growth over a step, against the step's length, is how many CPUs the host's
    processes (this rank's, its servers', others') kept busy."""
    try:
        with stat.open() as f:
            fields = f.readline().split()
        ticks = sum(int(fields[1 + i]) for i in BUSY_FIELDS)
        return ticks * 1e6 / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Window:
    """The iterations a recorder records, as ``START:STOP`` (START..STOP-1) or ``START:STOP:BLOCK``: from START,
    BLOCK recorded iterations, then BLOCK unrecorded ones, and so on until STOP. The gaps of such a window run
    with the recorder's hooks out, in the same job and on the same machine state, so the recording's cost on the
    step is measured against them (``recording_overhead``) rather than against warm-up steps."""

    start: int
    stop: int
    block: int = 0  # 0: no gaps

    @property
    def steps(self) -> list[int]:
        span = range(self.start, self.stop)
        return list(span) if not self.block else [i for i in span if (i - self.start) // self.block % 2 == 0]

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}" + (f":{self.block}" if self.block else "")


def parse_window(text: str, *, first: int = 0) -> Window:
    """``"10:20"`` -> iterations 10..19; ``"10:40:5"`` -> 10..14, 20..24, 30..34 (blocks of 5, gaps of 5).

    Raises:
        UsageError: not two or three integers, START below ``first``, STOP not after START, or a BLOCK below 2
            (a gap of one step runs the next block's hook installation, so it measures nothing unrecorded).
    """
    parts = text.split(":")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (2, 3):
        raise UsageError(f"{text!r}: expected START:STOP iterations (e.g. 10:20), or START:STOP:BLOCK for recorded "
                         f"blocks alternating with unrecorded ones (e.g. 10:40:5)")
    start, stop, block = numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else 0
    if start < first:
        raise UsageError(f"{text!r}: the window starts at {first} or later, e.g. {first}:{max(stop, first + 1)}")
    if stop <= start:
        raise UsageError(f"{text!r}: STOP must be greater than START, e.g. {start}:{start + 10}")
    if len(numbers) == 3 and block < 2:
        raise UsageError(f"{text!r}: BLOCK must be 2 or more, e.g. {start}:{stop}:5")
    return Window(start, stop, block)


def window_from_text(text: str | None, variable: str = job_env.PROFILE) -> tuple[Window, str | None]:
    """The window a launcher passed in ``variable`` (unset or empty: 10:20), and what was wrong with it when it
    could not be read (the default is used then: an auto-attached recorder never stops the job)."""
    if not text:
        return Window(10, 20), None
    try:
        return parse_window(text), None
    except UsageError as err:
        return Window(10, 20), f"{variable}={err}; recording 10:20"


def window_steps(text: str | None, say: Callable[[str], None]) -> list[int]:
    """The iterations an auto-attached recorder records: the window in ``text`` (``$DPRO_PROFILE``, START:STOP or
    START:STOP:BLOCK; 10:20 when unset), with what was wrong with it told through ``say``."""
    window, problem = window_from_text(text)
    if problem:
        say(problem)
    return window.steps


def probes_wanted() -> bool:
    """``$DPRO_PROBES`` is not "0" (the probe passes after the window are on by default)."""
    return os.environ.get(job_env.PROBES, "1").strip() != "0"


def compile_regions_wanted() -> list[str]:
    """The regions the compile probe times: ``$DPRO_PROBE_COMPILE``'s module paths, comma-separated (``<root>``
    when unset, none when "0")."""
    raw = os.environ.get(job_env.PROBE_COMPILE)
    if raw is None:
        return [ROOT_MODULE]
    return [] if raw.strip() in ("0", "") else [r.strip() for r in raw.split(",") if r.strip()]


def last_block_start(steps: Iterable[int]) -> int:
    """The first step of a window's last block (the window's first step when it has no gaps)."""
    ordered = sorted(steps)
    i = len(ordered) - 1
    while i > 0 and ordered[i - 1] == ordered[i] - 1:
        i -= 1
    return ordered[i]


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


def wall_minus_clock_ns(clock: Clock, samples: int = 32) -> float:
    """The wall clock (``time.time_ns``, what framework profilers stamp) minus the rank's ``clock``, in ns: the
    wall reading bracketed most tightly by two clock readings, at their midpoint. A thread preempted between two
    reads (a framework's own threads keep the cores busy) would shift every event converted with the pair."""
    best_bracket, best = float("inf"), 0.0
    for _ in range(samples):
        before = clock.now()
        wall = time.time_ns()
        after = clock.now()
        if after - before < best_bracket:
            best_bracket, best = after - before, wall - (before + after) * 500.0  # µs -> ns, at the midpoint
    return best


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


# ---- the exchanges between ranks -------------------------------------------------------------------


class Transport(Protocol):
    """What the recording protocol needs from a framework's process group (one object per process).

    Implementations: ``LocalTransport`` (one process) here; each plugin brings its framework's.
    """

    rank: int
    world_size: int
    backend: str        # the transport's backend, e.g. "gloo": stored in run.json's knobs

    def broadcast_text(self, text: str, root: int = 0) -> str:
        """``root``'s ``text`` on every rank (short texts: a path, an error message)."""

    def gather_texts(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order, on every rank."""

    def barrier(self) -> None:
        """Wait until every rank is here."""

    def ping(self, peer: int, clock: Clock) -> list[float] | None:
        """One NTP-style exchange between rank 0 and ``peer`` (every rank calls it): rank 0 sends at t0
        (its clock), ``peer`` receives at t1 and answers at t2 (its clock), rank 0 receives at t3.
        Returns ``[t0, t1, t2, t3]`` on rank 0, None elsewhere."""

    def timed_allreduce(self, nbytes: int, name: str, clock: Clock) -> float:
        """µs on ``clock`` of one allreduce of ``nbytes``, from its launch to its end (on the device too).
        Buffers are made, then every rank meets at a barrier, then the clock starts. ``name`` identifies the
        collective to engines that trace collectives by name."""


@dataclass
class LocalTransport:
    """The transport of a job that is not distributed: one rank, nothing to exchange."""

    rank: int = 0
    world_size: int = 1
    backend: str = "none"

    def broadcast_text(self, text: str, root: int = 0) -> str:
        return text

    def gather_texts(self, text: str) -> list[str]:
        return [text]

    def barrier(self) -> None:
        return None

    def ping(self, peer: int, clock: Clock) -> list[float] | None:
        return None

    def timed_allreduce(self, nbytes: int, name: str, clock: Clock) -> float:
        return 0.0


def agree_run_dir(transport: Transport, run_dir: str | Path | None, who: str,
                  claim: Callable[[str | Path | None], Path] = claim_run_dir) -> Path:
    """Rank 0 claims the run directory; the other ranks learn its name. A refusal is printed once, by rank 0, and
    raised on every rank as ``RecordingRefused`` (a ``UsageError``; uncaught, exit status 2 without a traceback).
    Each host creates its own copy: no shared filesystem is needed."""
    answer = ""
    if transport.rank == 0:
        try:
            claimed = claim(run_dir)
            if transport.world_size == 1:
                return claimed
            answer = "ok:" + str(claimed.resolve())
        except UsageError as err:
            answer = "error:" + str(err)
    kind, _, text = (transport.broadcast_text(answer) if transport.world_size > 1 else answer).partition(":")
    if kind == "error":
        if transport.rank == 0:  # one line for the whole job, not a traceback from every rank
            print(f"dpro: error: {who}: {text}", file=sys.stderr, flush=True)
        raise RecordingRefused(f"{who}: {text}")
    path = Path(text)
    path.mkdir(parents=True, exist_ok=True)
    return path


def clock_samples(transport: Transport, clock: Clock, rounds: int = PINGPONG_ROUNDS) -> dict[int, list[list[float]]]:
    """``rounds`` ping-pongs between rank 0 and every other rank: ``{peer: [[t0, t1, t2, t3], ...]}`` on
    rank 0 (alignment keeps the shortest round trip), ``{}`` elsewhere."""
    samples: dict[int, list[list[float]]] = {}
    for peer in range(1, transport.world_size):
        for _ in range(rounds):
            times = transport.ping(peer, clock)
            if transport.rank == 0 and times is not None:
                samples.setdefault(peer, []).append([float(t) for t in times])
    return samples


def allreduce_probe(transport: Transport, clock: Clock, sizes: Iterable[int] = PROBE_BYTES,
                    repeat: int = PROBE_REPEAT, size_budget_us: float = PROBE_SIZE_BUDGET_US,
                    most: int = PROBE_MOST) -> list[list[float]]:
    """``[bytes, µs]`` of blocking allreduces at a few sizes, each after a barrier: the shape of the
    communication cost model even when a job has a single bucket.

    Each size runs ``repeat`` times, and more (up to ``most``) where that fits ``size_budget_us``: on a busy host an
    allreduce either runs at once or waits a scheduler slice for a core, and the cost model needs how often it
    waits (the mean), which a few samples cannot tell. Every rank reads rank 0's count, so all run the same
    collectives."""
    if transport.world_size == 1:
        return []
    samples = []
    for nbytes in sizes:
        first = transport.timed_allreduce(nbytes, f"dpro.probe.{nbytes}.0", clock)
        fits = int(size_budget_us / max(first, 1.0))
        runs = int(transport.broadcast_text(str(min(most, max(repeat, fits)))))
        samples.append([float(nbytes), first])
        for i in range(1, runs):
            samples.append([float(nbytes), transport.timed_allreduce(nbytes, f"dpro.probe.{nbytes}.{i}", clock)])
    return samples


INTERFERENCE_TARGET = 3.0  # the probe's allreduce is sized to last this many times the compute it overlaps
INTERFERENCE_PAIRS = 21  # (alone, overlapped) pairs: enough that the few a neighbour slows are trimmed off
PROBE_BUDGET_US = 8e6  # each interference probe's pairs are cut to fit this (the job waits for them) ...
MIN_PAIRS = 5  # ... down to this many


def interference_probe(transport: Transport, clock: Clock, compute: Callable[[], None],
                       samples: list[list[float]], pairs: int = INTERFERENCE_PAIRS,
                       compute_is: str = "a fixed kernel") -> dict[str, Any] | None:
    """How much slower ``compute`` (a fixed kernel of the framework) runs while an allreduce is in flight: ``pairs``
    times, the kernel timed alone and right after while an allreduce (sized from the allreduce probe's ``samples``,
    [bytes, µs], to outlast it) is in flight; pairs, so that the machine's drift moves both halves alike. Only
    transports with ``overlapped_compute`` can; None otherwise. ``slowdown`` (the ``k`` of ``dpro.sim.interference``)
    and ``stderr`` come from the pairs whose allreduce outlasted the kernel (``_slowdown``). Every rank calls it at
    the same point (collectives)."""
    overlapped = getattr(transport, "overlapped_compute", None)
    if overlapped is None or not samples:
        return None
    warm = []
    for _ in range(2):  # the kernel's first runs allocate; their times size the allreduce
        t0 = clock.now()
        compute()
        warm.append(clock.now() - t0)
    nbytes_us = max(samples, key=lambda s: s[0])
    us_per_byte = max(nbytes_us[1], 1.0) / max(nbytes_us[0], 1.0)
    wanted = int(INTERFERENCE_TARGET * min(warm) / us_per_byte)
    # a pair lasts the compute alone, then at least the allreduce: a long pass (a big model's) gets fewer pairs
    affordable = int(PROBE_BUDGET_US / ((2.0 + INTERFERENCE_TARGET) * max(min(warm), 1.0)))
    agreed = transport.broadcast_text(f"{min(max(wanted, 64 * 1024), 64 * 2**20) // 4 * 4},"
                                      f"{min(pairs, max(MIN_PAIRS, affordable))}")  # rank 0's
    nbytes, pairs = (int(v) for v in agreed.split(","))
    alone, runs = [], []
    for i in range(pairs):
        t0 = clock.now()
        compute()
        alone.append(clock.now() - t0)
        runs.append(overlapped(nbytes, f"dpro.interference.{i}", compute, clock))
    kept = [(a, c) for a, (c, left) in zip(alone, runs, strict=True) if left > 0.05 * c and a > 0]
    slowdown, stderr = _slowdown(kept)
    return {"nbytes": nbytes, "compute_alone_us": alone, "compute_overlapped_us": [c for c, _ in runs],
            "allreduce_left_us": [left for _, left in runs], "slowdown": slowdown, "stderr": stderr,
            "compute": compute_is,
            "note": f"{compute_is} timed alone and, right after, while an allreduce of nbytes was in flight, in "
                    "pairs (after the window)"}


TRANSFER_TARGETS_US = (1000.0, 8000.0)  # the transfer probe's two allreduces, sized to last about this long alone
TRANSFER_PAIRS = 13  # (alone, under compute) pairs at each size


def transfer_probe(transport: Transport, clock: Clock, chunk: Callable[[], None], samples: list[list[float]],
                   pairs: int = TRANSFER_PAIRS) -> dict[str, Any] | None:
    """How much longer an allreduce takes while the rank computes throughout it (the transfer side of interference:
    on a CPU the threads that drive a collective wait for cores the compute holds; on a GPU its kernels share the
    SMs). At two sizes (from the allreduce probe's ``samples``, [bytes, µs], to last about ``TRANSFER_TARGETS_US``
    alone), ``pairs`` times: the allreduce waited for alone, then with ``chunk`` (the job's own pass, or a short
    kernel) run over and over until it is done (its end as the transport noted it). ``stall_us`` and ``slowdown``
    fit ``under compute = stall + (1 + slowdown) * alone`` through the two sizes' medians; ``excess_us`` is what
    compute adds to the smaller (``_transfer_fit``). Only transports with ``allreduce_under`` can; None otherwise.
    Every rank calls it at the same point (collectives)."""
    under = getattr(transport, "allreduce_under", None)
    if under is None or not samples:
        return None
    largest = max(samples, key=lambda s: s[0])
    us_per_byte = max(largest[1], 1.0) / max(largest[0], 1.0)
    sizes = [min(max(int(t / us_per_byte), 16 * 1024), 64 * 2**20) // 4 * 4 for t in TRANSFER_TARGETS_US]
    t0 = clock.now()
    chunk()
    pair_us = 2.0 * (clock.now() - t0) + 2.0 * sum(TRANSFER_TARGETS_US)  # a pass per allreduce under it, at least
    affordable = int(PROBE_BUDGET_US / (len(sizes) * pair_us))
    agreed = transport.broadcast_text(",".join(map(str, [*sizes, min(pairs, max(MIN_PAIRS, affordable))])))
    *sizes, pairs = (int(v) for v in agreed.split(","))  # rank 0's
    chunk_us: list[float] = []

    def timed_chunk() -> None:
        t0 = clock.now()
        chunk()
        chunk_us.append(clock.now() - t0)

    times: dict[int, tuple[list[float], list[float]]] = {}
    for nbytes in sizes:
        alone, loaded = [], []
        for i in range(pairs):
            alone.append(under(nbytes, f"dpro.transfer.{nbytes}.a{i}", None, clock))
            loaded.append(under(nbytes, f"dpro.transfer.{nbytes}.c{i}", timed_chunk, clock))
        times[nbytes] = (alone, loaded)
    fit = _transfer_fit(list(times.values()))
    return {"bytes": sizes, "alone_us": [times[s][0] for s in sizes], "under_compute_us": [times[s][1] for s in sizes],
            "chunk_us": statistics.fmean(chunk_us) if chunk_us else None, **fit,
            "note": "allreduces at two sizes waited for alone and while a kernel ran throughout them, in pairs (after "
                    "the window): under compute = stall + (1 + slowdown) * alone, through the sizes' medians"}


def _robust_spread(values: Iterable[float]) -> float:
    """The standard deviation as the interquartile range reads it: a resample that drew a neighbour's run several
    times moves a median far, and would set a plain standard deviation."""
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / 1.349


def _transfer_fit(sizes: list[tuple[list[float], list[float]]], resamples: int = 200) -> dict[str, float]:
    """``stall_us`` and ``slowdown`` of ``under = stall + (1 + slowdown) * alone`` through two sizes' medians (alone
    and under compute: a neighbour that takes the core lengthens a few runs, whichever kind), ``excess_us`` (the
    smaller size's median under compute less its median alone), each with its standard error (``*_stderr``, from the
    pairs resampled with replacement, a fixed seed, read off the resamples' quartiles). A slowdown or stall below 0
    is read as 0 (compute cannot speed a transfer up). Empty where fewer than 3 pairs of each of two sizes were
    timed."""
    if len(sizes) != 2 or any(len(a) < 3 or len(a) != len(c) for a, c in sizes):
        return {}

    def fit(chosen: list[tuple[list[float], list[float]]]) -> tuple[float, float, float]:
        (a1, c1), (a2, c2) = [(statistics.median(a), statistics.median(c)) for a, c in chosen]
        slope = max((c2 - c1) / (a2 - a1), 1.0) if abs(a2 - a1) > 1e-9 else 1.0
        return max(c1 - slope * a1, 0.0), slope - 1.0, c1 - a1

    stall, slowdown, excess = fit(sizes)
    rng = random.Random(0)
    spread = []
    for _ in range(resamples):
        drawn = []
        for alone, loaded in sizes:
            picks = [rng.randrange(len(alone)) for _ in alone]
            drawn.append(([alone[i] for i in picks], [loaded[i] for i in picks]))
        spread.append(fit(drawn))
    errors = [_robust_spread(column) for column in zip(*spread, strict=True)]
    return {"stall_us": stall, "stall_stderr": errors[0], "slowdown": slowdown, "stderr": errors[1],
            "excess_us": excess, "excess_stderr": errors[2]}


TRIM = 0.2  # the share of each end of the probe's times left out: a neighbour that takes the core for one run


def _trimmed_mean(values: list[float]) -> float:
    ordered = sorted(values)
    cut = int(TRIM * len(ordered))
    return statistics.fmean(ordered[cut:len(ordered) - cut] or ordered)


def _slowdown(pairs: list[tuple[float, float]], resamples: int = 200) -> tuple[float | None, float | None]:
    """(k, its standard error) from (alone, overlapped) kernel times: the trimmed mean overlapped over the trimmed
    mean alone, less 1. A mean, not a median of ratios: a step is a sum of its ops, and overlap slows some runs a lot
    and others not at all (a core shared or not), which a median of ratios reads as no slowdown. The error is the
    spread over pairs resampled with replacement (a fixed seed: the same pairs give the same answer)."""
    if not pairs:
        return None, None

    def k(chosen: list[tuple[float, float]]) -> float:
        return _trimmed_mean([c for _, c in chosen]) / _trimmed_mean([a for a, _ in chosen]) - 1.0

    if len(pairs) < 3:
        return k(pairs), None
    rng = random.Random(0)
    spread = [k([pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(resamples)]
    return k(pairs), statistics.stdev(spread)


def step_ended(ends: dict[int, tuple[float, float]], iteration: int, window: list[int]) -> None:
    """Note in ``ends`` when ``iteration`` ended (wall s, this thread's CPU s), if ``recording_overhead`` will use it:
    from a few steps before the window to its end. A recorder calls it at every step boundary, after its own work."""
    if window[0] - BASELINE_STEPS - 2 <= iteration <= window[-1]:
        ends[iteration] = (time.perf_counter(), time.thread_time())


def recording_overhead(ends: dict[int, tuple[float, float]], window: list[int]) -> dict[str, Any] | None:
    """What recording cost the training thread: ``ends`` maps an iteration to (wall s, thread CPU s) when it ended
    (a recorder's step boundary, after its own work for that step); each iteration lasts from the end of the one
    before. The steps of ``window`` that follow a recorded step (not a block's first) are compared with, in a window
    with gaps (recorded blocks between unrecorded ones), the unrecorded steps of its gaps except each one just
    before a block (which installs the block's hooks at its end) and each one just after a block (where another rank
    may still be closing its block: its wait is the block's cost, not the unrecorded step's): steps of the same job
    in the same state, with whatever the recorder leaves running between blocks. Without gaps, they are compared
    with the unrecorded steps before the window (at most ``BASELINE_STEPS``, the one just before the window left
    out: the window's clock exchange and probe run at its end), which may still be warming up. Medians, None without
    both. A rank writes the result in its trace's header (``recording_overhead``) and ``dpro info`` shows it."""
    def lasted(iterations: list[int]) -> list[tuple[float, float]]:
        return [(ends[i][0] - ends[i - 1][0], ends[i][1] - ends[i - 1][1]) for i in iterations
                if i in ends and i - 1 in ends]

    first, recorded = min(window), set(window)
    gaps = lasted([i for i in range(first, max(window))
                   if i not in recorded and i + 1 not in recorded and i - 1 not in recorded])
    before = gaps or lasted(list(range(first - 1 - BASELINE_STEPS, first - 1)))
    # a recorded step whose predecessor was recorded too: a block's first step also holds starting the block (a
    # profiler's start), which no recorded step's own time includes, so it is left out as the model leaves it out
    during = lasted([i for i in sorted(window)[1:] if i - 1 in recorded])
    if not before or not during:
        return None
    base_wall, base_cpu = (statistics.median(v[k] for v in before) * 1000.0 for k in (0, 1))
    wall, cpu = (statistics.median(v[k] for v in during) * 1000.0 for k in (0, 1))
    walls = sorted(v[0] * 1000.0 for v in before)
    # how much the unrecorded steps vary among themselves: an overhead inside it cannot be told from noise
    spread = (walls[(3 * len(walls)) // 4] - walls[len(walls) // 4]) / 2.0 if len(walls) >= 4 else None
    return {"unrecorded_steps": len(before), "recorded_steps": len(during), "baseline": "gaps" if gaps else "before",
            "wall_spread_pct": 100.0 * spread / base_wall if spread is not None and base_wall > 0 else None,
            "wall_ms": [base_wall, wall], "thread_cpu_ms": [base_cpu, cpu],
            "wall_pct": 100.0 * (wall / base_wall - 1.0) if base_wall > 0 else None,
            "thread_cpu_pct": 100.0 * (cpu / base_cpu - 1.0) if base_cpu > 0 else None}


class StepClock:
    """The step clock of an unrecorded job (``$DPRO_STEP_TIMES``, which benches set): the wall-clock time
    (``time.time()``) at the end of each step and the process's CPU time then (every thread's), written to ``path``
    as ``{"rank": 0, "step_ends": [...], "cpu_ends": [...]}`` every ``every`` steps and at ``write()`` (exit).
    One call per step, no recorder: what a job's steps take without dpro."""

    def __init__(self, path: str | Path, every: int = 25) -> None:
        self.path = Path(path)
        self.every = every
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []

    def step_ended(self) -> None:
        self.ends.append(time.time())
        self.cpu_ends.append(time.process_time())
        if len(self.ends) % self.every == 0:
            self.write()

    def write(self) -> None:
        """Replace the file atomically; a file that cannot be written is said on stderr (the job goes on)."""
        try:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps({"rank": 0, "step_ends": self.ends, "cpu_ends": self.cpu_ends}),
                           encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as err:
            print(f"[dpro] {STEP_TIMES_ENV}: cannot write {self.path}: {err}", file=sys.stderr, flush=True)
