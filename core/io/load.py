"""Read and validate a run directory (docs/architecture.md "The run directory") into per-rank event tables.

Loading goes in layers: ``read_json`` parses one file, ``load_rank_file`` / ``load_journal`` turn one
rank's file into a ``RankTrace``, and ``load_run`` gathers a whole directory into a ``Run``.

What makes a file unreadable raises ``TraceError`` naming the file, the line or event, and what is
wrong. What analysis can work around (a rank without a trace, a rank that crashed, a missing
model.json) is collected in ``Run.problems`` instead, so a partial run can still be inspected.

Only JSON is read, with ``json.loads``; nothing in a run directory is ever executed.

Example::

    run = load_run("dpro-runs/20240101-120000")
    for rank, trace in run.ranks.items():
        print(rank, step_times_ms(trace))
    print("\\n".join(run.problems))
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from sys import intern
from typing import Any

from dpro.errors import TraceError, kind_of, shown
from dpro.io.events import EventTable, events_of, table_from_events
from dpro.io.limits import (
    STEPS_ENV,
    WORLD_SIZE_ENV,
    is_finite_number,
    parse_bounded_json,
    read_file,
    steps_limit,
    stream_bytes,
    world_size_limit,
)
from dpro.io.pool import collector_paused, jobs_wanted, map_ordered
from dpro.progress import Progress
from dpro.record.trace import (
    CATEGORIES,
    MODEL_FILE,
    MODEL_SCHEMA,
    QUEUE_ID,
    RUN_FILE,
    RUN_SCHEMA,
    TRACE_SCHEMA,
    journal_file,
    rank_file,
    row_event,
)

__all__ = [
    "RankTrace",
    "Run",
    "format_steps",
    "is_finite_number",
    "interrupted_calls",
    "load_journal",
    "load_model_json",
    "load_rank_file",
    "load_run",
    "load_run_json",
    "median_difference_stderr_pct",
    "overhead_of",
    "read_json",
    "RecordingCost",
    "recording_cost",
    "run_step_times_ms",
    "step_times_ms",
    "validate_events",
]

_RANK_FILE = re.compile(r"rank-(\d+)\.json")
_JOURNAL_FILE = re.compile(r"rank-(\d+)\.partial\.jsonl")
_REQUIRED = ("name", "cat", "ph", "ts", "dur")
PROGRESS_BYTES = 50 * 2**20  # rank files together this big take seconds to read: say so as they load
INT64 = 2**63  # queue ids and step numbers are kept as 64-bit integers
PARALLEL_BYTES = 16 * 2**20  # rank files together this big are read on several cores (unless jobs is given)


@dataclass
class RankTrace:
    """One rank's validated trace.

    ``events`` are the "X" events in file order; ``queues`` maps a ``tid`` to its queue name;
    ``complete`` is False for a rank that stopped early (a journal, or a final file saying so);
    ``header`` is what the rank wrote about itself (schema, rank, world_size, host, pid, clock, note, ...).
    """

    rank: int
    path: Path
    complete: bool
    steps: list[int]
    events: list[dict[str, Any]]
    queues: dict[int, str]
    host: str | None
    clock: dict[str, Any]
    header: dict[str, Any]
    world_size: int | None = None
    note: str = ""
    skipped_steps: int = 0      # recorded steps before the last ``steps_limit()``, not read

    @property
    def from_journal(self) -> bool:
        """True when this trace was read from ``rank-<r>.partial.jsonl`` (the rank never finished)."""
        return self.path.name.endswith(".partial.jsonl")

    @property
    def table(self) -> EventTable:
        """The events as columns (``dpro.io.events``): what analysis reads. Made anew from ``events`` on every call
        while those are out (they may change at any time; ``compact`` ends that), else kept from loading."""
        kept = self.__dict__
        if kept.get("_events") is not None:
            return table_from_events(kept["_events"], self.rank)
        return kept["_table"]

    def compact(self) -> RankTrace:
        """Keep the events as columns only (``table``), until something asks for ``events`` again."""
        kept = self.__dict__
        if kept.get("_table") is None:
            kept["_table"] = table_from_events(kept["_events"], self.rank)
        kept["_events"] = None
        return self


def _trace_events(trace: RankTrace) -> list[dict[str, Any]]:
    kept = trace.__dict__
    if kept.get("_events") is None:
        kept["_events"] = events_of(kept["_table"], trace.rank)
    kept["_table"] = None  # the caller may change the events: the columns are rebuilt from them when asked
    return kept["_events"]


def _set_trace_events(trace: RankTrace, events: list[dict[str, Any]]) -> None:
    trace.__dict__["_events"] = events
    trace.__dict__["_table"] = None


# the "X" events in file order, as dicts: made from the columns on first use (a loaded trace keeps columns only)
RankTrace.events = property(_trace_events, _set_trace_events)  # type: ignore[assignment]


@dataclass
class Run:
    """A loaded run directory: its metadata, model, per-rank traces and the problems found."""

    path: Path
    meta: dict[str, Any] | None
    model: dict[str, Any] | None
    ranks: dict[int, RankTrace]
    problems: list[str] = field(default_factory=list)
    # steps an engine keeps out of the step model, and why (steps that ran with a costlier recording mechanism,
    # when enough ran without it): they stay in the traces and in what the engine reads from them
    set_aside: dict[int, str] = field(default_factory=dict)
    # whether the run's engine completed it from its own traces (``dpro.engines.prepared``; ``load_run`` only reads)
    engine_prepared: bool = False

    @property
    def world_size(self) -> int:
        """World size from run.json, else as the rank files state it, else the highest rank + 1."""
        if self.meta is not None:
            return int(self.meta["world_size"])
        stated = [t.world_size for t in self.ranks.values() if t.world_size is not None]
        return max(stated + [r + 1 for r in self.ranks] + [0])

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks below ``world_size`` that have no trace at all."""
        return [r for r in range(self.world_size) if r not in self.ranks]

    @property
    def profiled_steps(self) -> list[int]:
        """The steps the run asked to profile (from run.json; empty when unknown)."""
        return list(self.meta.get("profiled_steps", [])) if self.meta else []


