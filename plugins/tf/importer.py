"""``dpro import-xplane DIR``: turn an existing TensorBoard profile into a dpro run directory.

A job profiled by ``tf.profiler.experimental.start(logdir)`` or ``tf.keras.callbacks.TensorBoard(profile_batch=...)``
leaves ``DIR/plugins/profile/<session>/<host>.xplane.pb``, one file per worker that profiled itself. Without the
live model, everything comes from the files:

- **ranks**: every ``*.xplane.pb`` under DIR (DIR may also be a session folder or one file), in sorted path order;
- **steps**: the host plane's per-step trace events. tf_keras's ``fit`` (TF 2.21) wraps each batch in a
  ``train`` trace event with ``epoch_num``/``step_num`` stats, and calls the ``train_function`` tf.function once
  per batch (a ``train_function`` event with a ``tf_function_call`` stat on the Python thread). A step is one
  execution of the training function (Keras 3: ``multi_step_on_iterator``/``one_step_on_data``), numbered by the
  ``train`` event around it; executions outside any such event (the profiler starts and stops inside a batch's
  trace, so the first and last batches of a ``profile_batch`` window have none) are numbered from their neighbours.
  A profile with ``train``-like trace events but no known training function uses the trace events themselves;
- **layers**: from op names (``<model>/<layer>/...`` forward, ``gradient_tape/<model>/<layer>/...`` backward); a
  model is a top-level scope whose layers read variables, a weighted layer is one that reads variables;
- **gradients**: one per weighted layer (``<layer>.weights``), sizes unknown (0 bytes): the profile does not hold
  the variables' shapes, and dpro's XPlane reader finds no byte count on collectives;
- **clock**: XPlane times are wall-clock ns; events are written relative to the earliest profile start, so ranks on
  one host share a clock and other hosts are aligned by their collectives' end times.

The events themselves come from the recorder's own code: ``dpro.plugins.tf.xplane.read_xplane`` (parsing) and
``dpro.plugins.tf.ops.step_rows`` (ops -> FW/BW/UPDATE/IO/COMM events).
"""

from __future__ import annotations

import platform
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpro.engines.tf_mwms import NAME as ENGINE_MWMS
from dpro.errors import TraceError, UsageError
from dpro.plugins.tf.ops import BACKWARD_SCOPE, Layout, Pack, step_rows
from dpro.plugins.tf.xplane import COLLECTIVE_LINE, COMPUTE_LINE, HOST_PLANE, HostOp, Profile, _stats, read_xplane
from dpro.record.trace import QUEUE_ID, event_row, model_fingerprint
from dpro.record.writer import RankTraceWriter, model_document, run_document, write_model_json, write_run_json

__all__ = ["ImportedRank", "StepSpan", "default_output", "import_xplane", "infer_layout", "profile_files",
           "step_spans"]

SUFFIX = ".xplane.pb"
TRAIN_FUNCTIONS = ("train_function", "multi_step_on_iterator", "one_step_on_data")  # tf_keras, Keras 3
EVAL_TRACES = frozenset({"test", "predict", "evaluate"})  # tf_keras's trace events of evaluate/predict
VARIABLE_READ = "ReadVariableOp"
UPDATE_KERNEL = re.compile(r"^(ResourceApply\w+|AssignVariableOp|AssignSubVariableOp)$")
KNOWN_OPTIMIZERS = frozenset({"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Ftrl",
                              "Lion", "Adafactor", "LossScaleOptimizer"})


@dataclass(frozen=True)
class StepSpan:
    """One training step of a profile: ``[start_ns, end_ns)`` on the wall clock; ``source`` names the event."""

    step: int
    start_ns: int
    end_ns: int
    source: str


@dataclass(frozen=True)
class ImportedRank:
    """What one ``.xplane.pb`` file gives: its ops and collectives, its steps and how they were numbered."""

    path: Path
    host: str
    profile: Profile
    steps: list[StepSpan]
    numbering: str
    device: str


# ---- finding the files ------------------------------------------------------------------------------------------

