"""Turn one step's TensorFlow ops (from ``dpro.plugins.tf.xplane``) into dpro trace events.

Pure functions over plain data: ``Layout`` says what the model is made of (its layers, its optimizer's name
scope, how the strategy packs the gradients), ``step_rows`` maps the ops of one step to events:

- an op whose name holds a layer's name scope is that layer's: ``FW.<layer path>``, or ``BW.<layer path>`` when
  it sits under ``gradient_tape/`` (Keras's backward), or ``RECOMPUTE.<layer path>`` when it is a forward op
  outside the model's name scope (a checkpointed block runs its forward again inside the backward). The innermost
  layer named wins, so a nested model's layers are attributed to themselves. All ops of one name in a step form
  one event (``args.ops`` counts them, ``args.kinds`` names their kernels), laid out by ``_laid_out``:
  TensorFlow's executor orders and interleaves a step's ops differently from step to step, and the core needs
  the same events in every step;
- ops under the optimizer's name scope (``SGD/...``, ``Adam/...``) are ``UPDATE.optimizer``;
- ops of no layer: before the first forward op of a layer ``IO.input`` (casts and slices of the batch), then
  ``FW.loss`` until the backward starts, under ``gradient_tape/`` ``BW.loss``; after the backward, the
  packing of the gradients just before a gradient collective (``concat``, ``Reshape``) belongs to that
  collective (its event starts there); anything else is ``UPDATE.step`` (unpacking, metrics); update ops that
  run before the first gradient collective (the optimizer's iteration counter, metrics) are
  ``UPDATE.<what>.early``; the input pipeline's iterator ops are ``IO.input`` wherever they run;
- variable reads and other bookkeeping kernels (``ReadVariableOp``, ``Identity``, ``NoOp``, ``Const``) are left
  out: their time is part of the gaps;
- the first ``len(layout.packs)`` collectives of the step are the gradient all-reduces, one per pack
  (``COMM.pack<k>.allreduce`` with ``bytes`` and ``tensors``); later ones reduce the step's outputs (loss,
  metrics: ``COMM.<op>.allreduce`` with the 4 bytes of a scalar).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dpro.plugins.tf.xplane import AsyncOp, Collective, HostOp
from dpro.record.trace import QUEUE_ID, event_row

__all__ = ["IGNORED_KERNELS", "Layout", "Pack", "classify", "horovod_rows", "pack_gradients", "step_rows"]

IGNORED_KERNELS = frozenset({"ReadVariableOp", "Identity", "NoOp", "Const", "_Arg", "_Retval"})
COMPUTE, COMM, HOST = QUEUE_ID["compute"], QUEUE_ID["comm"], QUEUE_ID["host"]
BACKWARD_SCOPE = "gradient_tape"
OUTPUT_BYTES = 4  # a step output (loss, a metric's total or count) is one float32 scalar
_SUFFIX = re.compile(r"_\d+$")


@dataclass(frozen=True)
class Pack:
    """One gradient all-reduce: the gradients it carries (names), their bytes."""

    tensors: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """What ``step_rows`` needs to know about the model.

    Attributes:
        layers: every layer's name (``layer.name``), nested layers included.
        grads_of: layer path -> the names of its trainable variables' gradients.
        optimizer_scopes: name scopes of the optimizer's ops (e.g. ``{"SGD"}``).
        packs: the gradient all-reduces in launch order (``pack_gradients``).
        paths: layer name -> its dotted path in the model (``block1.conv_a``), which names its events; a name
            missing here is its own path.
        gradients: (name, bytes) of every gradient in ``model.trainable_variables`` order.
        root: the model's name. The forward's ops run under its name scope; a layer's forward op outside it
            runs again inside the backward (``tf.recompute_grad``, ``keras.remat``): ``RECOMPUTE.<path>``.
    """

    layers: frozenset[str]
    grads_of: dict[str, tuple[str, ...]] = field(default_factory=dict)
    optimizer_scopes: frozenset[str] = frozenset()
    packs: tuple[Pack, ...] = ()
    paths: dict[str, str] = field(default_factory=dict)
    root: str | None = None
    gradients: tuple[tuple[str, int], ...] = ()


def pack_gradients(grads: list[tuple[str, int]], bytes_per_pack: int) -> list[Pack]:
    """How MultiWorkerMirroredStrategy packs gradients into all-reduces (TF 2.21,
    ``CollectiveAllReduce._batch_all_reduce`` then ``cross_device_utils.group_by_size``): the gradients in
    reverse order (last layer first), a new pack started once the current one holds more than
    ``bytes_per_pack`` bytes; ``bytes_per_pack`` 0 puts every gradient in one pack."""
    ordered = list(reversed(grads))
    if not ordered:
        return []
    if bytes_per_pack <= 0:
        return [Pack(tuple(n for n, _ in ordered), sum(b for _, b in ordered))]
    packs: list[list[tuple[str, int]]] = []
    size = 0
    for name, nbytes in ordered:
        if not packs or size > bytes_per_pack:
            packs.append([])
            size = 0
        packs[-1].append((name, nbytes))
        size += nbytes
    return [Pack(tuple(n for n, _ in p), sum(b for _, b in p)) for p in packs]


def _layer_of(scopes: list[str], layers: frozenset[str]) -> str | None:
    """The innermost layer named by ``scopes``; a scope may carry the ``_<n>`` suffix TensorFlow adds to a
    name scope used twice."""
    found = None
    for scope in scopes:
        if scope in layers:
            found = scope
        elif _SUFFIX.sub("", scope) in layers and scope not in layers:
            found = _SUFFIX.sub("", scope)
    return found


def classify(op: HostOp, layout: Layout) -> tuple[str, str] | None:
    """(category, name) of an op by its name scopes alone; None for ops of no layer (placed by ``step_rows``)."""
    scopes = op.name.split("/")
    backward = BACKWARD_SCOPE in scopes
    layer = _layer_of(scopes[:-1], layout.layers)
    if layer is not None:
        path = layout.paths.get(layer, layer)
        if backward:
            return "BW", f"BW.{path}"
        if layout.root is not None and _layer_of(scopes[:-1], frozenset({layout.root})) is None:
            return "RECOMPUTE", f"RECOMPUTE.{path}"
        return "FW", f"FW.{path}"
    if scopes[0] in layout.optimizer_scopes:
        return "UPDATE", "UPDATE.optimizer"
    if backward:
        return "BW", "BW.loss"
    return None


def _us(ns: float, wall_minus_mono_ns: float) -> float:
    return (ns - wall_minus_mono_ns) / 1000.0


def _is_input_op(op: HostOp) -> bool:
    """The input pipeline's ops (``IteratorGetNext``, ``MultiDeviceIteratorFromStringHandle``, ...): they run on
    any executor thread at any time in the step, so their kernel names them, not their position."""
    return "Iterator" in op.type


def step_rows(ops: Iterable[HostOp], collectives: Iterable[Collective], *, step: int, layout: Layout,
              wall_minus_mono_ns: float, first_gradient_launch_ns: int | None = None) -> list[list[Any]]:
    """The events of one step (``event_row`` rows, µs on the rank's monotonic clock) from the ops and collectives
    that ran in it (wall-clock ns; ``wall_minus_mono_ns`` converts). ``first_gradient_launch_ns``: when the
    step's first gradient allreduce was launched, when it is not one of ``collectives`` (Horovod's): update ops
    before it are ``.early``."""
    ops = sorted((o for o in ops if o.type not in IGNORED_KERNELS), key=lambda o: o.start_ns)
    colls = sorted(collectives, key=lambda c: c.launch_ns)
    grad_colls = colls[:len(layout.packs)]
    kinds = [classify(o, layout) for o in ops]
    first_fw = next((o.start_ns for o, k in zip(ops, kinds, strict=True) if k and k[0] == "FW"), None)
    last_fw = max((o.start_ns for o, k in zip(ops, kinds, strict=True) if k and k[0] == "FW"), default=None)
    # the backward begins with the first gradient op after the forward's last op: gradient_tape's shape ops run
    # early, interleaved with the forward, and do not end it
    first_bw = next((o.start_ns for o, k in zip(ops, kinds, strict=True)
                     if k and k[0] == "BW" and (last_fw is None or o.start_ns >= last_fw)), None)
    first_comm = grad_colls[0].launch_ns if grad_colls else first_gradient_launch_ns
    launches = [c.launch_ns for c in grad_colls]
    comm_start = {i: c.launch_ns for i, c in enumerate(grad_colls)}

    def update_name(name: str, op: HostOp) -> str:
        return f"{name}.early" if first_comm is not None and op.start_ns < first_comm else name

    named: list[tuple[HostOp, str, str]] = []
    pending_pack: list[HostOp] = []
    next_coll = 0
    for op, kind in zip(ops, kinds, strict=True):
        while next_coll < len(launches) and op.start_ns >= launches[next_coll]:
            if pending_pack:
                comm_start[next_coll] = min(comm_start[next_coll], pending_pack[0].start_ns)
                pending_pack.clear()
            next_coll += 1
        if kind is None and _is_input_op(op):
            kind = ("IO", "IO.input")
        if kind is not None and kind[0] != "IO":
            named.extend((p, "UPDATE", update_name("UPDATE.step", p)) for p in pending_pack)
            pending_pack.clear()
        if kind is not None and kind[0] != "UPDATE":
            named.append((op, *kind))
        elif kind is None and (first_fw is None or op.start_ns < first_fw):
            named.append((op, "IO", "IO.input"))
        elif kind is None and (first_bw is None or op.start_ns < first_bw):
            named.append((op, "FW", "FW.loss"))
        elif kind is None and next_coll < len(launches):
            pending_pack.append(op)  # packing for the next gradient collective, or (if a layer op follows) not
        else:
            named.append((op, "UPDATE", update_name(kind[1] if kind is not None else "UPDATE.step", op)))
    named.extend((p, "UPDATE", update_name("UPDATE.step", p)) for p in pending_pack)
    rows = _laid_out(named, step, wall_minus_mono_ns)
    for i, coll in enumerate(colls):
        args: dict[str, Any] = {"step": step, "op": "allreduce", "phase": "allreduce", "tf_op": coll.name}
        if i < len(grad_colls):
            pack = layout.packs[i]
            name, start = f"COMM.pack{i}.allreduce", comm_start[i]
            args.update(bytes=pack.nbytes, tensors=list(pack.tensors), pack=i)
        else:
            name, start = f"COMM.{coll.name.replace('/', '_')}.allreduce", coll.launch_ns
            args.update(bytes=OUTPUT_BYTES, tensors=[], note="a reduction of the step's outputs (loss, metrics)")
        if coll.transfer_start_ns is not None and coll.transfer_end_ns is not None:
            args["transfer_us"] = (coll.transfer_end_ns - coll.transfer_start_ns) / 1000.0
        if coll.instance_key is not None:
            args["instance_key"] = coll.instance_key
        ts = _us(start, wall_minus_mono_ns)
        rows.append(event_row(name, "COMM", COMM, ts, _us(coll.done_ns, wall_minus_mono_ns) - ts, args))
    _attach_grads(rows, layout)
    rows.sort(key=lambda r: r[3])
    return rows


def _busy_shares(ops: list[HostOp]) -> tuple[list[float], list[tuple[int, int]]]:
    """Each op's share of the wall time (ns): an interval in which k ops run on the executor's threads counts
    1/k for each, so the shares add up to the time some op ran. Also the idle intervals (no op running) between
    the first op's start and the last op's end, as (start, end)."""
    points = sorted([(o.start_ns + o.dur_ns, 0, i) for i, o in enumerate(ops)] +
                    [(o.start_ns, 1, i) for i, o in enumerate(ops)])
    share = [0.0] * len(ops)
    idle: list[tuple[int, int]] = []
    active: set[int] = set()
    previous = points[0][0] if points else 0
    for t, starts, i in points:
        if t > previous:
            if active:
                for j in active:
                    share[j] += (t - previous) / len(active)
            else:
                idle.append((previous, t))
            previous = t
        if starts:
            active.add(i)
        else:
            active.discard(i)
    return share, idle


def _laid_out(named: list[tuple[HostOp, str, str]], step: int, wall_minus_mono_ns: float) -> list[list[Any]]:
    """One event per name: the same events in every step, however the executor ordered, interleaved or
    parallelised the ops (it does so differently from step to step, and an event per run of consecutive ops
    would give each step a different graph).

    An event lasts its ops' share of the wall time (``_busy_shares``: ops running side by side on several
    inter-op threads are not counted twice) and is placed by its first op: the events follow one another in
    that order, each after the idle time (waiting for a collective, executor overhead) that ended before
    its first op and after the previous event's, so the step's busy and idle time add up as measured."""
    if not named:
        return []
    ops = [op for op, _, _ in named]
    share, idle = _busy_shares(ops)
    groups: dict[str, dict[str, Any]] = {}
    for (op, cat, name), busy in zip(named, share, strict=True):
        g = groups.setdefault(name, {"cat": cat, "first": op.start_ns, "busy": 0.0, "ops": 0, "kinds": set()})
        g["first"] = min(g["first"], op.start_ns)
        g["busy"] += busy
        g["ops"] += 1
        g["kinds"].add(op.type)
    order = sorted(groups, key=lambda n: (groups[n]["first"], n))
    firsts = [groups[n]["first"] for n in order]
    waited = [0.0] * len(order)
    for begin, end in idle:
        k = bisect.bisect_left(firsts, end)  # the first event that begins once this idle time is over
        if k < len(order):
            waited[k] += end - begin
    rows: list[list[Any]] = []
    cursor = float(firsts[0])
    for k, name in enumerate(order):
        g = groups[name]
        ts = _us(cursor + waited[k], wall_minus_mono_ns)
        cursor += waited[k] + g["busy"]
        rows.append(event_row(name, g["cat"], HOST if g["cat"] == "IO" else COMPUTE, ts, g["busy"] / 1000.0,
                              {"step": step, "ops": g["ops"], "kinds": sorted(g["kinds"])[:8]}))
    return rows


def _attach_grads(rows: list[list[Any]], layout: Layout) -> None:
    """A layer's gradients are ready at the end of its last backward event of the step."""
    last: dict[str, list[Any]] = {}
    for row in sorted(rows, key=lambda r: r[3]):
        if row[1] == "BW" and row[0][3:] in layout.grads_of:
            last[row[0][3:]] = row
    for layer, row in last.items():
        grads = list(layout.grads_of[layer])
        row[5]["grads"] = grads
        row[5]["grads_ready_us"] = [(row[3] + row[4]) / 1000.0] * len(grads)  # rows hold integer ns