# ---- one file ------------------------------------------------------------------------------------


def read_json(path: str | Path) -> dict[str, Any]:
    """Parse one JSON file that must hold an object.

    Raises:
        TraceError: the file cannot be read, is not UTF-8, is not valid JSON (cut off or malformed),
            or holds something other than an object.
    """
    path = Path(path)
    return _document(path, _read_bytes(path))


def _document(path: Path, raw: bytes) -> dict[str, Any]:
    doc = _parse_json(path, _decoded(path, raw))
    if not isinstance(doc, dict):
        raise TraceError(path, f"expected a JSON object at the top, found {kind_of(doc)}")
    return doc


def _read_bytes(path: Path) -> bytes:
    return read_file(path, TraceError)


def _read_text(path: Path) -> str:
    return _decoded(path, _read_bytes(path))


def _decoded(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TraceError(path, f"not UTF-8 text (byte {err.start}); is this a JSON file?") from err


def _parse_json(path: Path, text: str, where: str | None = None) -> Any:
    try:
        return parse_bounded_json(text, path, TraceError)
    except json.JSONDecodeError as err:
        at = where or f"line {err.lineno}, column {err.colno}"
        raise TraceError(path, _json_problem(text, err), at) from err


def _json_problem(text: str, err: json.JSONDecodeError) -> str:
    if not text.strip():
        return "the file is empty, not JSON (truncated? the writer may have died)"
    if not text[err.pos:].strip():
        return f"invalid JSON: the document ends too early (truncated? {err.msg})"
    return f"invalid JSON: {err.msg}"


def _check_schema(path: Path, doc: dict[str, Any], expected: str, what: str) -> None:
    schema = doc.get("schema")
    if schema is None:
        raise TraceError(path, f"no 'schema' key; this dpro reads {expected} — is this a dpro {what}?")
    if schema != expected:
        raise TraceError(path, f"schema {schema!r} is not supported; this dpro reads {expected}")


def _need(
    path: Path, doc: dict[str, Any], key: str, kinds: type | tuple[type, ...], where: str | None = None
) -> Any:
    """``doc[key]``, refused unless it is one of ``kinds`` (a bool never passes for an int)."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    value = doc.get(key)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        found = "nothing" if key not in doc else shown(value, 60)
        raise TraceError(path, f"'{key}' must be {names}, found {found}", where)
    return value


def _optional_field(path: Path, item: dict[str, Any], key: str, check: Callable[[Any], bool], what: str,
                    where: str) -> None:
    """Refuse ``item[key]`` when it is present, not null, and fails ``check``."""
    value = item.get(key)
    if value is not None and not check(value):
        raise TraceError(path, f"'{key}' must be {what}, found {shown(value, 60)}", where)


def _is_name(value: Any) -> bool:
    return isinstance(value, str)


def _is_size(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- events --------------------------------------------------------------------------------------


def validate_events(
    path: Path, raw: Any, *, rank: int, where: str = "", key: str = "traceEvents",
    step_marks: dict[int, str] | None = None,
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Check a list of Chrome trace events; return the "X" events and the queue names (thread_name).

    Events of other phases are skipped. ``step_marks`` (step -> where its STEP event is) carries
    across calls, so a step marked twice is refused even when its events are split over journal lines.

    Raises:
        TraceError: an event lacks name/cat/ph/ts/dur, has non-numeric or negative times, an unknown
            category, no integer ``args.step``, a pid other than ``rank``, or a non-integer tid.
    """
    if not isinstance(raw, list):
        raise TraceError(path, f"'{key}' must be a list of events, found {kind_of(raw)}", where or None)
    marks = step_marks if step_marks is not None else {}
    fast = _laid_out_events(path, raw, rank, where, marks)
    if fast is not None:
        return fast
    events: list[dict[str, Any]] = []
    queues: dict[int, str] = {}
    for i, ev in enumerate(raw):
        at = f"{where}, event {i}" if where else f"event {i}"
        if not isinstance(ev, dict):
            raise TraceError(path, f"an event must be an object, found {kind_of(ev)}", at)
        if ev.get("name") is not None:
            at = f"{at} {str(ev['name'])[:80]!r}"
        if ev.get("ph") == "M":
            _read_metadata(path, ev, queues, at)
        elif ev.get("ph") == "X" or "ph" not in ev:
            _check_x_event(path, ev, rank, at)
            _check_step_once(path, ev, marks, at)
            events.append(ev)
    return events, queues


_LAID_OUT = ("name", "cat", "ph", "ts", "dur", "pid", "tid", "args")  # an X event as dpro's writers lay it out


def _laid_out_events(path: Path, raw: list[Any], rank: int, where: str,
                     marks: dict[int, str]) -> tuple[list[dict[str, Any]], dict[int, str]] | None:
    """``validate_events``'s answer for events laid out as dpro writes them, checked in one tight pass (a thousand
    ranks' events are millions); None at the first event it does not vouch for, and ``validate_events`` checks the
    list the long way (which names what is wrong). ``marks`` changes only on success."""
    events: list[dict[str, Any]] = []
    queues: dict[int, str] = {}
    added: dict[int, str] = {}
    categories = CATEGORIES
    for i, ev in enumerate(raw):
        if type(ev) is not dict:
            return None
        if tuple(ev) != _LAID_OUT:
            if ev.get("ph") != "M" or ev.get("name") is None:
                return None
            at = f"{where}, event {i}" if where else f"event {i}"
            _read_metadata(path, ev, queues, f"{at} {str(ev['name'])[:80]!r}")
            continue
        name, cat, ph, ts, dur, pid, tid, args = ev.values()
        if not (ph == "X" and type(name) is str and name and cat in categories and type(tid) is int
                and type(args) is dict and type(args.get("step")) is int and pid == rank
                and -INT64 <= tid < INT64 and -INT64 <= args["step"] < INT64):
            return None
        if not ((type(ts) is float or type(ts) is int) and (type(dur) is float or type(dur) is int)
                and ts - ts == 0 and dur - dur == 0 and dur >= 0):  # x - x is 0 for a finite number only
            return None
        if len(args) > 1:
            try:
                if cat == "COMM" and "bytes" in args and not (is_finite_number(args["bytes"]) and args["bytes"] >= 0):
                    return None
                _check_list_args(path, args, "")
            except TraceError:
                return None
        if cat == "STEP":
            step = args["step"]
            if step in marks or step in added:
                return None
            at = f"{where}, event {i}" if where else f"event {i}"
            added[step] = f"{at} {name[:80]!r}"
        events.append(ev)
    marks.update(added)
    return events, queues


def _read_metadata(path: Path, ev: dict[str, Any], queues: dict[int, str], at: str) -> None:
    if ev.get("name") != "thread_name":
        return
    tid, args = ev.get("tid"), ev.get("args")
    if not _is_int(tid) or not isinstance(args, dict) or not isinstance(args.get("name"), str):
        raise TraceError(path, "thread_name metadata needs an integer 'tid' and args.name (the queue)", at)
    queues[tid] = args["name"]


def _check_x_event(path: Path, ev: dict[str, Any], rank: int, at: str) -> None:
    missing = [k for k in _REQUIRED if k not in ev]
    if missing:
        raise TraceError(path, f"event lacks {', '.join(repr(k) for k in missing)} (every X event needs "
                               f"{', '.join(_REQUIRED)})", at)
    if not isinstance(ev["name"], str) or not ev["name"]:
        raise TraceError(path, f"'name' must be a non-empty string, found {ev['name']!r}", at)
    if ev["cat"] not in CATEGORIES:
        raise TraceError(path, f"unknown category {ev['cat']!r}; dpro traces use {', '.join(CATEGORIES)}", at)
    for key in ("ts", "dur"):
        if not is_finite_number(ev[key]):
            raise TraceError(path, f"'{key}' must be a number of microseconds, found {ev[key]!r}", at)
    if ev["dur"] < 0:
        raise TraceError(path, f"negative duration {ev['dur']!r}", at)
    if ev.get("pid", rank) != rank:
        pid = ev.get("pid")
        raise TraceError(path, f"event pid {pid!r} in the trace of rank {rank} (pid must be the rank)", at)
    if not _is_int(ev.get("tid")):
        raise TraceError(path, f"'tid' must be an integer queue id, found {ev.get('tid')!r}", at)
    args = ev.get("args")
    if not isinstance(args, dict) or not _is_int(args.get("step")):
        found = args.get("step") if isinstance(args, dict) else args
        raise TraceError(path, f"args.step must be the integer step index, found {found!r}", at)
    for what, value in (("'tid'", ev["tid"]), ("args.step", args["step"])):
        if not -INT64 <= value < INT64:  # kept in 64-bit columns (dpro.io.events)
            raise TraceError(path, f"{what} {shown(value, 40)} is beyond 64 bits", at)
    if ev["cat"] == "COMM" and "bytes" in args and not (is_finite_number(args["bytes"]) and args["bytes"] >= 0):
        raise TraceError(path, f"COMM args.bytes must be a non-negative number, found {args['bytes']!r}", at)
    _check_list_args(path, args, at)


# args the core reads, with what each must hold (a list of ...)
_LIST_ARGS: dict[str, tuple[str, Any]] = {
    "tensors": ("gradient names", lambda v: isinstance(v, str)),
    "grads": ("gradient names", lambda v: isinstance(v, str)),
    "grads_ready_us": ("times in µs", lambda v: is_finite_number(v)),
    "servers": ("server numbers", lambda v: _is_int(v) and v >= 0),
    "part_bytes": ("byte counts", lambda v: is_finite_number(v) and v >= 0),
}


def _check_list_args(path: Path, args: dict[str, Any], at: str) -> None:
    for key, (what, ok) in _LIST_ARGS.items():
        if key in args and not (isinstance(args[key], list) and all(ok(v) for v in args[key])):
            raise TraceError(path, f"args.{key} must be a list of {what}, found {str(args[key])[:40]}", at)
    if "grads_ready_us" in args and len(args["grads_ready_us"]) != len(args.get("grads") or []):
        raise TraceError(path, "args.grads_ready_us must hold one time per name in args.grads", at)
    if "key" in args and not _is_int(args["key"]):
        raise TraceError(path, f"args.key must be an integer kvstore key, found {args['key']!r:.40}", at)


def _check_step_once(path: Path, ev: dict[str, Any], marks: dict[int, str], at: str) -> None:
    if ev["cat"] != "STEP":
        return
    step = ev["args"]["step"]
    if step in marks:
        raise TraceError(path, f"step {step} has a second STEP event (the first is {marks[step]})", at)
    marks[step] = at


def _check_queues(path: Path, events: list[dict[str, Any]], queues: dict[int, str]) -> None:
    for ev in events:
        if ev["tid"] not in queues:
            known = ", ".join(f"{t}={n}" for t, n in sorted(queues.items()))
            raise TraceError(path, f"tid {ev['tid']} has no thread_name metadata (known queues: {known})",
                             f"event {ev['name']!r} of step {ev['args']['step']} at ts {ev['ts']}")


def _default_queues() -> dict[int, str]:
    return {tid: name for name, tid in QUEUE_ID.items()}


# ---- one rank ------------------------------------------------------------------------------------


def load_rank_file(path: str | Path, rank: int | None = None, *, upto: int | None = None) -> RankTrace:
    """Read a finished ``rank-<r>.json`` (a Chrome trace object with dpro's header): its last
    ``steps_limit()`` steps, or the last up to step ``upto`` (a file of ``stream_bytes()`` or more is read from its
    end, as far back as they reach).

    Raises:
        TraceError: unreadable file, wrong schema, a rank other than the file name's, or a bad event.
    """
    path = Path(path)
    raw = _read_bytes(path)
    read = _read_from_end(path, raw, steps_limit(), upto) if len(raw) >= stream_bytes() else None
    if read is None:
        doc = _document(path, raw)
        read = _Pieces(doc, [("", doc.get("traceEvents"))])
    del raw
    doc = read.doc
    _check_schema(path, doc, TRACE_SCHEMA, "rank trace")
    file_rank = _need(path, doc, "rank", int)
    if rank is not None and file_rank != rank:
        raise TraceError(path, f"file says rank {file_rank}, but its name is rank {rank}'s; was it renamed?")
    marks: dict[int, str] = {}
    events: list[dict[str, Any]] = []
    queues: dict[int, str] = {}
    for where, piece in read.pieces:
        got, named = validate_events(path, piece, rank=file_rank, where=where, step_marks=marks)
        events += got
        queues.update(named)
    steps = _steps_list(path, doc["steps"], "steps") if "steps" in doc else sorted(marks)
    queues = queues or _default_queues()
    _check_queues(path, events, queues)
    header = {k: v for k, v in doc.items() if k != "traceEvents"}
    complete = doc.get("complete") is not False
    trace = _rank_trace(path, file_rank, header, steps, events, queues, complete=complete)
    return _last_steps(trace, steps_limit(), windowed=len(read.pieces) > 1, upto=upto)


@dataclass
class _Pieces:
    """A rank file as read: its keys besides the events, and its events as lists of raw events, in file order,
    each with where it lies in the file (for messages)."""

    doc: dict[str, Any]
    pieces: list[tuple[str, Any]]


EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
EVENT_SEPARATOR = re.compile(rb"\}\s*,\s*\{")   # between two events (compact, or json.dumps's ", ", or indented)
SEARCH_BYTES = 1 << 20
FRONT_BYTES = 1_000_000    # the queue names (thread_name metadata) come first in the events


class _NotLaidOut(Exception):
    """The file is not laid out as dpro writes it: it is parsed whole instead."""


def _read_from_end(path: Path, raw: bytes, keep_steps: int, upto: int | None = None) -> _Pieces | None:
    """The rank file's header keys, its first megabyte of events and, from its end backwards, pieces of an eighth
    of ``stream_bytes()`` until one lies wholly before the last ``keep_steps`` steps; None when the file does not split
    that way (the caller parses it whole, which also gives exact messages for a broken file).

    A piece is cut where one event ends and the next begins (``},{``). A cut inside a string or inside an event
    leaves a piece that is not valid JSON (an unterminated string, an unclosed bracket), so any piece that fails
    to parse sends the whole file to the whole-file parse: a split that parses is a split between events.
    """
    keys = list(EVENTS_KEY.finditer(raw))
    if len(keys) != 1:
        return None
    body = keys[0].end()
    first = EVENT_SEPARATOR.search(raw, body + FRONT_BYTES)
    if first is None:
        return None
    front_cut, front_next = first.start(), first.end() - 1  # the "}" ending an event, the "{" starting the next
    piece_bytes = max(1 << 18, stream_bytes() // 8)
    try:
        doc = _piece(path, raw[:body] + b"]}", dict)
        pieces = [(f"bytes {body}..{front_cut + 1}", _piece(path, b"[" + raw[body:front_cut + 1] + b"]", list))]
        back: list[tuple[str, Any]] = []
        seen: set[int] = set()
        end, end_next = len(raw), None
        while end_next != front_next:
            cut = _last_separator(raw, front_next, end - piece_bytes)
            cut, cut_next = (front_cut, front_next) if cut is None else cut
            if end_next is None:  # the last piece runs on to the end of the document: the keys after the events
                tail = _piece(path, b'{"traceEvents":[' + raw[cut_next:], dict)
                events = tail.pop("traceEvents")
                if not isinstance(events, list):
                    raise _NotLaidOut
                doc.update(tail)
            else:
                events = _piece(path, b"[" + raw[cut_next:end + 1] + b"]", list)
            back.append((f"bytes {cut_next}..{end + 1}", events))
            steps = _piece_steps(events)
            seen |= {s for s in steps if upto is None or s <= upto}
            end, end_next = cut, cut_next
            if len(seen) > keep_steps and steps and max(steps) < sorted(seen)[-keep_steps]:
                break  # this piece is wholly older than the steps kept: so is everything before it
    except _NotLaidOut:
        return None
    doc["traceEvents"] = []
    return _Pieces(doc, pieces + back[::-1])


def _last_separator(raw: bytes, lo: int, hi: int) -> tuple[int, int] | None:
    """The last event separator starting after ``lo`` and before ``hi``: (its "}", its "{"), or None."""
    while hi > lo:
        window_lo = max(lo + 1, hi - SEARCH_BYTES)
        last = None
        for match in EVENT_SEPARATOR.finditer(raw, window_lo, min(len(raw), hi + 64)):
            if match.start() >= hi:
                break
            last = match
        if last is not None:
            return last.start(), last.end() - 1
        hi = window_lo
    return None


def _piece(path: Path, text: bytes, kind: type) -> Any:
    try:
        value = parse_bounded_json(text, path, TraceError)
    except (ValueError, TraceError):  # json.JSONDecodeError is a ValueError
        raise _NotLaidOut from None
    if not isinstance(value, kind):
        raise _NotLaidOut
    return value


def _piece_steps(events: list[Any]) -> set[int]:
    """The step numbers a piece's events carry (before they are checked: only to know where to stop)."""
    return {a["step"] for e in events if type(e) is dict and type(a := e.get("args")) is dict
            and type(a.get("step")) is int}


def _last_steps(trace: RankTrace, keep: int, *, windowed: bool = False, upto: int | None = None) -> RankTrace:
    """``trace`` with only its last ``keep`` steps (by number; those with a STEP event; up to step ``upto``), and
    how many recorded steps were left out. ``windowed``: the file was read from its end, so earlier steps were
    never read."""
    everything = sorted({e["args"]["step"] for e in trace.events if e["cat"] == "STEP"})
    marked = [s for s in everything if upto is None or s <= upto]
    if len(marked) <= keep and not windowed and len(marked) == len(everything):
        return trace
    kept = set(marked[-keep:])
    trace.events = [e for e in trace.events if e["args"]["step"] in kept]
    recorded = set(trace.steps) | set(marked)
    trace.steps = [s for s in trace.steps if s in kept] if trace.steps else sorted(kept)
    trace.skipped_steps = len(recorded - kept)
    return trace


def load_journal(path: str | Path, rank: int | None = None, *,
                 upto: int | None = None) -> tuple[RankTrace, list[str]]:
    """Read ``rank-<r>.partial.jsonl``, the journal of a rank that did not finish.

    A broken final line (the process died mid-write) is skipped and reported in the returned problems.

    Raises:
        TraceError: a broken header or a broken line before the last, wrong schema, or a bad event.
    """
    path = Path(path)
    text = _read_text(path)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise TraceError(path, "the journal is empty (the rank died before it recorded anything)")
    first = _parse_json(path, lines[0], "line 1")
    if not isinstance(first, dict):
        raise TraceError(path, f"line 1 must be the header object, found {kind_of(first)}", "line 1")
    _check_schema(path, first, TRACE_SCHEMA, "rank journal")
    file_rank = _need(path, first, "rank", int, "line 1")
    if rank is not None and file_rank != rank:
        raise TraceError(path, f"journal says rank {file_rank}, but its name is for rank {rank}", "line 1")
    if not isinstance(first.get("header", {}), dict):
        raise TraceError(path, f"'header' must be an object, found {kind_of(first['header'])}", "line 1")
    header = {k: v for k, v in first.items() if k != "header"}
    header.update(first.get("header") or {})
    problems: list[str] = []
    steps: list[int] = []
    seen: set[int] = set()
    events: list[dict[str, Any]] = []
    marks: dict[int, str] = {}
    for n, line in enumerate(lines[1:], start=2):
        record = _journal_line(path, line, n, last=n == len(lines), problems=problems)
        if record is None:
            continue
        step = _need(path, record, "step", int, f"line {n}")
        if step in seen:
            raise TraceError(path, f"step {step} is journaled twice", f"line {n}")
        raw = _journal_events(path, record, file_rank, n)
        step_events, _ = validate_events(path, raw, rank=file_rank, where=f"line {n}",
                                         key="events", step_marks=marks)
        for ev in step_events:
            if ev["args"]["step"] != step:
                raise TraceError(path, f"event of step {ev['args']['step']} on the line of step {step}",
                                 f"line {n}, event {ev['name']!r}")
        steps.append(step)
        seen.add(step)
        events.extend(step_events)
    queues = _default_queues()
    _check_queues(path, events, queues)
    trace = _rank_trace(path, file_rank, header, steps, events, queues, complete=False)
    return _last_steps(trace, steps_limit(), upto=upto), problems


def _journal_events(path: Path, record: dict[str, Any], rank: int, n: int) -> Any:
    """A journal line's events: compact ``rows`` (``dpro.record.trace.event_row``) or full ``events``."""
    if "rows" not in record:
        return record.get("events")
    rows = record["rows"]
    if not isinstance(rows, list):
        raise TraceError(path, f"'rows' must be a list, found {kind_of(rows)}", f"line {n}")
    events = []
    for i, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) == 6 and isinstance(row[5], dict)):
            raise TraceError(path, "a row must be [name, cat, tid, ts_ns, dur_ns, args]", f"line {n}, row {i}")
        if not (is_finite_number(row[3]) and is_finite_number(row[4])):
            raise TraceError(path, f"ts_ns and dur_ns must be numbers of nanoseconds, found {row[3]!r:.20}, "
                                   f"{row[4]!r:.20}", f"line {n}, row {i}")
        events.append(row_event(row, rank))
    return events


