"""One rank's validated events as columns (``EventTable``): what a run of a thousand ranks is kept as.

A Python dict per event costs about half a kilobyte; a rank of 4,000 events a step for 10 steps, times a thousand
ranks, would not fit a machine. The table keeps names, categories, queues, times and steps as numpy arrays and each
distinct ``args`` object once (events of one op in one step mostly share theirs), about 40 bytes an event.
``events_of`` turns a table back into the events as they were read (same keys, same order, ints stayed ints), for
the readers that want dicts; an event laid out otherwise than dpro writes events is kept as read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpro.record.trace import CATEGORIES

try:  # a fast encoder to key the args objects by; the standard library's otherwise
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

__all__ = ["CATEGORY_CODE", "EventTable", "events_of", "table_from_events"]

CATEGORY_CODE = {cat: i for i, cat in enumerate(CATEGORIES)}
STANDARD_KEYS = ("name", "cat", "ph", "ts", "dur", "pid", "tid", "args")
TS_INT, DUR_INT = 1, 2   # bits of ``EventTable.ints``: the number was a JSON integer
INEXACT = 4              # ... an integer a float64 cannot hold: the event is kept as read (``EventTable.odd``)


@dataclass
class EventTable:
    """A rank's "X" events in file order, one array entry per event (see module docstring)."""

    names: list[str]            # distinct op names; ``name`` indexes them
    name: np.ndarray            # int32
    cat: np.ndarray             # int8, index into ``dpro.record.trace.CATEGORIES``
    tid: np.ndarray             # int64
    ts: np.ndarray              # float64 µs
    dur: np.ndarray             # float64 µs
    step: np.ndarray            # int64, args.step
    arg_sets: list[dict[str, Any]]   # distinct args objects; ``arg`` indexes them (shared: read, never change)
    arg: np.ndarray             # int32
    ints: np.ndarray            # uint8: TS_INT | DUR_INT where the file held integers
    odd: dict[int, dict[str, Any]]   # event index -> the event as read, where it is not laid out as dpro writes

    def __len__(self) -> int:
        return int(self.name.size)

    @property
    def nbytes(self) -> int:
        """The arrays' bytes (the names and args objects not counted)."""
        return sum(a.nbytes for a in (self.name, self.cat, self.tid, self.ts, self.dur, self.step, self.arg,
                                      self.ints))

    def take(self, index: np.ndarray) -> EventTable:
        """The events at ``index`` (in that order), sharing the names and args objects."""
        index = np.asarray(index, dtype=np.int64)
        odd = {}
        if self.odd:
            where = {old: new for new, old in enumerate(index.tolist())}
            odd = {where[i]: ev for i, ev in self.odd.items() if i in where}
        return EventTable(self.names, self.name[index], self.cat[index], self.tid[index], self.ts[index],
                          self.dur[index], self.step[index], self.arg_sets, self.arg[index], self.ints[index], odd)


def table_from_events(events: Iterable[dict[str, Any]], rank: int) -> EventTable:
    """The table of validated "X" events (``dpro.io.load.validate_events``'s output) of rank ``rank``."""
    name_id: dict[str, int] = {}
    arg_id: dict[Any, int] = {}
    arg_sets: list[dict[str, Any]] = []
    names, cats, tids, tss, durs, steps, args, ints = [], [], [], [], [], [], [], []
    odd: dict[int, dict[str, Any]] = {}
    code = CATEGORY_CODE
    dumps = _orjson.dumps if _orjson is not None else None
    for i, ev in enumerate(events):
        a = ev["args"]
        try:
            key = dumps(a) if dumps is not None else json.dumps(a)
        except TypeError:  # an integer beyond 64 bits
            key = json.dumps(a)
        k = arg_id.get(key)
        if k is None:
            k = arg_id[key] = len(arg_sets)
            arg_sets.append(a)
        ts, dur = ev["ts"], ev["dur"]
        names.append(name_id.setdefault(ev["name"], len(name_id)))
        cats.append(code[ev["cat"]])
        tids.append(ev["tid"])
        tss.append(ts)
        durs.append(dur)
        steps.append(a["step"])
        args.append(k)
        flags = 0
        if type(ts) is int:
            flags = TS_INT if abs(ts) <= 2**53 else INEXACT
        if type(dur) is int:
            flags |= DUR_INT if dur <= 2**53 else INEXACT
        ints.append(flags)
        if flags & INEXACT or tuple(ev) != STANDARD_KEYS or ev["ph"] != "X" or ev["pid"] != rank:
            odd[i] = ev  # kept as read: laid out otherwise, or an integer a float64 cannot hold
    return EventTable(list(name_id), np.array(names, dtype=np.int32), np.array(cats, dtype=np.int8),
                      np.array(tids, dtype=np.int64), np.array(tss, dtype=np.float64),
                      np.array(durs, dtype=np.float64), np.array(steps, dtype=np.int64), arg_sets,
                      np.array(args, dtype=np.int32), np.array(ints, dtype=np.uint8), odd)


def _copied(value: Any) -> Any:
    """A copy of a JSON value (the table's args objects are shared; the events handed out are the caller's)."""
    if type(value) is dict:
        return {k: _copied(v) for k, v in value.items()}
    if type(value) is list:
        return [_copied(v) for v in value]
    return value


def _same(value: Any) -> Any:
    return value


def events_of(table: EventTable, rank: int, *, copy: bool = True) -> list[dict[str, Any]]:
    """The events of ``table`` as dicts, as they were read: each its own objects (the caller may change them), or,
    with ``copy=False``, sharing the table's args objects (to be written out, not changed)."""
    out: list[dict[str, Any]] = []
    names, arg_sets, odd = table.names, table.arg_sets, table.odd
    _copy = _copied if copy else _same
    for i, (n, c, tid, ts, dur, k, flags) in enumerate(zip(
            table.name.tolist(), table.cat.tolist(), table.tid.tolist(), table.ts.tolist(), table.dur.tolist(),
            table.arg.tolist(), table.ints.tolist(), strict=True)):
        if i in odd:
            out.append(_copied(odd[i]) if copy else dict(odd[i]))
            continue
        out.append({"name": names[n], "cat": CATEGORIES[c], "ph": "X",
                    "ts": int(ts) if flags & TS_INT else ts, "dur": int(dur) if flags & DUR_INT else dur,
                    "pid": rank, "tid": tid, "args": _copy(arg_sets[k])})
    return out
