"""Progress of long work on stderr: a bar on a terminal, a few quiet lines otherwise, nothing when quiet.

``Progress(total, label)`` is advanced once per unit of work (``advance``) and closed at the end (a context
manager closes it). On a TTY it redraws one line (``[#####-----] 12/30 label: note``); on anything else it
writes one line when the work starts and one when it ends, so logs and CI output stay short. ``total=None``
counts without a bar (work whose size is not known ahead, such as an engine's search). ``progress(iterable)``
wraps an iterable::

    for item in progress(items, label="replaying what-ifs", quiet=args.quiet):
        ...

No dependency, no threads: the line is redrawn only when ``advance`` is called (at most every ``interval``
seconds, and always on the last unit). Unless told, a progress is quiet when dpro's log level hides INFO (a
command's ``-q``), so one switch silences diagnostics and progress alike.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

__all__ = ["Progress", "progress"]

T = TypeVar("T")
BAR_WIDTH = 24


class Progress:
    """Progress of ``total`` units of work (None: unknown), shown on ``stream`` (default stderr).

    Args:
        total: units of work expected; None counts without a bar.
        label: what the work is, e.g. ``"optimize"``.
        stream: where to write (default ``sys.stderr``, looked up when the progress starts).
        quiet: write nothing at all; None (default): quiet when the ``dpro`` logger hides INFO (``-q``).
        interval: least seconds between two redraws on a terminal.
        lines: one line per ``advance`` with a note, on a terminal and off it (a few stages of work whose own
            output comes between them, such as the jobs ``dpro-launch --auto`` runs).
    """

    def __init__(self, total: int | None = None, label: str = "", *, stream: IO[str] | None = None,
                 quiet: bool | None = None, interval: float = 0.1, lines: bool = False) -> None:
        self.total = total if total is None else max(0, int(total))
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.quiet = not logging.getLogger("dpro").isEnabledFor(logging.INFO) if quiet is None else quiet
        self.interval = interval
        self.lines = lines
        self.done = 0
        self.started = time.perf_counter()
        self._drawn = 0.0
        self._closed = False
        self._tty = _is_tty(self.stream)
        if not self.quiet and not self._tty and not lines:
            self._write(f"{self._prefix()}started" + (f" ({self.total} in all)" if self.total else "") + "\n")

    def _prefix(self) -> str:
        return f"[dpro] {self.label}: " if self.label else "[dpro] "

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: progress is never worth failing for
            self.quiet = True

    def advance(self, n: int = 1, note: str = "") -> None:
        """``n`` more units done; ``note`` says what is being done now (shown on a terminal)."""
        self.done += n
        if self.quiet or self._closed:
            return
        if not self._tty:
            if self.lines and note:  # a few stages: each one's line is worth a log line too
                count = f"{self.done + 1}/{self.total}" if self.total else f"{self.done + 1}"
                self._write(f"{self._prefix()}[{count}] {note}\n")
            return
        now = time.perf_counter()
        last = self.total is not None and self.done >= self.total
        if not self.lines and not last and now - self._drawn < self.interval:
            return
        self._drawn = now
        end = "\n" if self.lines else ""
        self._write(f"\r\x1b[K{self.line(note)}{end}")

    def line(self, note: str = "") -> str:
        """The terminal line for the work so far (a bar when the total is known)."""
        elapsed = time.perf_counter() - self.started
        label = f"{self.label}: " if self.label else ""
        if self.total:
            filled = min(BAR_WIDTH, BAR_WIDTH * self.done // self.total)
            head = f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {min(self.done, self.total)}/{self.total}"
        else:
            head = f"[{self.done}]"
        return f"{head} {label}{note}".rstrip() + f" ({elapsed:.1f} s)"

    def close(self, note: str = "") -> None:
        """The work is over: end the terminal line, or write the closing line."""
        if self._closed:
            return
        self._closed = True
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.started
        if self._tty:
            self._write("\n" if self._drawn and not self.lines else "")
            return
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        self._write(f"{self._prefix()}done, {count} in {elapsed:.1f} s" + (f" ({note})" if note else "") + "\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(iterable: Iterable[T], *, total: int | None = None, label: str = "", stream: IO[str] | None = None,
             quiet: bool | None = None) -> Iterator[T]:
    """Yield from ``iterable``, advancing a ``Progress`` once per item (``total`` defaults to ``len()`` when the
    iterable has one)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with Progress(total, label, stream=stream, quiet=quiet) as bar:
        for item in iterable:
            yield item
            bar.advance()


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