def profile_files(src: str | Path) -> list[Path]:
    """The ``.xplane.pb`` files of ``src`` (a TensorBoard log dir, a session folder, or one file), sorted: the
    sorted order is the rank order, the only order a set of profiles has without the job's ``TF_CONFIG``."""
    src = Path(src)
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise TraceError(src, "no such file or directory")
    files = sorted(p for p in src.rglob(f"*{SUFFIX}") if p.is_file())
    if not files:
        raise TraceError(src, f"no TensorFlow profile here (expected plugins/profile/<session>/<host>{SUFFIX})")
    return files


def default_output(src: str | Path) -> Path:
    """``<DIR>-dpro`` next to the profile (``<host>-dpro`` for one file): never inside the TensorBoard log dir,
    so TensorBoard does not see a foreign folder."""
    src = Path(src).resolve()
    stem = src.name[: -len(SUFFIX)] if src.name.endswith(SUFFIX) else src.name
    return src.parent / f"{stem}-dpro"


# ---- step boundaries --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Marker:
    name: str
    start_ns: int
    end_ns: int
    stats: dict[str, Any]


def _read_space(path: Path) -> Any:
    """The ``XSpace`` of a file that ``read_xplane`` has already accepted (so decoding cannot fail here)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(path.read_bytes())
    return space


def _markers(space: Any, start_wall_ns: int) -> list[_Marker]:
    """Events of the host plane's non-executor lines (the Python thread): training-function calls and trace
    events that carry ``step_num``. Only the few candidates get their stats decoded."""
    host = next((p for p in space.planes if p.name == HOST_PLANE), None)
    if host is None:
        return []
    out: list[_Marker] = []
    for line in host.lines:
        if line.name.startswith((COMPUTE_LINE, COLLECTIVE_LINE, "tf_data")):
            continue
        base_ps = (start_wall_ns + int(line.timestamp_ns)) * 1000
        for event in line.events:
            meta = host.event_metadata.get(event.metadata_id)
            if meta is None or (meta.name not in TRAIN_FUNCTIONS and ":" in meta.name):
                continue
            stats = _stats(host, event)
            if meta.name in TRAIN_FUNCTIONS or isinstance(stats.get("step_num"), int):
                t0 = (base_ps + int(event.offset_ps)) // 1000
                out.append(_Marker(meta.name, t0, t0 + int(event.duration_ps) // 1000, stats))
    return sorted(out, key=lambda m: m.start_ns)


def _outermost(markers: list[_Marker]) -> list[_Marker]:
    """Drop calls nested in another call (Keras 3's ``one_step_on_data`` inside ``multi_step_on_iterator``)."""
    out: list[_Marker] = []
    for m in markers:
        if out and out[-1].start_ns <= m.start_ns and m.end_ns <= out[-1].end_ns:
            continue
        out.append(m)
    return out


def _numbered(labels: list[int | None]) -> tuple[list[int], str]:
    """Fill step numbers missing between known ones (a neighbour's number +- its distance); if the known ones are
    not increasing (several epochs: ``step_num`` restarts) or none is known, number the steps 0, 1, ..."""
    known = [(i, n) for i, n in enumerate(labels) if n is not None]
    if not known:
        return list(range(len(labels))), "no step_num in the profile: steps numbered 0, 1, ... in profile order"
    if any(b[1] - a[1] != b[0] - a[0] for a, b in zip(known, known[1:], strict=False)):
        return list(range(len(labels))), ("step_num is not consecutive (the profile spans epochs or skips "
                                          "batches): steps numbered 0, 1, ... in profile order")
    i0, n0 = known[0]
    out = [n0 + (i - i0) for i in range(len(labels))]
    if out[0] < 0:
        return list(range(len(labels))), "steps numbered 0, 1, ... in profile order"
    filled = len(labels) - len(known)
    why = "step numbers from the 'train' trace events' step_num"
    return out, why + (f" ({filled} step(s) outside such an event numbered from their neighbours)" if filled else "")


def step_spans(space: Any, start_wall_ns: int) -> tuple[list[StepSpan], str]:
    """The training steps of one profile and how they were numbered (see the module docstring)."""
    markers = _markers(space, start_wall_ns)
    traces = [m for m in markers if isinstance(m.stats.get("step_num"), int) and m.name not in EVAL_TRACES
              and m.name not in TRAIN_FUNCTIONS]
    calls = _outermost([m for m in markers if m.name in TRAIN_FUNCTIONS])
    units = calls or traces
    labels: list[int | None] = []
    for unit in units:
        around = next((t for t in traces if t.start_ns <= unit.start_ns and unit.end_ns <= t.end_ns), None)
        labels.append(int(around.stats["step_num"]) if around is not None else None)
    numbers, how = _numbered(labels)
    spans = [StepSpan(n, u.start_ns, u.end_ns, u.name) for n, u in zip(numbers, units, strict=True)]
    return spans, how


# ---- layers from op names ---------------------------------------------------------------------------------------

def _optimizer_scopes(ops: Iterable[HostOp], models: set[str]) -> frozenset[str]:
    """Top-level scopes that update variables (``SGD/AssignVariableOp``, ``Adam/ResourceApplyAdam``) or are named as
    a Keras optimizer: the optimizer's name is not in the profile otherwise. A model's own assignments (batch
    norm's moving averages, ``<model>/bn/AssignNewValue``) do not make it an optimizer."""
    scopes = set()
    for op in ops:
        parts = op.name.split("/")
        if len(parts) >= 2 and parts[0] != BACKWARD_SCOPE and parts[0] not in models and (
                UPDATE_KERNEL.match(op.type) or parts[0] in KNOWN_OPTIMIZERS):
            scopes.add(parts[0])
    return frozenset(scopes)


def _models(ops: Iterable[HostOp]) -> set[str]:
    """Top-level scopes with variable reads three levels down (``<model>/<layer>/<op>/ReadVariableOp``): that tells
    a model from the loss, whose scopes look alike but hold no variables. Scopes that apply gradients
    (``ResourceApply*``) or carry an optimizer's name are optimizers, whatever they read."""
    reads, updates = set(), set()
    for op in ops:
        parts = op.name.split("/")
        if op.type == VARIABLE_READ and len(parts) >= 4 and parts[0] != BACKWARD_SCOPE:
            reads.add(parts[0])
        if op.type.startswith("ResourceApply") or parts[0] in KNOWN_OPTIMIZERS:
            updates.add(parts[0])
    return reads - updates


def infer_layout(ops: list[HostOp], gradient_collectives: int = 0) -> tuple[Layout, list[str], list[str], list[str]]:
    """The ``Layout`` ``step_rows`` needs, guessed from op names; also the model scopes, the layers in forward
    order and the weighted layers.

    A model is a top-level scope whose layers read variables (``_models``); its layers are the scopes right
    under it (a nested model's layers are attributed to the nested model). ``gradient_collectives``
    collectives per step carry the gradients, in reverse layer order, split evenly (their sizes are unknown).
    """
    models = _models(ops)
    optimizer = _optimizer_scopes(ops, models)
    weighted: dict[str, None] = {}
    first_seen: dict[str, int] = {}
    for op in ops:
        parts = op.name.split("/")
        if len(parts) >= 3 and parts[0] in models:
            first_seen.setdefault(parts[1], op.start_ns)
            if op.type == VARIABLE_READ and len(parts) >= 4:
                weighted.setdefault(parts[1], None)
        elif len(parts) >= 4 and parts[0] == BACKWARD_SCOPE and parts[1] in models:
            first_seen.setdefault(parts[2], op.start_ns)
    layers = sorted(first_seen, key=first_seen.__getitem__)
    weighted_layers = [name for name in layers if name in weighted]
    grads_of = {name: (f"{name}.weights",) for name in weighted_layers}
    packs = _even_packs([f"{name}.weights" for name in reversed(weighted_layers)], gradient_collectives)
    layout = Layout(layers=frozenset(layers), grads_of=grads_of, optimizer_scopes=optimizer, packs=tuple(packs))
    return layout, sorted(models), layers, weighted_layers


def _even_packs(grads: list[str], n: int) -> list[Pack]:
    """``n`` packs of consecutive gradients (as even as counts allow), 0 bytes each: sizes are unknown."""
    if n <= 0 or not grads:
        return []
    n = min(n, len(grads))
    bounds = [round(i * len(grads) / n) for i in range(n + 1)]
    return [Pack(tuple(grads[a:b]), 0) for a, b in zip(bounds, bounds[1:], strict=False)]


def _gradient_collectives(ranks: list[ImportedRank]) -> int:
    """Collectives per step that carry gradients: MWMS launches them unscoped (``CollectiveReduceV2``, ``_1``...);
    the reductions of the loss and metrics sit under a scope (``div_no_nan/CollectiveReduceV2``)."""
    counts = []
    for rank in ranks:
        for span in rank.steps:
            counts.append(sum(1 for c in rank.profile.collectives
                              if span.start_ns <= c.launch_ns < span.end_ns and "/" not in c.name))
    return int(statistics.median(counts)) if counts else 0


# ---- reading and writing ----------------------------------------------------------------------------------------

def _device(space: Any) -> str:
    return "gpu" if any(p.name.startswith("/device:GPU") for p in space.planes) else "cpu"


def read_rank(path: Path) -> ImportedRank:
    """Parse one profile and find its steps; ``TraceError`` naming the file when it holds no training step."""
    profile = read_xplane(path)
    space = _read_space(path)
    steps, how = step_spans(space, profile.start_wall_ns)
    if not steps:
        raise TraceError(path, "no training steps found: no 'train_function' call or 'train' trace event with "
                               "step_num on the host plane (was the profiler running during model.fit?)")
    host = path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.stem
    return ImportedRank(path=path, host=host, profile=profile, steps=steps, numbering=how, device=_device(space))


def _rank_rows(rank: ImportedRank, layout: Layout, origin_ns: int) -> dict[int, list[list[Any]]]:
    """Each step's events, µs from ``origin_ns`` (the earliest profile start of the import)."""
    out: dict[int, list[list[Any]]] = {}
    for span in rank.steps:
        ops = [o for o in rank.profile.ops if span.start_ns <= o.start_ns < span.end_ns]
        colls = [c for c in rank.profile.collectives if span.start_ns <= c.launch_ns < span.end_ns]
        rows = step_rows(ops, colls, step=span.step, layout=layout, wall_minus_mono_ns=origin_ns)
        begin_us = (span.start_ns - origin_ns) / 1000.0
        rows.insert(0, event_row("STEP", "STEP", QUEUE_ID["host"], begin_us, (span.end_ns - span.start_ns) / 1000.0,
                                 {"step": span.step, "source": span.source}))
        out[span.step] = rows
    return out


def _claim(out: Path) -> Path:
    """Create ``out``; an existing path is refused, so an import never overwrites or mixes into a run."""
    if out.exists():
        raise UsageError(f"{out} already exists; dpro never overwrites a run directory (give -o NEW_DIR)")
    out.mkdir(parents=True)
    return out


def _notes(ranks: list[ImportedRank], engine: str) -> list[str]:
    notes = [f"imported from TensorFlow profiles by `dpro import-xplane`: rank r is the r-th .xplane.pb file in "
             f"sorted path order ({', '.join(str(r.path) for r in ranks)}); the job's own worker order is unknown",
             "STEP spans one execution of the training function (the Keras loop's callbacks between batches are "
             "not in it); " + ranks[0].numbering,
             "layers inferred from op name scopes; gradients are one per weighted layer, sizes unknown (0 bytes)",
             "clock: XPlane wall-clock ns, written as µs since the earliest profile start; ranks of one host share "
             "it, no ping-pong samples exist"]
    if engine == ENGINE_MWMS:
        notes.append("gradient all-reduces: the unscoped collectives of a step, gradients split evenly among "
                     "them (bytes_per_pack unknown)")
    return notes


def import_xplane(src: str | Path, out: str | Path | None = None) -> Path:
    """Import the TensorFlow profile(s) under ``src`` into a new run directory (default ``default_output``).

    Every file is parsed before anything is written, so bad input leaves no half-made run behind.

    Raises:
        TraceError: no profile under ``src``, a file that is not an XSpace, or one without training steps.
        UsageError: the output directory exists.
    """
    import tensorflow as tf

    ranks = [read_rank(p) for p in profile_files(src)]
    target = Path(out) if out is not None else default_output(src)
    if target.exists():  # refused before the mapping work, and again (race-free) by _claim below
        _claim(target)
    all_ops = [o for r in ranks for o in r.profile.ops]
    layout, models, layers, weighted = infer_layout(all_ops, _gradient_collectives(ranks))
    any_colls = any(r.profile.collectives for r in ranks)
    engine = ENGINE_MWMS if any_colls and len(ranks) > 1 else "tf"
    origin = min(r.profile.start_wall_ns for r in ranks)
    rows = [_rank_rows(r, layout, origin) for r in ranks]
    grads = [{"name": f"{w}.weights", "bytes": 0, "shape": [], "dtype": "unknown", "module": w, "computed_by": w}
             for w in weighted]
    fingerprint = model_fingerprint((g["name"], g["shape"], g["dtype"]) for g in grads)
    target = _claim(target)
    _write_run_json(target, ranks, engine, rows, fingerprint, tf.__version__)
    for rank, by_step in enumerate(rows):
        _write_rank(target, rank, ranks[rank], by_step, len(ranks))
    _write_model_json(target, layout, models, layers, weighted, grads, rows[0], fingerprint)
    return target


def _write_run_json(target: Path, ranks: list[ImportedRank], engine: str, rows: list[dict[int, list[list[Any]]]],
                    fingerprint: str, tf_version: str) -> None:
    steps = sorted({s for by_step in rows for s in by_step})
    knobs = {"world_size": len(ranks), "device": ranks[0].device}
    extra = {"tf": {"imported_from": [str(r.path) for r in ranks], "gradient_sizes": "unknown",
                    "note": "per-op times from TensorFlow's profiler (XPlane), mapped to Keras layers by name scope"},
             "notes": _notes(ranks, engine)}
    doc = run_document(framework="tf", engine=engine, versions={"python": platform.python_version(),
                                                                "tensorflow": tf_version},
                       world_size=len(ranks), hosts=[r.host for r in ranks], steps=steps, knobs=knobs,
                       fingerprint=fingerprint, probe=[], pingpong={}, extra=extra)
    write_run_json(target, doc)


def _write_rank(target: Path, rank: int, imported: ImportedRank, by_step: dict[int, list[list[Any]]],
                world_size: int) -> None:
    header = {"host": imported.host, "pid": None, "source": str(imported.path),
              "clock": {"source": "XPlane wall clock", "unit": "us", "origin": "earliest profile start"}}
    writer = RankTraceWriter(target, rank, world_size, header)
    for step in sorted(by_step):
        writer.end_step(step, by_step[step])
    writer.finish(complete=True, note=f"imported from {imported.path}")


def _write_model_json(target: Path, layout: Layout, models: list[str], layers: list[str], weighted: list[str],
                      grads: list[dict[str, Any]], rows_by_step: dict[int, list[list[Any]]], fingerprint: str) -> None:
    """Gradients in ready order (from the last step's backward), packs as buckets, models and their layers."""
    ready: dict[str, float] = {}
    for row in rows_by_step[max(rows_by_step)]:
        for g, t in zip(row[5].get("grads", []), row[5].get("grads_ready_us", []), strict=False):
            ready[g] = t
    gradients = sorted((dict(g, ready_us=ready.get(g["name"])) for g in grads),
                       key=lambda g: (g["ready_us"] is None, g["ready_us"] or 0.0))
    buckets = [{"index": i, "bytes": p.nbytes, "tensors": list(p.tensors)} for i, p in enumerate(layout.packs)]
    parent = models[0] if len(models) == 1 else None
    modules = [{"name": m, "type": "model", "parent": None, "param_bytes": 0, "activation_bytes": None,
                "recorded": False} for m in models]
    modules += [{"name": layer, "type": "weighted layer" if layer in weighted else "layer", "parent": parent,
                 "param_bytes": 0, "activation_bytes": None, "recorded": True} for layer in layers]
    write_model_json(target, model_document(fingerprint=fingerprint, gradients=gradients, buckets=buckets,
                                            modules=modules))
