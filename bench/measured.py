"""Run a command and measure it on its own: wall and CPU seconds and peak RSS, optionally under an address-space
limit. The command is forked from a small wrapper process, not from the bench: a child's peak RSS starts at its
parent's size when it is forked, so a big bench would otherwise inflate every figure.

    argv = measured_argv(sys.executable, out_file, ["dpro", "analyze", run], limit_bytes=1 << 30)
    subprocess.run(argv); measured = read_measurement(out_file)   # {"wall_s", "cpu_s", "rss_mb", "status"}
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

# argv: OUT LIMIT_BYTES COMMAND...; exits with the command's status (128 + signal when it was killed)
WRAPPER = """
import json, os, resource, sys, time
out, limit, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.execvp(argv[0], argv)
_, status, usage = os.wait4(pid, 0)
code = os.waitstatus_to_exitcode(status)
with open(out, "w") as f:
    json.dump({"wall_s": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime,
               "rss_mb": usage.ru_maxrss / 1024, "status": code}, f)
sys.exit(code if code >= 0 else 128 - code)
"""


def measured_argv(python: str, out: Path, argv: list[str], *, limit_bytes: int = 0) -> list[str]:
    """The command line that runs ``argv`` measured, writing the figures to ``out`` (no limit when 0)."""
    return [python, "-c", WRAPPER, str(out), str(limit_bytes), *argv]


def read_measurement(out: Path) -> dict[str, Any] | None:
    """What the wrapper wrote, or None when it wrote nothing (killed before the command ended)."""
    return json.loads(out.read_text()) if out.is_file() else None


def median_range(rows: list[dict[str, Any]], key: str, fmt: str) -> str:
    """``median [min..max]`` of ``row[key]`` over repeated measurements, each formatted with ``fmt``."""
    values = [r[key] for r in rows]
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}..{max(values):{fmt}}]"