def _journal_line(path: Path, line: str, n: int, *, last: bool, problems: list[str]) -> dict[str, Any] | None:
    try:
        record = parse_bounded_json(line, path, lambda p, problem: TraceError(p, problem, f"line {n}"))
    except json.JSONDecodeError as err:
        if not last:
            raise TraceError(path, f"{_json_problem(line, err)} in the middle of the journal",
                             f"line {n}, column {err.colno}") from err
        problems.append(f"{path.name}: line {n} is cut off (the process died while writing it); ignored")
        return None
    if not isinstance(record, dict):
        raise TraceError(path, f"a journal line must be an object, found {kind_of(record)}", f"line {n}")
    return record


def _steps_list(path: Path, value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(s) for s in value):
        raise TraceError(path, f"'{key}' must be a list of integer step indices, found {value!r}"[:160])
    return list(value)


def _rank_trace(
    path: Path, rank: int, header: dict[str, Any], steps: list[int], events: list[dict[str, Any]],
    queues: dict[int, str], *, complete: bool,
) -> RankTrace:
    world_size = header.get("world_size")
    clock = header.get("clock")
    return RankTrace(
        rank=rank, path=path, complete=complete, steps=steps, events=events, queues=queues,
        host=header.get("host") if isinstance(header.get("host"), str) else None,
        clock=clock if isinstance(clock, dict) else {},
        header=header,
        world_size=world_size if _is_int(world_size) and 0 < world_size <= world_size_limit() else None,
        note=str(header.get("note") or ""),
    )


