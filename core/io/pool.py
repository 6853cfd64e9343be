"""Reading many files on several cores: a process pool that hands back plain results (arrays, dataclasses).

A thousand rank files take a minute to parse and check on one core; JSON parsing holds the interpreter, so threads
would not help. ``map_ordered`` runs a function over items in worker processes and yields the results in the
items' order (so the first bad file in that order is the error raised, as in a serial read). Workers are forked,
so they see the caller's environment at that moment (the ``DPRO_*`` limits) and need no importable main script
(a spawned worker re-runs the caller's script, which a script without a ``__main__`` guard does not survive). A
process running other threads is not forked (a lock one of them holds would stay held in the child forever):
there the items are read in this process, one after another, as with ``jobs=1``.

``jobs_wanted(jobs)``: ``jobs`` when given, else ``$DPRO_JOBS``, else the CPUs this process may use.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

from dpro.errors import UsageError
from dpro.record.protocol import usable_cpus
from dpro.record.writer import collector_paused

__all__ = ["JOBS_ENV", "collector_paused", "jobs_wanted", "map_ordered", "map_shared"]

JOBS_ENV = "DPRO_JOBS"
T = TypeVar("T")
R = TypeVar("R")
S = TypeVar("S")


def jobs_wanted(jobs: int | None = None) -> int:
    """How many processes may read at once: ``jobs``, else ``$DPRO_JOBS``, else the usable CPUs (at least 1).

    Raises:
        UsageError: ``jobs`` or ``$DPRO_JOBS`` is not a positive integer.
    """
    if jobs is None:
        text = os.environ.get(JOBS_ENV, "").strip()
        if not text:
            return usable_cpus()
        try:
            jobs = int(text)
        except ValueError:
            raise UsageError(f"${JOBS_ENV}={text!r}: give the number of processes, e.g. {JOBS_ENV}=2") from None
    if jobs < 1:
        raise UsageError(f"jobs must be at least 1, found {jobs}")
    return jobs


def map_shared(fn: Callable[[S, T], R], shared: S, items: Iterable[T], jobs: int) -> Iterator[R]:
    """``fn(shared, item)`` for each item, as ``map_ordered`` runs them: ``shared`` (a loaded run, say) reaches the
    forked workers as they start, in the memory they share with this process, never pickled."""
    if jobs <= 1 or not _can_fork():
        for item in items:
            yield fn(shared, item)
        return
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork"),
                               initializer=_receive, initargs=(shared,))
    try:
        yield from pool.map(functools.partial(_with_shared, fn), items)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_received: list[Any] = []  # in a worker of ``map_shared`` only: what its parent shared


def _receive(shared: Any) -> None:
    _received.append(shared)


def _with_shared(fn: Callable[[Any, T], R], item: T) -> R:
    return fn(_received[0], item)


def _can_fork() -> bool:
    return threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()


def map_ordered(fn: Callable[[T], R], items: Iterable[T], jobs: int, chunksize: int = 1) -> Iterator[R]:
    """``fn`` over ``items`` in ``jobs`` forked processes (in this one when ``jobs`` is 1 or other threads run),
    results in order.

    ``fn`` must be a module-level function; items and results cross processes pickled, so keep them plain.
    """
    if jobs <= 1 or not _can_fork():
        yield from map(fn, items)
        return
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork"))
    try:
        yield from pool.map(fn, items, chunksize=chunksize)
    finally:  # an error (or a caller that stops early) drops the items not started yet
        pool.shutdown(wait=True, cancel_futures=True)
