"""A bench's table as a page under docs/, stamped with the command that wrote it, the date and the commit."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_bench_doc(path: str | Path, title: str, lines: list[str], note: str = "2 cores") -> Path:
    """``lines`` (the table as printed) in a code block under ``title``, after a line naming the command
    (``sys.argv``), the date, the commit and ``note``."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    command = " ".join([f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {title}\n\nWritten by `python {command}` on {time.strftime('%Y-%m-%d')} at commit "
                   f"{commit or '?'} ({note}).\n\n```\n" + "\n".join(lines) + "\n```\n", encoding="utf-8")
    return out


class _Tee(io.TextIOBase):
    """Writes through to ``out`` and keeps a copy."""

    def __init__(self, out: io.TextIOBase) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def printed_lines() -> Iterator[list[str]]:
    """The lines a bench prints inside the block (still printed), for ``write_bench_doc`` afterwards."""
    lines: list[str] = []
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield lines
    lines.extend(tee.kept.getvalue().rstrip("\n").split("\n"))