# ---- run.json / model.json -----------------------------------------------------------------------


def load_run_json(path: str | Path) -> dict[str, Any]:
    """Read and check ``run.json``: schema, a positive ``world_size``, ``hosts`` and ``profiled_steps``."""
    path = Path(path)
    doc = read_json(path)
    _check_schema(path, doc, RUN_SCHEMA, "run.json")
    world_size = _need(path, doc, "world_size", int)
    if world_size < 1:
        raise TraceError(path, f"'world_size' must be at least 1, found {world_size}")
    if world_size > world_size_limit():
        raise TraceError(path, f"'world_size' {world_size} is above the {world_size_limit():,} ranks dpro reads "
                               f"(${WORLD_SIZE_ENV} raises the limit)")
    if "hosts" in doc and not isinstance(doc["hosts"], list):
        raise TraceError(path, f"'hosts' must be a list (one host per rank), found {kind_of(doc['hosts'])}")
    _steps_list(path, doc.get("profiled_steps", []), "profiled_steps")
    if "knobs" in doc and not isinstance(doc["knobs"], dict):
        raise TraceError(path, f"'knobs' must be an object, found {kind_of(doc['knobs'])}")
    for key in ("engine", "framework"):
        if key in doc and not isinstance(doc[key], str):
            raise TraceError(path, f"'{key}' must be a name, found {kind_of(doc[key])}")
    _check_clocks(path, doc.get("clocks", {}))
    _check_comm_probe(path, doc.get("comm_probe", {}))
    return doc