HOROVOD_KERNEL = "HorovodAllreduce"
# horovod.tensorflow names an allreduce after its tensor, "HorovodAllreduce_<tensor name>_<output>": the gradients
# of hvd.keras's DistributedOptimizer are "grads", "grads_1", "grads_2", ... in trainable_variables order
_HOROVOD_GRAD = re.compile(r"HorovodAllreduce_grads(?:_(\d+))?_\d+$")


def _gradient_index(name: str) -> int | None:
    found = _HOROVOD_GRAD.search(name)
    return None if found is None else int(found.group(1) or 0)


def horovod_rows(async_ops: Iterable[AsyncOp], *, step: int, layout: Layout, wall_minus_mono_ns: float,
                 step_end_ns: int) -> list[list[Any]]:
    """One ``COMM.<gradient>.allreduce`` per Horovod allreduce of a step (``hvd.DistributedOptimizer`` of
    ``horovod.tensorflow.keras``): from its launch on the executor to Horovod completing it, with the gradient's
    name and bytes and ``hvd_name`` (the op's name, which Horovod's timeline uses), so the horovod engine merges the
    timeline's fused buffers into it. Allreduces are matched to gradients by the index in their name, or in launch
    order when their names do not say; ones beyond the model's gradients keep their op name and no bytes. An
    allreduce whose completion the profiler missed (it stopped while Horovod's callback still ran, in the window's
    last step) ends at the step's end (``step_end_ns``, wall clock), the latest it can have completed."""
    mine = sorted((a for a in async_ops if a.type.startswith(HOROVOD_KERNEL)), key=lambda a: a.launch_ns)
    indices = [_gradient_index(a.name) for a in mine]
    if None in indices or len(set(indices)) != len(indices):
        indices = list(range(len(mine)))
    rows = []
    for op, k in zip(mine, indices, strict=True):
        args: dict[str, Any] = {"step": step, "op": "allreduce", "phase": "allreduce", "hvd_name": op.name,
                                "source": "launch to completion by Horovod (TensorFlow profiler, async kernel)"}
        if k < len(layout.gradients):
            grad, nbytes = layout.gradients[k]
            name = f"COMM.{grad}.allreduce"
            args.update(bytes=nbytes, tensors=[grad])
        else:
            name = f"COMM.{op.name.replace('/', '_')}.allreduce"
            args.update(bytes=0, tensors=[])
        if op.done_ns is None:
            args["note"] = "completion not traced (the profiler stopped first): ends with the step"
        ts = _us(op.launch_ns, wall_minus_mono_ns)
        done = op.done_ns if op.done_ns is not None else step_end_ns
        rows.append(event_row(name, "COMM", COMM, ts, _us(done, wall_minus_mono_ns) - ts, args))
    return rows
