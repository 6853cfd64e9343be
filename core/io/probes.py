"""Reading the probe passes a recorder ran after its window (``RUN/probes/rank-<r>.json``, schema
``dpro.probes/1``): each op's time with the captured batch under another precision or cut to fewer rows, and
regions of the model timed with and without ``torch.compile`` (the torch recorder), imperative and hybridized
with ``static_alloc`` (the MXNet recorder, whose probe file holds compile probes only), or a Keras model's ``<root>``
with and without ``jit_compile`` (the TensorFlow recorder's only probe).

They are never part of the recorded steps (``load_run`` does not read them); ``dpro.sim.probes`` prices the ``amp``,
``micro_batches`` and ``compile`` knobs from them, and ``dpro info`` lists them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpro.errors import TraceError
from dpro.io.limits import is_finite_number, parse_bounded_json, read_file, world_size_limit
from dpro.record.trace import PROBES_DIR, PROBES_SCHEMA, Probe

__all__ = ["Probe", "RankProbes", "read_probes"]

_PROBE_FILE = re.compile(r"rank-(\d+)\.json")
AMPS = (None, "bf16", "fp16")


@dataclass
class RankProbes:
    """A rank's probes: ``batch`` is the batch the window recorded (dim 0 of the model's first input)."""

    rank: int
    batch: int | None
    probes: list[Probe] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)

    def find(self, amp: str | None, batch: int) -> Probe | None:
        """The probe of the whole model under ``amp`` at ``batch`` rows (compile probes are not among them)."""
        return next((p for p in self.probes if p.amp == amp and p.batch == batch and p.compile is None), None)

    def compiled(self, region: str) -> Probe | None:
        """The compile probe of ``region`` (a module path, ``<root>`` for the whole model), or None."""
        return next((p for p in self.probes if p.compile == region), None)

    @property
    def compiled_regions(self) -> list[str]:
        """The regions a compile probe timed."""
        return [p.compile for p in self.probes if p.compile is not None]


def _number(value: Any, path: Path, where: str) -> float:
    if not is_finite_number(value) or value < 0:
        raise TraceError(path, f"must be a number >= 0, found {value!r:.40}", where)
    return float(value)


def _count(value: Any, path: Path, where: str, *, positive: bool = True) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < (1 if positive else 0) or value > 2**62:
        raise TraceError(path, f"must be a {'positive ' if positive else ''}whole number, found {value!r:.40}",
                         where)
    return value


def _probe(raw: Any, path: Path, where: str) -> Probe:
    if not isinstance(raw, dict):
        raise TraceError(path, "a probe must be an object", where)
    if raw.get("amp") not in AMPS:
        raise TraceError(path, f"amp must be null, \"bf16\" or \"fp16\", found {raw.get('amp')!r:.40}", where)
    ops = raw.get("ops")
    if not isinstance(ops, dict) or not all(isinstance(k, str) for k in ops):
        raise TraceError(path, "ops must be an object of op name -> µs", f"{where}.ops")
    region, eager = _compiled(raw, path, where)
    return Probe(amp=raw["amp"], batch=_count(raw.get("batch"), path, f"{where}.batch"),
                 passes=_count(raw.get("passes"), path, f"{where}.passes"),
                 ops={k: _number(v, path, f"{where}.ops[{k!r}]") for k, v in ops.items()},
                 pass_us=_number(raw.get("pass_us"), path, f"{where}.pass_us"),
                 activation_bytes=_count(raw.get("activation_bytes"), path, f"{where}.activation_bytes",
                                         positive=False), compile=region, eager=eager)


def _compiled(raw: dict[str, Any], path: Path, where: str) -> tuple[str | None, dict[str, float] | None]:
    """A compile probe's region and its eager times (None, None for any other probe)."""
    region = raw.get("compile")
    if region is None:
        return None, None
    if not isinstance(region, str) or not region:
        raise TraceError(path, f"compile must be a module path, found {region!r:.40}", f"{where}.compile")
    if raw.get("amp") is not None:
        raise TraceError(path, "a compile probe runs in the recorded precision (amp null)", f"{where}.amp")
    eager = raw.get("eager")
    if not isinstance(eager, dict) or not all(isinstance(k, str) for k in eager):
        raise TraceError(path, "eager must be an object of op name -> µs", f"{where}.eager")
    return region, {k: _number(v, path, f"{where}.eager[{k!r}]") for k, v in eager.items()}


def _read_one(path: Path, rank: int) -> RankProbes:
    text = read_file(path, TraceError)
    try:
        doc = parse_bounded_json(text, path, TraceError)
    except ValueError as err:
        raise TraceError(path, f"not valid JSON: {err}") from err
    if not isinstance(doc, dict) or doc.get("schema") != PROBES_SCHEMA:
        raise TraceError(path, f"not a probe file (schema {PROBES_SCHEMA} expected)", "schema")
    if doc.get("rank") != rank:
        raise TraceError(path, f"says rank {doc.get('rank')!r:.20}, its name rank {rank}", "rank")
    batch = doc.get("batch")
    raw_probes, skipped = doc.get("probes", []), doc.get("skipped", [])
    if not isinstance(raw_probes, list) or not isinstance(skipped, list):
        raise TraceError(path, "probes and skipped must be lists")
    return RankProbes(rank=rank, batch=None if batch is None else _count(batch, path, "batch"),
                      probes=[_probe(p, path, f"probes[{i}]") for i, p in enumerate(raw_probes)],
                      skipped=[{"probe": str(s.get("probe", "")), "why": str(s.get("why", ""))}
                               for s in skipped if isinstance(s, dict)])


def read_probes(run_path: str | Path) -> dict[int, RankProbes]:
    """Every rank's probes in ``run_path/probes/`` (empty when the recorder ran none).

    Raises:
        TraceError: naming the file and key of a probe file that is not what the recorder writes.
    """
    folder = Path(run_path) / PROBES_DIR
    if not folder.is_dir() or folder.is_symlink():
        return {}
    out: dict[int, RankProbes] = {}
    for entry in sorted(folder.iterdir()):
        m = _PROBE_FILE.fullmatch(entry.name)
        if m and entry.is_file() and int(m.group(1)) < world_size_limit():
            out[int(m.group(1))] = _read_one(entry, int(m.group(1)))
    return out