def _check_comm_probe(path: Path, probe: Any) -> None:
    """``comm_probe.samples``: a list of [bytes, µs] pairs of finite numbers >= 0 (the comm model fits them)."""
    if not isinstance(probe, dict):
        raise TraceError(path, f"must be an object, found {kind_of(probe)}", "comm_probe")
    samples = probe.get("samples", [])
    if not isinstance(samples, list):
        raise TraceError(path, f"must be a list of [bytes, µs] pairs, found {kind_of(samples)}", "comm_probe.samples")
    for i, sample in enumerate(samples):
        if not (isinstance(sample, list) and len(sample) == 2 and all(is_finite_number(v) and v >= 0 for v in sample)):
            raise TraceError(path, "a sample must be [bytes, µs], two finite numbers >= 0", f"comm_probe.samples[{i}]")


def _check_clocks(path: Path, clocks: Any) -> None:
    """``clocks.pingpong_us``: rank -> a list of [t0, t1, t2, t3] exchanges of finite numbers (alignment reads them)."""
    if not isinstance(clocks, dict):
        raise TraceError(path, f"'clocks' must be an object, found {kind_of(clocks)}")
    pingpong = clocks.get("pingpong_us", {})
    if not isinstance(pingpong, dict):
        raise TraceError(path, f"must be an object of rank -> exchanges, found {kind_of(pingpong)}",
                         "clocks.pingpong_us")
    for rank, rounds in pingpong.items():
        where = f"clocks.pingpong_us[{rank!r}]"
        if not (isinstance(rank, str) and rank.isdigit()):
            raise TraceError(path, "keys must be rank numbers", where)
        if not isinstance(rounds, list):
            raise TraceError(path, f"must be a list of [t0, t1, t2, t3] exchanges, found {kind_of(rounds)}", where)
        for i, exchange in enumerate(rounds):
            if not (isinstance(exchange, list) and len(exchange) == 4 and all(is_finite_number(t) for t in exchange)):
                raise TraceError(path, "an exchange must be [t0, t1, t2, t3], four finite numbers (µs)",
                                 f"{where}[{i}]")


