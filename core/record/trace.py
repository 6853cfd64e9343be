"""The trace schema, the one contract between plugins and core: docs/architecture.md "The trace: what a plugin records".

Events are Chrome "X" complete events. ``pid`` is the rank; ``tid`` is a small integer naming the
queue the op occupies (``QUEUES``), and every file also carries Chrome ``thread_name`` metadata
events so Perfetto shows the queue names.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ANALYSIS_DIR",
    "CATEGORIES",
    "MODEL_FILE",
    "MODEL_SCHEMA",
    "PROBES_DIR",
    "PROBES_SCHEMA",
    "Probe",
    "QUEUES",
    "QUEUE_ID",
    "ROOT_MODULE",
    "RUN_FILE",
    "RUN_SCHEMA",
    "TRACE_SCHEMA",
    "analysis_file",
    "event_row",
    "write_chunks_atomic",
    "busy_file",
    "journal_file",
    "model_fingerprint",
    "probes_file",
    "queue_metadata",
    "rank_file",
    "row_event",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]


TRACE_SCHEMA = "dpro.trace/1"
RUN_SCHEMA = "dpro.run/1"
MODEL_SCHEMA = "dpro.model/1"

CATEGORIES = ("FW", "BW", "COMM", "UPDATE", "IO", "STEP", "RECOMPUTE")  # RECOMPUTE: checkpointed forward in backward
QUEUES = ("compute", "comm", "host")
QUEUE_ID = {name: i for i, name in enumerate(QUEUES)}

RUN_FILE = "run.json"
MODEL_FILE = "model.json"


ANALYSIS_DIR = "analysis"


def analysis_file(run_dir: str | Path, name: str) -> Path:
    """``RUN/analysis/<name>``, where core writes what it derives from a run (replay.json, config.json); the folder
    is made if needed. Nothing is written outside the run directory: a symlinked ``analysis`` folder, one that
    resolves elsewhere, or a ``<name>`` that is a folder is refused (``-o`` chooses another place).

    Raises:
        UsageError: naming the path and what is wrong with it.
    """
    from dpro.errors import UsageError

    run_dir = Path(run_dir)
    folder = run_dir / ANALYSIS_DIR
    if folder.is_symlink() or (folder.exists() and not folder.resolve().is_relative_to(run_dir.resolve())):
        raise UsageError(f"{folder} is a link to {os.path.realpath(folder)}; dpro writes only inside the run "
                         "directory (remove the link, or give -o to write elsewhere)")
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder} is not a folder; dpro writes its analysis there (move it away, or give -o)")
    folder.mkdir(exist_ok=True)
    path = folder / name
    if path.is_dir() and not path.is_symlink():
        raise UsageError(f"{path} is a folder; dpro writes a file there (move it away, or give -o)")
    return path


def rank_file(rank: int) -> str:
    """Name of the finished trace file of ``rank``."""
    return f"rank-{rank}.json"


PROBES_SCHEMA = "dpro.probes/1"
PROBES_DIR = "probes"
ROOT_MODULE = "<root>"  # the model itself among module paths (op names FW.<root>, the compile knob's whole model)


@dataclass(frozen=True)
class Probe:
    """One probe pass set of one rank (a probe file's entry): ``amp`` (None: the precision recorded) at ``batch``
    rows; each op's median µs over ``passes`` passes, the pass's µs, and the output bytes the model's modules kept
    for the backward.

    A compile probe (``compile``: the module path compiled, ``<root>`` for the whole model) times the region alone,
    forward (``ops["FW"]``) and backward (``ops["BW"]``) compiled (``torch.compile``; a Gluon block's
    ``hybridize(static_alloc=True)``; a Keras model's ``<root>``: ``jit_compile``), and ``eager`` the same ops without
    it, in passes paired with the compiled ones; ``pass_us`` is the compiled pass."""

    amp: str | None
    batch: int
    passes: int
    ops: dict[str, float]
    pass_us: float
    activation_bytes: int
    compile: str | None = None
    eager: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {"amp": self.amp, "batch": self.batch, "passes": self.passes, "pass_us": round(self.pass_us, 3),
               "activation_bytes": self.activation_bytes, "ops": {k: round(v, 3) for k, v in self.ops.items()}}
        if self.compile is not None:
            doc["compile"] = self.compile
            doc["eager"] = {k: round(v, 3) for k, v in (self.eager or {}).items()}
        return doc


def probe_label(amp: str | None, rows: int | None, region: str | None = None) -> str:
    """How a probe is named to people: ``compile <region>``, or its precision and rows."""
    return f"compile {region}" if region is not None else f"{amp or 'recorded precision'} at batch {rows}"


def probes_summary(doc: dict) -> dict:
    """What run.json says of rank 0's probe document (``dpro info`` reads the probe files themselves)."""
    return {"file": probes_file(int(doc.get("rank", 0))), "batch": doc.get("batch"),
            "probes": [probe_label(p.get("amp"), p.get("batch"), p.get("compile")) for p in doc.get("probes", [])],
            "skipped": [f"{s['probe']}: {s['why']}" for s in doc.get("skipped", [])], "in_model": False}


def probes_file(rank: int) -> str:
    """Name (under the run directory) of the probe passes ``rank`` ran after its window: each op's time under
    another precision or a smaller batch, kept apart from the rank's trace so no model of the recorded run sees
    them."""
    return f"{PROBES_DIR}/rank-{rank}.json"


def journal_file(rank: int) -> str:
    """Name of the per-step journal a rank appends to while it records (removed when it finishes)."""
    return f"rank-{rank}.partial.jsonl"


def busy_file(rank: int) -> str:
    """Name of the note a rank leaves while it is inside a framework call that may kill it (e.g. a profiler's
    stop): it says what the rank was doing if it never comes back; removed when the call returns."""
    return f"rank-{rank}.busy.txt"


def queue_metadata(rank: int, host: str) -> list[dict[str, Any]]:
    """Chrome metadata events naming the process (rank) and its queues (threads)."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank} ({host})"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    for name, tid in QUEUE_ID.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
    return events


def event_row(name: str, cat: str, tid: int, ts_us: float, dur_us: float, args: dict[str, Any]) -> list[Any]:
    """The compact journal form of an event: times as integer nanoseconds (cheap to encode)."""
    return [name, cat, tid, round(ts_us * 1000.0), round(max(dur_us, 0.0) * 1000.0), args]


def row_event(row: list[Any], rank: int) -> dict[str, Any]:
    """The Chrome "X" event of a journal row (inverse of ``event_row``)."""
    name, cat, tid, ts_ns, dur_ns, args = row
    return {"name": name, "cat": cat, "ph": "X", "ts": ts_ns / 1000.0, "dur": dur_ns / 1000.0, "pid": rank,
            "tid": tid, "args": args}


def model_fingerprint(tensors: Iterable[tuple[str, Iterable[int], str]]) -> str:
    """A short hash of (name, shape, dtype) of every parameter, in the order given."""
    digest = hashlib.sha256()
    for name, shape, dtype in tensors:
        digest.update(f"{name}:{tuple(int(s) for s in shape)}:{dtype};".encode())
    return digest.hexdigest()[:16]


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` via a temp file and a rename, so readers never see half a file."""
    write_text_atomic(path, json.dumps(obj, separators=(",", ":")))  # dumps runs json's C encoder, dump the Python one


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` via a temp file and a rename, so readers never see half a file."""
    write_chunks_atomic(path, [text])


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file and a rename, so readers never see half a file."""
    write_chunks_atomic(path, [data])
    return Path(path)


def write_chunks_atomic(path: str | Path, chunks: Iterable[str | bytes]) -> None:
    """Write ``chunks`` (text as UTF-8, or bytes) one after another to ``path`` via a temp file and a rename: a file
    too big to hold in memory at once (a thousand ranks' timelines), which readers still never see half written."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a trace is an ordinary file
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk.encode("utf-8") if isinstance(chunk, str) else chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
