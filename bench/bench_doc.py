"""A bench's table as a page under docs/, stamped with the command that wrote it, the date and the commit."""

from __future__ import annotations

import subprocess
import sys
import time
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