def load_model_json(path: str | Path) -> dict[str, Any]:
    """Read and check ``model.json``: gradients (name, bytes), buckets (bytes, tensors) and modules."""
    path = Path(path)
    doc = read_json(path)
    _check_schema(path, doc, MODEL_SCHEMA, "model.json")
    for key, needs in (("gradients", (("name", str), ("bytes", int))),
                       ("buckets", (("bytes", int), ("tensors", list))),
                       ("modules", (("name", str),))):
        items = doc.get(key, [])
        if not isinstance(items, list):
            raise TraceError(path, f"'{key}' must be a list, found {kind_of(items)}")
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise TraceError(path, f"an entry must be an object, found {kind_of(item)}", f"{key}[{i}]")
            for name, kind in needs:
                _need(path, item, name, kind, f"{key}[{i}]")
            if key == "gradients":
                shape = item.get("shape", [])
                if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
                    raise TraceError(path, f"'shape' must be a list of sizes, found {str(shape)[:40]}",
                                     f"gradients[{i}]")
                if item["bytes"] < 0:
                    raise TraceError(path, f"'bytes' must not be negative, found {item['bytes']}", f"gradients[{i}]")
            _check_model_entry(path, key, item, f"{key}[{i}]")
    _optional_field(path, doc, "param_bytes", _is_size, "a byte count", "param_bytes")
    names: set[str] = set()
    for i, gradient in enumerate(doc.get("gradients", [])):
        if gradient["name"] in names:
            raise TraceError(path, f"the gradient {gradient['name']!r:.60} is listed twice", f"gradients[{i}]")
        names.add(gradient["name"])
    bucket_of: dict[str, int] = {}
    for i, bucket in enumerate(doc.get("buckets", [])):
        for t in bucket["tensors"]:
            if "gradients" in doc and t not in names:
                raise TraceError(path, f"names {t!r:.60}, which is not one of the gradients", f"buckets[{i}]")
            if t in bucket_of:  # a gradient is reduced once per step, in one bucket
                raise TraceError(path, f"names {t!r:.60} again (it is in buckets[{bucket_of[t]}])", f"buckets[{i}]")
            bucket_of[t] = i
    return doc


def _check_model_entry(path: Path, key: str, item: dict[str, Any], where: str) -> None:
    """The optional fields of a model.json entry that analysis reads: byte counts, names, flags."""
    if key == "gradients":
        for name in ("module", "computed_by", "dtype"):
            _optional_field(path, item, name, _is_name, "a name", where)
    elif key == "buckets":
        _optional_field(path, item, "index", _is_size, "a bucket number", where)
        if not all(isinstance(t, str) for t in item["tensors"]):
            raise TraceError(path, "'tensors' must be a list of gradient names", where)
    else:
        _optional_field(path, item, "parent", _is_name, "a module name", where)
        _optional_field(path, item, "type", _is_name, "a type name", where)
        _optional_field(path, item, "param_bytes", _is_size, "a byte count", where)
        _optional_field(path, item, "activation_bytes", _is_size, "a byte count", where)
        _optional_field(path, item, "recorded", lambda v: isinstance(v, bool), "true or false", where)


# ---- a run ---------------------------------------------------------------------------------------


def load_run(path: str | Path, *, jobs: int | None = None) -> Run:
    """Load and validate a run directory: rank files are read in ``jobs`` processes (``dpro.io.pool.jobs_wanted``;
    by default only when they hold ``PARALLEL_BYTES`` or more), each kept as columns (``RankTrace.table``). Reads
    only: the run's engine completes it from its own traces in a step of its own (``dpro.engines.prepared``;
    ``dpro.engines.load_prepared`` is both).

    Returns:
        A ``Run`` whose ``problems`` list what analysis must work around (missing or unfinished ranks,
        missing run.json or model.json, ranks that recorded different steps).

    Raises:
        TraceError: ``path`` is not a run directory, or one of its files is unreadable or invalid.
    """
    with collector_paused():
        return _load_run(Path(path), jobs)


