"""``TFRecorder``: record a window of TensorFlow training steps into a dpro run directory.

The step boundaries come from the caller (the Keras callback's batch hooks, or ``Profiler.step()`` in a
custom loop), on the rank's monotonic clock. Per-op timing comes from TensorFlow's own profiler: it runs
for the window only (``tf.profiler.experimental.start/stop``; a window in blocks, once per block, so that its gaps
run unrecorded and measure what recording costs), its XPlane files are kept in the run directory (``xplane-rank<r>/``,
``xplane-rank<r>.2/`` for a second block, ...; TensorBoard opens them) and parsed when the window ends
(``dpro.plugins.tf.xplane``), and
its ops are mapped to layers (``dpro.plugins.tf.ops``). TensorFlow hands the profile over only when it stops,
so a worker killed inside the window leaves its run.json and the XPlane directory, not its events.

Workers agree on the run directory and exchange clock samples over a TCP side channel
(``dpro.plugins.tf.transport``; addresses from ``TF_CONFIG``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import tensorflow as tf

from dpro.engines.horovod.knobs import NAME as ENGINE_HOROVOD
from dpro.engines.horovod.knobs import knobs_from_environment
from dpro.engines.horovod.timeline import TIMELINE_FILE
from dpro.engines.tf_mwms import NAME as ENGINE_MWMS
from dpro.errors import DproError
from dpro.plugins.tf.ops import HOROVOD_KERNEL, Layout, Pack, horovod_rows, pack_gradients, step_rows
from dpro.plugins.tf.probes import probe_document, runs_jit_compiled, write_probes
from dpro.plugins.tf.transport import HorovodCollectives, default_transport
from dpro.plugins.tf.xplane import find_xplane, read_xplane
from dpro.record.protocol import (
    PROBE_BYTES,
    Clock,
    Transport,
    agree_run_dir,
    allreduce_probe,
    claim_run_dir,
    clock_samples,
    interference_probe,
    last_block_start,
    probes_wanted,
    wall_minus_clock_ns,
)
from dpro.record.trace import QUEUE_ID, ROOT_MODULE, event_row, model_fingerprint, probes_summary
from dpro.record.window import WindowEnd, WindowRecorder, open_trace
from dpro.record.writer import model_document, run_document, write_model_json, write_run_json

__all__ = ["TFRecorder", "gradient_fingerprint", "layer_paths", "model_layout", "output_bytes_per_sample"]

logger = logging.getLogger("dpro.plugins.tf")

# Why a worker can die in tf.profiler.experimental.stop() (seen in ~1 recorded 2-worker MWMS job in 8 here with one
# inter-op thread, 7 in 18 with TensorFlow's default threads, whatever the window's length):
# TraceMeRecorder::Consume (tsl) keeps pointers to a thread's end-of-activity events while it still appends to
# that thread's event vector; activities that start on one thread and end on another (collectives) are then
# merged into freed memory.
STOPPING_PROFILER = ("stopping TensorFlow's profiler (tf.profiler.experimental.stop). A worker that died here "
                     "was killed by TensorFlow 2.21 itself: its profiler writes into freed memory when it merges "
                     "activities that began on one thread and ended on another (tsl TraceMeRecorder::Consume); "
                     "it happened in 1 recorded 2-worker job in 8 to 1 in 3 on CPU (more with TensorFlow's default "
                     "threads). The job is fine: run it again")
XPLANE_DIR = "xplane-rank{rank}"


def layer_paths(model: Any) -> list[tuple[Any, str, str | None]]:
    """Every layer under ``model`` with its dotted path from the model (``block1.conv_a``; the model itself is
    ``model.name``) and its parent's path (None for the model), outer layers first. A layer reached twice (a
    shared layer) keeps its first path."""
    out: list[tuple[Any, str, str | None]] = [(model, model.name, None)]
    seen = {id(model)}

    def visit(layer: Any, path: str | None) -> None:
        for sub in getattr(layer, "layers", None) or []:
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            sub_path = sub.name if path is None else f"{path}.{sub.name}"
            out.append((sub, sub_path, path if path is not None else model.name))
            visit(sub, sub_path)

    visit(model, None)
    return out


def _var_short(var: Any) -> str:
    name = getattr(var, "path", None) or var.name
    return name.split(":")[0].rsplit("/", 1)[-1]


def _shape(var: Any) -> list[int]:
    return [int(d or 0) for d in var.shape]  # a TensorShape (tf_keras) or a tuple (Keras 3)


def _nbytes(var: Any) -> int:
    return math.prod(_shape(var)) * tf.as_dtype(var.dtype).size  # dtype: a DType (tf_keras) or a str (Keras 3)


def output_bytes_per_sample(layer: Any) -> int | None:
    """Bytes of one sample of a layer's output, from its symbolic output (layers of a built functional or
    Sequential model); None when the layer has none (a subclassed model's layers, a shared layer)."""
    try:
        outputs = tf.nest.flatten(layer.output)
    except (AttributeError, ValueError, RuntimeError):
        return None
    total = 0
    for out in outputs:
        shape = getattr(out, "shape", None)
        if shape is None or len(shape) == 0 or any(d is None for d in list(shape)[1:]):
            return None
        total += math.prod(int(d) for d in list(shape)[1:]) * tf.as_dtype(out.dtype).size
    return total


def model_layout(model: Any, optimizer: Any = None, bytes_per_pack: int = 0) -> tuple[Layout, list[dict[str, Any]]]:
    """The ``Layout`` of a Keras model (tf_keras or Keras 3) and its gradients (name, bytes, shape, dtype, layer)
    in ``model.trainable_variables`` order. A variable belongs to the innermost layer that holds it; layers are
    named by their dotted path (``Layout.paths``), gradients ``<layer path>.<variable>``."""
    owner: dict[int, str] = {}
    layers = layer_paths(model)
    for layer, path, _ in layers:  # outer first, so inner layers override
        for var in getattr(layer, "trainable_weights", []):
            owner[id(var)] = path
    grads = []
    for var in model.trainable_variables:
        layer = owner.get(id(var), model.name)
        grads.append({"name": f"{layer}.{_var_short(var)}", "bytes": _nbytes(var), "shape": _shape(var),
                      "dtype": tf.as_dtype(var.dtype).name, "module": layer, "computed_by": layer})
    grads_of: dict[str, list[str]] = {}
    for g in grads:
        grads_of.setdefault(g["module"], []).append(g["name"])
    scopes = set()
    if optimizer is not None:
        scopes |= {str(getattr(optimizer, "name", "")), type(optimizer).__name__}
    packs = pack_gradients([(g["name"], g["bytes"]) for g in grads], bytes_per_pack)
    paths: dict[str, str] = {}
    for layer, path, _ in layers[1:]:
        paths.setdefault(layer.name, path)
    layout = Layout(layers=frozenset(paths) or frozenset({model.name}),
                    grads_of={k: tuple(v) for k, v in grads_of.items()},
                    optimizer_scopes=frozenset(s for s in scopes if s), packs=tuple(packs),
                    paths=paths, root=model.name, gradients=tuple((g["name"], g["bytes"]) for g in grads))
    return layout, grads


def _drain() -> None:
    """Wait for the ops TensorFlow still runs asynchronously (eager async mode, collectives in flight)."""
    from tensorflow.python.eager import context

    context.async_wait()


def _probe_kernel() -> Callable[[], None]:
    """The interference probe's compute: matrix products of a fixed size, a few ms on one CPU core."""
    a = tf.random.normal((256, 256), seed=0)

    def compute() -> None:
        out = a
        for _ in range(12):
            out = tf.linalg.matmul(a, a)
        out.numpy()  # eager ops may run asynchronously: the time is the products'

    return compute


def gradient_fingerprint(grads: list[dict[str, Any]]) -> str:
    """The model hash of run.json and configs: (name, shape, dtype) of the gradients of ``model_layout``."""
    return model_fingerprint((g["name"], g["shape"], g["dtype"]) for g in grads)


def communication_options(strategy: Any) -> tuple[int, str]:
    """(bytes_per_pack, implementation) in force for a strategy's collectives (MWMS keeps them in
    ``extended._communication_options``); (0, "AUTO") otherwise."""
    options = getattr(getattr(strategy, "extended", None), "_communication_options", None)
    if options is None:
        return 0, "AUTO"
    impl = getattr(options, "implementation", None)
    return int(getattr(options, "bytes_per_pack", 0) or 0), getattr(impl, "name", str(impl or "AUTO"))


def is_mwms(strategy: Any) -> bool:
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or \
        type(strategy).__name__.startswith("CollectiveAllReduceStrategy")


class TFRecorder(WindowRecorder):
    """Records steps ``steps`` of a TensorFlow/Keras job (see the module docstring).

    Args:
        model: the Keras model being trained (tf_keras or Keras 3).
        run_dir: a new or empty directory, or None for ``dpro-runs/<timestamp>``; worker 0 decides.
        steps: the training steps (batches, counted from 0 over all epochs) to record.
        strategy: the ``tf.distribute`` strategy (default: the model's, else the current one).
        optimizer: the optimizer (default: ``model.optimizer``); names its ops' scope.
        total_steps: when known, a window beyond it is refused at once.
        transport: how workers talk (default: the TCP side channel of ``TF_CONFIG``).
        batch_size: samples per step on this worker; with it model.json holds each layer's activation bytes
            (its output for the batch), which the recompute search needs. None: not known, not searched.
        probe_batch: returns one batch of the model's inputs for the compile probe after the window
            (``dpro.plugins.tf.probes``); None: ``batch_size`` samples made from the model's symbolic inputs.
        probes: run the compile probe after the window; None: unless ``$DPRO_PROBES`` is "0".
    """

    def __init__(self, model: Any, run_dir: str | Path | None, steps: Iterable[int], *,
                 strategy: Any = None, optimizer: Any = None, total_steps: int | None = None,
                 transport: Transport | None = None, who: str = "dpro.plugins.tf.Profiler",
                 batch_size: int | None = None, probe_batch: Callable[[], Any] | None = None,
                 probes: bool | None = None) -> None:
        super().__init__(steps, total_steps=total_steps, who=who)
        self.probe_batch = probe_batch
        self.probes = probes_wanted() if probes is None else bool(probes)
        self.batch_size = batch_size if isinstance(batch_size, int) and batch_size > 0 else None
        self.model = model
        self.strategy = strategy or getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.transport = transport if transport is not None else default_transport()
        # hvd.keras: Horovod's ranks and allreduces
        self.horovod = isinstance(getattr(self.transport, "collectives", None), HorovodCollectives)
        self.rank, self.world_size = self.transport.rank, self.transport.world_size
        self.clock = Clock.from_env(self.rank)
        self.host = socket.gethostname()
        self.run_dir = agree_run_dir(self.transport, run_dir, who, claim_run_dir)
        self.hosts = self.transport.gather_texts(self.host)
        self._marks: list[tuple[int, float, float]] = []   # (step, begin µs, end µs)
        self._step_begin: float | None = None
        self._last_end: float | None = None
        self._profiling = False
        self._wall_minus_mono_ns = 0.0
        self._timeline_started = False
        self._blocks: list[tuple[Path, list[int]]] = []  # each recorded block's TensorFlow profile and steps
        self._run_doc: dict[str, Any] | None = None  # rank 0's run.json, rewritten with the probes after the window
        if self.horovod and os.environ.get("HOROVOD_TIMELINE") == "DYNAMIC":
            # Horovod turns a DYNAMIC timeline's per-cycle coordination on in hvd.init(), with no file open, until
            # the first stop (a cost on every step): stopped here, the steps before the window and
            # the gaps run as the unrecorded job does
            self._timeline_started = True
            self._stop_timeline()

    # ---- step boundaries (``begin_step``: before its work is dispatched; ``end_step``: its results are back) ----

    def _on_step_begin(self) -> None:
        if self._profiling and self.iteration not in self.window:
            # the first step of a gap: the block before it ends here, not at its last step's end, so that stopping
            # the profiler (collecting and writing its XPlane, tens of ms) lands in an unrecorded step that the
            # overhead's clock leaves out, not in a recorded step's time
            self._stop_profiler()
        if self.iteration in self.window and self.started and not self._profiling:
            self._start_profiler()  # the first step of a later block (the window's first started it as it opened)
        now = self.clock.now()
        self._step_begin = self._last_end if (self._last_end is not None and self.iteration - 1 in self.window) \
            else now

    def _on_step_end(self) -> None:
        now = self.clock.now()
        if self.iteration in self.window and self._profiling and self._step_begin is not None:
            self._marks.append((self.iteration, self._step_begin, now))
            self._blocks[-1][1].append(self.iteration)
        self._last_end = now

    # ---- window --------------------------------------------------------------------------------------

    def _begin_window(self) -> None:
        pingpong = clock_samples(self.transport, self.clock)
        self._writer = open_trace(self.run_dir, self.rank, self.world_size, host=self.host,
                                  device="host (TensorFlow profiler)")
        self._layout, self._grads = self._model_layout()
        if runs_jit_compiled(self.model):
            logger.warning("%s: the model runs under jit_compile: XLA fuses its layers' ops, so the window records its "
                           "steps without them", self.who)
        if self.rank == 0:
            self._write_run_json(pingpong)
        self.transport.barrier()
        self._wall_minus_mono_ns = wall_minus_clock_ns(self.clock)
        self._start_profiler()

    def _start_profiler(self) -> None:
        """A recorded block begins: TensorFlow's profiler into the block's own directory and, in the window's last
        block only, Horovod's timeline (``HOROVOD_TIMELINE=DYNAMIC``, ``dpro-launch --horovod-timeline``): once
        started it slows every later step, so the earlier blocks and the gaps run without it."""
        if self.horovod and os.environ.get("HOROVOD_TIMELINE") == "DYNAMIC" and \
                self.iteration == last_block_start(self.steps):
            import horovod.tensorflow as hvd

            hvd.start_timeline(str(self.run_dir / TIMELINE_FILE))
            self._timeline_started = True
        name = XPLANE_DIR.format(rank=self.rank)
        logdir = self.run_dir / (name if not self._blocks else f"{name}.{len(self._blocks) + 1}")
        _drain()  # the profiler starts with no op of the previous step in flight
        tf.profiler.experimental.start(str(logdir))
        self._blocks.append((logdir, []))
        self._profiling = True

    def _stop_profiler(self) -> None:
        self._profiling = False
        _drain()
        with self._writer.inside(STOPPING_PROFILER):
            tf.profiler.experimental.stop()
        self._stop_timeline()

    def _stop_timeline(self) -> None:
        if self._timeline_started:
            self._timeline_started = False
            import horovod.tensorflow as hvd

            with contextlib.suppress(ValueError):
                hvd.stop_timeline()

    def _model_layout(self) -> tuple[Layout, list[dict[str, Any]]]:
        bytes_per_pack, _ = communication_options(self.strategy)
        return model_layout(self.model, self.optimizer, bytes_per_pack)

    # ---- close (``close``: stop the profiler, map its ops to the recorded steps, write ``rank-<r>.json`` and
    # ``model.json`` on worker 0) -------------------------------------------------------------------------------

    def _end_window(self, error: BaseException | None) -> WindowEnd:
        if self._profiling:
            self._stop_profiler()
        self._stop_timeline()
        problems = []
        rows_by_step: dict[int, list[list[Any]]] = {}
        for logdir, steps in self._blocks:
            try:
                rows_by_step.update(self._rows(read_xplane(find_xplane(logdir)), set(steps)))
            except DproError as err:
                problems.append(f"the TensorFlow profile could not be read: {err}")
        for step, rows in rows_by_step.items():
            self._writer.end_step(step, rows)
        self._rows_by_step = rows_by_step
        # the overhead is the Python thread's CPU only: TensorFlow runs the ops (and its profiler) on its own
        return WindowEnd(problems=problems)

    def _after_window(self, error: BaseException | None) -> None:
        if self.rank == 0:
            self._write_model_json(self._rows_by_step)
        if error is None and self.iteration > self.steps[-1]:  # every rank is here, at one step
            self._compile_probe_after_window()
            if self.horovod:
                self._probe_after_window()
        self._close_transport()

    def _compile_probe_after_window(self) -> None:
        """The compile probe (``dpro.plugins.tf.probes``) written to ``RUN/probes/``, summarised in rank 0's run.json:
        on a single worker or a MultiWorkerMirroredStrategy worker, as the torch recorder probes a single process or
        DDP (not Horovod: its optimizer is another engine's). Never raises."""
        if not self.probes or self.horovod or (self.world_size > 1 and not is_mwms(self.strategy)):
            return
        try:
            doc = probe_document(self.model, rank=self.rank, strategy=self.strategy, batch=self.probe_batch,
                                 rows=self.batch_size)
            if not doc["probes"] and not doc["skipped"]:
                return  # $DPRO_PROBE_COMPILE=0: nothing probed, nothing to say
            write_probes(self.run_dir, self.rank, doc)
        except Exception as err:  # noqa: BLE001 - a probe must never fail the job it measures
            logger.warning("%s: the probe after the window failed (%s); the run has none", self.who, err)
            return
        if self.rank == 0 and self._run_doc is not None:
            self._run_doc["probes"] = probes_summary(doc)
            write_run_json(self.run_dir, self._run_doc)

    def _probe_after_window(self) -> None:
        """The interference probe (a fixed kernel alone and while an allreduce is in flight) on Horovod's collectives
        after the window, as the torch recorder runs it: compute that overlaps the allreduces runs slower by what it
        measures. Its allreduce is sized from a few timed allreduces of the largest probe size, which are not kept as
        run.json's ``comm_probe``: without Horovod's timeline a blocking allreduce also waits for the background
        loop's next cycle and its negotiation, which the recorded steps' own transfers leave out. A probe that fails
        is logged; the job goes on."""
        try:
            sizing = allreduce_probe(self.transport, self.clock, sizes=PROBE_BYTES[-1:], repeat=3, most=3)
            interference = interference_probe(self.transport, self.clock, _probe_kernel(), sizing)
        except (RuntimeError, ValueError, OSError, tf.errors.OpError) as err:
            logger.warning("%s: the probe after the window failed (%s); the run has no probe", self.who, err)
            return
        if self.rank == 0 and self._run_doc is not None and interference is not None:
            self._run_doc["interference_probe"] = interference
            write_run_json(self.run_dir, self._run_doc)

    def _rows(self, profile: Any, steps: set[int]) -> dict[int, list[list[Any]]]:
        """The rows of ``steps`` (one block's) from that block's ``profile``."""
        out: dict[int, list[list[Any]]] = {}
        offset = self._wall_minus_mono_ns
        for step, begin, end in self._marks:
            if step not in steps:
                continue
            lo, hi = begin * 1000.0 + offset, end * 1000.0 + offset  # the step in wall-clock ns
            ops = [o for o in profile.ops if lo <= o.start_ns < hi]
            colls = [c for c in profile.collectives if lo <= c.launch_ns < hi]
            allreduces = [a for a in profile.async_ops if lo <= a.launch_ns < hi] if self.horovod else []
            first = min((a.launch_ns for a in allreduces if a.type.startswith(HOROVOD_KERNEL)), default=None)
            rows = step_rows(ops, colls, step=step, layout=self._layout, wall_minus_mono_ns=offset,
                             first_gradient_launch_ns=first)
            if self.horovod:
                rows += horovod_rows(allreduces, step=step, layout=self._layout, wall_minus_mono_ns=offset,
                                     step_end_ns=int(hi))
            rows.insert(0, event_row("STEP", "STEP", QUEUE_ID["host"], begin, end - begin, {"step": step}))
            out[step] = rows
        return out

    # ---- run.json / model.json -------------------------------------------------------------------------

    def knobs(self) -> dict[str, Any]:
        knobs: dict[str, Any] = {"world_size": self.world_size, "device": "cpu" if not tf.config.list_logical_devices(
            "GPU") else "gpu"}
        if is_mwms(self.strategy):
            bytes_per_pack, implementation = communication_options(self.strategy)
            knobs.update({"tf.mwms.bytes_per_pack": bytes_per_pack, "tf.mwms.implementation": implementation})
        if self.horovod:
            knobs.update(knobs_from_environment(dict(os.environ)))
        if self.optimizer is not None:
            knobs["optimizer"] = type(self.optimizer).__name__
        if runs_jit_compiled(self.model):  # Keras builds the whole train function with XLA
            knobs["compile"] = [ROOT_MODULE]
        return knobs

    def fingerprint(self) -> str:
        return gradient_fingerprint(self._grads)

    def _engine(self) -> str:
        if self.horovod:
            return ENGINE_HOROVOD
        return ENGINE_MWMS if is_mwms(self.strategy) and self.world_size > 1 else "tf"

    def _horovod_section(self) -> dict[str, Any]:
        """run.json's ``horovod`` section, what the horovod engine reads (as the torch plugin writes it)."""
        import horovod
        import horovod.tensorflow as hvd

        offset_ns = wall_minus_clock_ns(self.clock)
        rank_us = self.clock.now()
        return {"version": horovod.__version__, "timeline": os.environ.get("HOROVOD_TIMELINE") or None,
                "timeline_file": TIMELINE_FILE,
                "note": "HOROVOD_TIMELINE is written by rank 0 only; its ts count µs from hvd.start_timeline on "
                        "CLOCK_MONOTONIC, placed on rank 0's clock with the wall/rank clock pair below",
                "clock": {"wall_us": rank_us + offset_ns / 1000.0, "rank_us": rank_us},
                "local_size": hvd.local_size(), "cross_size": hvd.cross_size(), "tensor_names": {}, "groups": []}

    def _write_run_json(self, pingpong: dict[int, list[list[float]]]) -> None:
        keras_version = getattr(getattr(self.model, "__class__", None), "__module__", "").split(".")[0]
        versions = {"python": platform.python_version(), "tensorflow": tf.__version__, "keras": keras_version}
        extra: dict[str, Any] = {}
        if self.horovod:
            extra = {"horovod": self._horovod_section()}
        doc = run_document(framework="tf", engine=self._engine(), versions=versions, world_size=self.world_size,
                           hosts=self.hosts, steps=list(self.steps), knobs=self.knobs(),
                           fingerprint=self.fingerprint(), probe=[], pingpong=pingpong,
                           extra={"tf": {"strategy": type(self.strategy).__name__,
                                         "xplane": XPLANE_DIR.format(rank="<r>"),
                                         "note": "per-op times from TensorFlow's profiler (XPlane), mapped to "
                                                 "Keras layers by name scope"}, **extra})
        self._run_doc = doc
        write_run_json(self.run_dir, doc)

    def _write_model_json(self, rows_by_step: dict[int, list[list[Any]]]) -> None:
        ready: dict[str, float] = {}
        if rows_by_step:
            last = rows_by_step[max(rows_by_step)]
            for row in last:
                for g, t in zip(row[5].get("grads", []), row[5].get("grads_ready_us", []), strict=False):
                    ready[g] = t
        gradients = sorted((dict(g, ready_us=ready.get(g["name"])) for g in self._grads),
                           key=lambda g: (g["ready_us"] is None, g["ready_us"] or 0.0))
        packs: tuple[Pack, ...] = self._layout.packs
        buckets = [{"index": i, "bytes": p.nbytes, "tensors": list(p.tensors)} for i, p in enumerate(packs)]
        modules = []
        for layer, path, parent in layer_paths(self.model):
            leaf = not getattr(layer, "layers", None) and type(layer).__name__ != "InputLayer"  # inputs: the batch
            own = sum(_nbytes(v) for v in getattr(layer, "trainable_weights", [])) if leaf else 0
            per_sample = output_bytes_per_sample(layer) if leaf and parent is not None else None
            modules.append({"name": path, "type": type(layer).__name__, "parent": parent, "param_bytes": own,
                            "activation_bytes": (per_sample * self.batch_size
                                                 if per_sample is not None and self.batch_size else None),
                            "recorded": parent is not None and leaf})
        write_model_json(self.run_dir, model_document(fingerprint=self.fingerprint(), gradients=gradients,
                                                      buckets=buckets, modules=modules))
