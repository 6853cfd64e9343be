"""Bounds on what a reader accepts, so hostile or broken input ends in a clear error instead of a traceback or a
machine out of memory. Each limit is documented and overridable through the environment.

- ``json_depth_limit()``: how deeply a JSON document may nest (``$DPRO_MAX_JSON_DEPTH``, default 64; dpro's own
  files nest at most 6 deep, a Kineto trace's ``args`` a few more).
- ``world_size_limit()``: the most ranks a run may say it has (``$DPRO_MAX_WORLD_SIZE``, default 65,536): readers
  walk every rank, so a run.json claiming 10^12 would otherwise run for hours.
- ``file_size_limit()``: the most bytes a reader takes from one file, after gunzip (``$DPRO_MAX_FILE_MB``, default
  256 MB): a path to /dev/zero or a gzip bomb stops there instead of filling the machine's memory.
- ``json_values_limit()``: the most values one JSON document may hold (``$DPRO_MAX_JSON_VALUES``, default 16
  million; a 200 MB rank file holds about 10 million), counted before parsing: ``[0,0,0,...]`` within the size
  limit would otherwise become gigabytes of Python objects.

``read_bounded(path, error)`` reads a file under the size limit (gunzipping it when it is gzip), ``read_file`` the
same with a file that cannot be read said by ``error`` too; ``parse_bounded_json`` parses under the depth and value
limits, with orjson where it is installed (several times faster on big traces) and the standard library otherwise;
``is_finite_number`` is the check every reader makes of a JSON number.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:  # a maintained, fast parser where installed; the standard library's otherwise
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

__all__ = ["DEFAULT_FILE_MB", "DEFAULT_JSON_DEPTH", "DEFAULT_JSON_VALUES", "DEFAULT_STEPS", "DEFAULT_STREAM_MB",
           "DEFAULT_WORLD_SIZE", "FILE_SIZE_ENV", "JSON_DEPTH_ENV", "JSON_VALUES_ENV", "STEPS_ENV", "STREAM_ENV",
           "WORLD_SIZE_ENV", "file_size_limit", "is_finite_number", "json_depth", "json_depth_limit",
           "json_values_limit", "parse_bounded_json", "read_bounded", "read_file", "steps_limit", "stream_bytes",
           "world_size_limit"]

JSON_DEPTH_ENV = "DPRO_MAX_JSON_DEPTH"
DEFAULT_JSON_DEPTH = 64
WORLD_SIZE_ENV = "DPRO_MAX_WORLD_SIZE"
DEFAULT_WORLD_SIZE = 65_536
FILE_SIZE_ENV = "DPRO_MAX_FILE_MB"
DEFAULT_FILE_MB = 256
JSON_VALUES_ENV = "DPRO_MAX_JSON_VALUES"
DEFAULT_JSON_VALUES = 16_000_000
STEPS_ENV = "DPRO_MAX_STEPS"
DEFAULT_STEPS = 1000
STREAM_ENV = "DPRO_STREAM_MB"
DEFAULT_STREAM_MB = 64
GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 22


def _limit(variable: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(variable, default)))
    except ValueError:
        return default


def world_size_limit() -> int:
    """The most ranks a run may have (``$DPRO_MAX_WORLD_SIZE``, else ``DEFAULT_WORLD_SIZE``)."""
    return _limit(WORLD_SIZE_ENV, DEFAULT_WORLD_SIZE)


def json_depth_limit() -> int:
    """The deepest nesting a reader accepts (``$DPRO_MAX_JSON_DEPTH``, else ``DEFAULT_JSON_DEPTH``)."""
    return _limit(JSON_DEPTH_ENV, DEFAULT_JSON_DEPTH)


def file_size_limit() -> int:
    """The most bytes read from one file, after gunzip (``$DPRO_MAX_FILE_MB`` MB, else ``DEFAULT_FILE_MB``)."""
    return _limit(FILE_SIZE_ENV, DEFAULT_FILE_MB) * 1_000_000


def json_values_limit() -> int:
    """The most values one JSON document may hold (``$DPRO_MAX_JSON_VALUES``, else ``DEFAULT_JSON_VALUES``)."""
    return _limit(JSON_VALUES_ENV, DEFAULT_JSON_VALUES)


def steps_limit() -> int:
    """The most steps read per rank, the last ones (``$DPRO_MAX_STEPS``, else ``DEFAULT_STEPS``): a median step
    of a thousand steps is as good as one of twenty thousand, and reading them all costs seconds and gigabytes."""
    return _limit(STEPS_ENV, DEFAULT_STEPS)


def stream_bytes() -> int:
    """Rank files at least this big (``$DPRO_STREAM_MB`` MB, else ``DEFAULT_STREAM_MB``) are read from their end,
    piece by piece, as far back as the last ``steps_limit()`` steps reach, instead of parsed whole."""
    return _limit(STREAM_ENV, DEFAULT_STREAM_MB) * 1_000_000


def is_finite_number(value: object) -> bool:
    """A JSON number that is a real, finite number (not a bool, NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_file(path: str | Path, error: Callable[[str | Path, str], Exception]) -> bytes:
    """``read_bounded``, with a file that cannot be opened or read refused by ``error`` too ("cannot be read: ...")."""
    try:
        return read_bounded(path, error)
    except OSError as err:
        raise error(path, f"cannot be read: {err.strerror or err}") from err


def read_bounded(path: str | Path, error: Callable[[str | Path, str], Exception]) -> bytes:
    """The bytes of ``path``, gunzipped when they are gzip, refused with ``error(path, problem)`` past
    ``file_size_limit()`` (read in chunks, so an endless device or a gzip bomb stops at the limit).

    Raises:
        OSError: the file cannot be opened or read (the caller words it).
    """
    limit = file_size_limit()
    with open(path, "rb") as f:
        head = f.read(_CHUNK)
        if head[:2] == GZIP_MAGIC:
            return _gunzip_bounded(path, head, f, limit, error)
        parts = [head]
        size = len(head)
        while size <= limit and (chunk := f.read(_CHUNK)):
            parts.append(chunk)
            size += len(chunk)
    if size > limit:
        raise error(path, f"larger than {limit // 1_000_000} MB, the most dpro reads from one file "
                          f"(${FILE_SIZE_ENV} raises the limit)")
    return b"".join(parts)


def _gunzip_bounded(path: str | Path, head: bytes, f: Any, limit: int,
                    error: Callable[[str | Path, str], Exception]) -> bytes:
    parts: list[bytes] = []
    size = 0
    inflate = zlib.decompressobj(wbits=31)
    pending = head
    while True:
        try:
            out = inflate.decompress(pending, limit + 1 - size)
        except zlib.error as err:
            raise error(path, f"corrupt gzip: {err}") from None
        parts.append(out)
        size += len(out)
        if size > limit:
            raise error(path, f"decompresses to more than {limit // 1_000_000} MB, the most dpro reads from one "
                              f"file (${FILE_SIZE_ENV} raises the limit)")
        if inflate.eof:  # a member ended; gzip files may hold several
            rest = inflate.unused_data
            if not rest:
                rest = f.read(_CHUNK)
                if not rest:
                    return b"".join(parts)
            inflate = zlib.decompressobj(wbits=31)
            pending = rest
            continue
        pending = inflate.unconsumed_tail or f.read(_CHUNK)
        if not pending:
            raise error(path, "truncated gzip: the file ends before the compressed stream does "
                              "(copied while still being written?)")


def json_depth(doc: Any, stop_at: int) -> int:
    """How deeply ``doc`` nests (a scalar: 0), counted level by level without recursion; stops counting past
    ``stop_at``. (A level at a time keeps the loop tight: a 200 MB trace is walked in about a second.)"""
    level = [doc] if type(doc) in (dict, list) else []
    depth = 0
    while level:
        depth += 1
        if depth > stop_at:
            return depth
        below: list[Any] = []
        keep = below.append
        for value in level:
            for child in value.values() if type(value) is dict else value:
                if type(child) is dict or type(child) is list:  # what json.loads makes: no subclasses
                    keep(child)
        level = below
    return depth


def parse_bounded_json(text: str | bytes, source: str | Path, error: Callable[[str | Path, str], Exception],
                       **loads: Any) -> Any:
    """``json.loads(text, **loads)`` that refuses, with ``error(source, problem)`` (a ``TraceError`` or
    ``ConfigError``), a document holding more than ``json_values_limit()`` values (counted by its commas, before
    parsing) or nested deeper than ``json_depth_limit()``. orjson parses when installed and no ``loads`` options
    are given; what it refuses (NaN, which Python's json writes) goes to the standard library, whose
    ``json.JSONDecodeError`` is the caller's."""
    limit = json_depth_limit()
    separators = text.count(b"," if isinstance(text, bytes) else ",")
    if separators >= json_values_limit():
        raise error(source, f"JSON of more than {json_values_limit():,} values (${JSON_VALUES_ENV} raises the limit)")
    doc = _NOT_PARSED
    if _orjson is not None and not loads:
        try:
            doc = _orjson.loads(text)
        except _orjson.JSONDecodeError:
            pass  # NaN/Infinity, or broken JSON: the standard library decides, with its messages
    if doc is _NOT_PARSED:
        try:
            doc = json.loads(text, **loads)
        except RecursionError:
            raise error(source, f"JSON nested deeper than Python's parser goes (dpro reads at most {limit} levels; "
                                f"${JSON_DEPTH_ENV} raises the limit)") from None
        except ValueError as err:
            if isinstance(err, json.JSONDecodeError) or "integer string conversion" not in str(err):
                raise
            # Python refuses integers of more than 4300 digits (sys.set_int_max_str_digits)
            raise error(source, f"a number too long to read ({str(err).split(':')[0]})") from None
    if json_depth(doc, limit) > limit:
        raise error(source, f"JSON nested more than {limit} levels deep (${JSON_DEPTH_ENV} raises the limit)")
    return doc


_NOT_PARSED = object()