def _load_run(root: Path, jobs: int | None) -> Run:
    if not root.exists():
        raise TraceError(root, "no such directory")
    if not root.is_dir():
        raise TraceError(root, "not a dpro run directory: this is a file; give the directory that holds "
                               f"{RUN_FILE} and rank-<r>.json")
    finals, journals = _rank_files(root)
    has_meta, has_model = (root / RUN_FILE).is_file(), (root / MODEL_FILE).is_file()
    if not (finals or journals or has_meta or has_model):
        raise TraceError(root, f"not a dpro run directory (no {RUN_FILE}, {MODEL_FILE} or rank-<r>.json)")
    problems: list[str] = []
    meta = load_run_json(root / RUN_FILE) if has_meta else None
    model = load_model_json(root / MODEL_FILE) if has_model else None
    if meta is None:
        problems.append(f"{RUN_FILE} is missing: engine, knobs and profiled steps are unknown "
                        "(rank 0 writes it when recording starts)")
    if model is None:
        problems.append(f"{MODEL_FILE} is missing: gradient sizes and buckets are unknown "
                        "(rank 0 writes it after its first profiled step)")
    ranks: dict[int, RankTrace] = {}
    cut_lines: dict[int, list[str]] = {}
    files = {rank: finals.get(rank) or journals[rank] for rank in sorted(set(finals) | set(journals))}
    total = sum(_size(f) for f in files.values())
    workers = min(jobs_wanted(jobs), len(files))
    if jobs is None and total < PARALLEL_BYTES:
        workers = 1  # starting the processes would take longer than reading
    tasks = [(rank, file, rank in finals, None) for rank, file in files.items()]
    with Progress(len(files), "loading rank files", quiet=None if total >= PROGRESS_BYTES else True) as bar:
        for (rank, file, _, _), (trace, cut) in zip(tasks, map_ordered(
                _load_one, tasks, workers, chunksize=max(1, len(tasks) // (8 * workers))), strict=True):
            # one string per op name, not one per rank: the step models and graphs of every rank share it
            trace.table.names[:] = [intern(name) for name in trace.table.names]
            ranks[rank] = trace
            if cut is not None:
                cut_lines[rank] = cut
            bar.advance(note=file.name)
    _share_windows(ranks, files, finals, cut_lines)
    run = Run(path=root, meta=meta, model=model, ranks=ranks, problems=problems)
    for rank in sorted(set(range(run.world_size)) | set(ranks)):
        run.problems.extend(_rank_problems(run, rank, cut_lines.get(rank, [])))
    skipped = {r: t.skipped_steps for r, t in ranks.items() if t.skipped_steps}
    if skipped:
        run.problems.append(f"ranks {sorted(skipped)}: only the last {steps_limit():,} steps that every rank "
                            f"reached are read ({max(skipped.values()):,} others are not; ${STEPS_ENV} reads more)")
    for rank, what in interrupted_calls(root).items():
        run.problems.append(f"rank {rank} never returned from {what}")
    run.problems.extend(_step_set_problems(run))
    for trace in run.ranks.values():
        trace.compact()  # what the checks above made dicts of, as columns again
    return run


def _load_one(task: tuple[int, Path, bool, int | None]) -> tuple[RankTrace, list[str] | None]:
    """One rank's file read, checked and reduced to columns (``RankTrace.compact``): the unit of a parallel load."""
    rank, file, final, upto = task
    if final:
        return load_rank_file(file, rank, upto=upto).compact(), None
    trace, cut = load_journal(file, rank, upto=upto)
    return trace.compact(), cut


def _share_windows(ranks: dict[int, RankTrace], files: dict[int, Path], finals: dict[int, Path],
                   cut_lines: dict[int, list[str]]) -> None:
    """When a rank's last steps run past the last step of another (a rank that crashed early), read it again up to
    that step, so the ranks' last steps overlap (each rank keeps at most ``steps_limit()`` steps)."""
    ends = [max(t.steps) for t in ranks.values() if t.steps]
    if not ends or not any(t.skipped_steps for t in ranks.values()):
        return
    upto = min(ends)
    for rank, trace in list(ranks.items()):
        if trace.skipped_steps and trace.steps and max(trace.steps) > upto:
            ranks[rank], cut = _load_one((rank, files[rank], rank in finals, upto))
            if cut is not None:
                cut_lines[rank] = cut


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


_BUSY_FILE = re.compile(r"rank-(\d+)\.busy\.txt")
_BUSY_NOTE_BYTES = 4096


def interrupted_calls(root: str | Path) -> dict[int, str]:
    """rank -> what it was doing when it died, from the ``rank-<r>.busy.txt`` notes a recorder leaves while it
    is inside a framework call that may kill the process (``RankTraceWriter.inside``)."""
    out: dict[int, str] = {}
    root = Path(root)
    if not root.is_dir():
        return out
    for entry in sorted(root.iterdir()):
        if (m := _BUSY_FILE.fullmatch(entry.name)) and entry.is_file() and int(m.group(1)) < 1 << 20:
            try:
                with open(entry, "rb") as f:
                    text = f.read(_BUSY_NOTE_BYTES).decode("utf-8", "replace").strip()
            except OSError:
                continue
            out[int(m.group(1))] = text or "a framework call"
    return out


def _rank_files(root: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    finals: dict[int, Path] = {}
    journals: dict[int, Path] = {}
    for entry in root.iterdir():
        if (m := _RANK_FILE.fullmatch(entry.name)) and entry.is_file():
            finals[int(m.group(1))] = entry
        elif (m := _JOURNAL_FILE.fullmatch(entry.name)) and entry.is_file():
            journals[int(m.group(1))] = entry
    return finals, journals


def _rank_problems(run: Run, rank: int, journal_notes: list[str]) -> list[str]:
    """What is wrong with one rank: no trace, beyond the world size, disagreeing on it, unfinished."""
    trace, world_size = run.ranks.get(rank), run.world_size
    if trace is None:
        return [f"rank {rank}: no trace ({rank_file(rank)} missing) — did it crash before recording?"]
    problems = []
    if rank >= world_size:
        problems.append(f"rank {rank}: {trace.path.name} is beyond world size {world_size}")
    if trace.world_size is not None and trace.world_size != world_size:
        problems.append(f"rank {rank}: its trace says world size {trace.world_size}, the run {world_size}")
    if not trace.complete:
        problems.append(_unfinished(trace, run.profiled_steps))
    return problems + [f"rank {rank}: {note}" for note in journal_notes]


def _step_set_problems(run: Run) -> list[str]:
    """Finished ranks that recorded different steps (unfinished ranks are reported on their own)."""
    step_sets = {rank: tuple(sorted(t.steps)) for rank, t in run.ranks.items() if t.complete}
    if len(set(step_sets.values())) <= 1:
        return []
    detail = "; ".join(f"rank {r}: {format_steps(s) or 'none'}" for r, s in sorted(step_sets.items()))
    return [f"ranks recorded different steps ({detail}); analysis uses the steps all ranks share"]


def _unfinished(trace: RankTrace, asked: list[int]) -> str:
    got = f"steps {format_steps(trace.steps)} recorded" if trace.steps else "no step recorded"
    of = f" of {format_steps(asked)}" if asked else ""
    if trace.from_journal:
        return (f"rank {trace.rank} did not finish: {got}{of} (only {journal_file(trace.rank)}; "
                f"{rank_file(trace.rank)} was never written)")
    why = f" — {_one_line(trace.note)}" if trace.note else ""
    return f"rank {trace.rank} did not finish: {got}{of}{why}"


def _one_line(text: str, limit: int = 200) -> str:
    """The first line of ``text``, cut to ``limit`` characters (a note may hold a whole traceback)."""
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= limit and "\n" not in text.strip() else line[:limit].rstrip() + " …"


# ---- small helpers -------------------------------------------------------------------------------


def step_times_ms(trace: RankTrace) -> dict[int, float]:
    """Measured time of each recorded step of one rank, in milliseconds, from its STEP events."""
    return {ev["args"]["step"]: ev["dur"] / 1000.0 for ev in trace.events if ev["cat"] == "STEP"}


def overhead_of(value: Any) -> dict[str, Any] | None:
    """A rank header's ``recording_overhead`` (``dpro.record.protocol.recording_overhead``: what recording cost its
    steps), when it is well formed: a header from elsewhere with anything else in it is not shown."""
    keys = ("wall_pct", "thread_cpu_pct", "unrecorded_steps", "recorded_steps")
    if not isinstance(value, dict) or not all(is_finite_number(value.get(k)) for k in keys):
        return None
    out = {k: value[k] for k in keys}
    if is_finite_number(value.get("wall_spread_pct")):
        out["wall_spread_pct"] = value["wall_spread_pct"]
    if value.get("baseline") in ("gaps", "before"):
        out["baseline"] = value["baseline"]
    return out


@dataclass(frozen=True)
class RecordingCost:
    """What recording cost the recorded steps, as the window's gaps measured it (recorded blocks against the
    unrecorded steps between them, median over ranks): ``pct`` longer, with ``stderr_pct`` its standard error, from
    the unrecorded steps' spread and the steps counted (None where too few were seen)."""

    pct: float
    stderr_pct: float | None
    ranks: int

    @property
    def beyond_noise(self) -> bool:
        """A cost the gaps can tell from chance (over twice its standard error, and over 1%): one the model should
        not replay. A single step's spread is not the bar: a window of many steps measures a median far more
        closely than any one step varies."""
        return self.pct > max(2.0 * (self.stderr_pct or 0.0), 1.0)


def median_difference_stderr_pct(spread_pct: float, unrecorded: int, recorded: int) -> float:
    """The standard error (%) of the difference of two medians of ``unrecorded`` and ``recorded`` steps whose half
    interquartile spread is ``spread_pct``: sigma ~ IQR / 1.349 and a median's error ~ 1.253 sigma / sqrt(n), as for
    a normal spread (steps are skewed, so this is a guide, not a bound)."""
    sigma = 2.0 * spread_pct / 1.349
    return 1.253 * sigma * math.sqrt(1.0 / max(unrecorded, 1) + 1.0 / max(recorded, 1))


def recording_cost(run: Run) -> RecordingCost | None:
    """The ``RecordingCost`` of ``run`` from its ranks' ``recording_overhead`` headers measured against gaps; None
    where no rank measured one (a window without gaps compares with warm-up steps, which says too little)."""
    overheads = [o for t in run.ranks.values()
                 if (o := overhead_of(t.header.get("recording_overhead"))) and o.get("baseline") == "gaps"]
    if not overheads:
        return None
    errors = [median_difference_stderr_pct(o["wall_spread_pct"], int(o["unrecorded_steps"]),
                                           int(o["recorded_steps"])) for o in overheads if "wall_spread_pct" in o]
    return RecordingCost(pct=statistics.median(o["wall_pct"] for o in overheads),
                         stderr_pct=statistics.median(errors) if errors else None, ranks=len(overheads))


def run_step_times_ms(run: Run) -> list[float]:
    """Each recorded step's time in ms as the slowest rank measured it (the step the job waits for), in step order,
    without the window's first step (it opens the window)."""
    slowest: dict[int, float] = {}
    for trace in run.ranks.values():
        for step, ms in step_times_ms(trace).items():
            slowest[step] = max(slowest.get(step, 0.0), ms)
    ordered = sorted(slowest)
    return [slowest[step] for step in ordered[1:]]


def format_steps(steps: Iterable[int]) -> str:
    """Compact step list: ``[3, 4, 5, 6, 7]`` -> ``"3..7"``, ``[3, 4, 9]`` -> ``"3, 4, 9"``."""
    ordered = sorted(set(steps))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}..{ordered[j]}")
        else:
            parts.extend(str(s) for s in ordered[i:j + 1])
        i = j + 1
    return ", ".join(parts)
