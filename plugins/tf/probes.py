"""The compile probe after the recorded window: the Keras model's forward and backward timed as the job ran them
(a ``tf.function`` without XLA) and under ``jit_compile=True``, in alternating pairs, on one batch.

It prices the ``compile`` knob by measurement (XLA on a CPU can be much slower than TensorFlow's own kernels: a
Dropout's random mask, for one). Keras compiles its whole train function, so the only region is ``<root>``. The
result goes to ``RUN/probes/rank-<r>.json`` in the format the torch recorder writes (``dpro.io.probes`` reads it):
one probe whose ``ops`` are the compiled ``FW`` and ``BW`` medians and ``eager`` the same without XLA.

Each pass is one ``tf.function`` of the forward (the model called with ``training=True``, reduced to the sum of its
floating outputs: the recorded loss lives in the train step) and one of forward and backward (the gradients of that
sum for every trainable variable, with ``tf.GradientTape``); the backward is the second's median less the first's.
Where that difference is within the passes' spread (a small model, whose pass is mostly the call's own cost), both
phases take the whole pass's compiled/eager ratio, and the probe file's note says so.
The optimizer is never called, so weights and its state stay; the model's non-trainable variables (BatchNorm's
statistics, Keras 3's seed generators) are put back afterwards. The batch is one the job gives (dpro-launch: the
fit's first batch), else the model's symbolic inputs at the recorded batch size (uniform floats, zero integers:
time depends on shapes, not values).

``$DPRO_PROBE_COMPILE``: ``<root>`` when unset, "0" none; ``$DPRO_PROBES`` "0": none. A probe that fails (XLA
cannot compile an op, the inputs cannot be made) is skipped with a note and the job goes on.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tensorflow as tf

from dpro.record.protocol import compile_regions_wanted
from dpro.record.trace import PROBES_SCHEMA, ROOT_MODULE, Probe, probes_file, write_json_atomic

__all__ = ["COMPILE_PASSES", "MIN_PASSES", "PROBE_BUDGET_S", "compile_probe", "error_line", "first_rows",
           "probe_document", "runs_jit_compiled", "symbolic_batch", "write_probes"]

logger = logging.getLogger("dpro.plugins.tf")

COMPILE_PASSES = 15  # pairs of passes without and with XLA, after each function's warm-up (its trace and compile)
MIN_PASSES = 3  # pairs kept at least, even past the budget
PROBE_BUDGET_S = 60.0  # no further pair starts once the probe took this long (an XLA compile may take tens of s)
NOTE = "probe passes after the window: not part of the recorded steps"
WHOLE_PASS = ("compile <root>: forward and backward at the whole pass's compiled/eager ratio (the backward, the pass "
              "less the forward, was within the passes' spread)")
WHOLE_MODEL_ONLY = "Keras compiles its whole train function (jit_compile): only <root> is probed"


def runs_jit_compiled(model: Any) -> bool:
    """Whether Keras builds ``model``'s train function with XLA (``model.jit_compile``, Keras 3 and tf_keras)."""
    try:
        return bool(getattr(model, "jit_compile", False))
    except (AttributeError, ValueError, RuntimeError):
        return False


def symbolic_batch(model: Any, rows: int) -> Any:
    """Inputs for ``model`` of ``rows`` samples made from its symbolic inputs (a functional or Sequential model):
    uniform floats, zeros otherwise, in the structure the model takes.

    Raises:
        ValueError: the model has no symbolic inputs (a subclassed model), or one has an unknown dimension.
    """
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError("the model has no symbolic inputs (a subclassed model): pass the batch to the recorder")
    made = []
    for spec in inputs:
        dims = list(spec.shape)[1:]
        if any(d is None for d in dims):
            raise ValueError(f"input {getattr(spec, 'name', '?')} has an unknown dimension {tuple(spec.shape)}")
        shape, dtype = [rows, *(int(d) for d in dims)], tf.as_dtype(spec.dtype)
        made.append(tf.random.stateless_uniform(shape, seed=[1, 2], dtype=dtype) if dtype.is_floating
                    else tf.zeros(shape, dtype=dtype))
    return made[0] if len(made) == 1 else made


def first_rows(batch: Callable[[], Any], rows: int) -> Any:
    """``batch()`` with every tensor cut to its first ``rows`` samples (a worker's share of a global batch)."""
    return tf.nest.map_structure(lambda t: tf.convert_to_tensor(t)[:rows], batch())


def _output_sum(outputs: Any) -> tf.Tensor:
    """A scalar every floating output feeds: their sum in float32 (the job's loss is the train step's, not the
    model's, and cannot be called again safely)."""
    parts = [tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(outputs)
             if isinstance(t, tf.Tensor) and t.dtype.is_floating]
    if not parts:
        raise ValueError("the model's output holds no floating tensor")
    return tf.add_n(parts)


def _gradient_sum(gradients: list[Any]) -> tf.Tensor:
    """One scalar that needs every gradient (so XLA keeps them all); an embedding's sparse gradient by its values."""
    parts = [tf.reduce_sum(g.values if isinstance(g, tf.IndexedSlices) else g) for g in gradients if g is not None]
    return tf.add_n(parts) if parts else tf.constant(0.0)


def _pass_functions(model: Any, strategy: Any, jit: bool) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """(forward, forward and backward) of ``model`` as ``tf.function``s, with or without XLA, each run in the
    strategy's replica context as Keras runs its train step (no collective: the optimizer is not called)."""
    def forward(inputs: Any) -> tf.Tensor:
        return _output_sum(model(inputs, training=True))

    def forward_backward(inputs: Any) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = _output_sum(model(inputs, training=True))
        return _gradient_sum(tape.gradient(loss, model.trainable_variables))

    def replicated(step: Callable[[Any], tf.Tensor]) -> Callable[[Any], Any]:
        return tf.function(lambda inputs: strategy.run(step, args=(inputs,)), jit_compile=jit)

    return replicated(forward), replicated(forward_backward)


def _timed_us(function: Callable[[Any], Any], inputs: Any, strategy: Any) -> float:
    """µs of one call of ``function``, its results fetched (TensorFlow may return before its ops ran)."""
    began = time.perf_counter_ns()
    for result in strategy.experimental_local_results(function(inputs)):
        result.numpy()
    return (time.perf_counter_ns() - began) / 1000.0


def _one_pair(phases: dict[bool, tuple[Callable, Callable]], inputs: Any,
              strategy: Any) -> dict[bool, tuple[float, float]]:
    """Without XLA, then with: each (forward µs, forward-and-backward µs)."""
    return {jit: (_timed_us(forward, inputs, strategy), _timed_us(forward_backward, inputs, strategy))
            for jit, (forward, forward_backward) in phases.items()}


def _phases(passes: list[tuple[float, float]]) -> tuple[dict[str, float], bool]:
    """One mode's ``{"FW", "BW"}`` µs from its (forward, forward-and-backward) passes: the medians, the backward as
    their difference; and whether that difference stands out of the passes' spread (the interquartile range of
    either). It does not for a model whose pass is mostly the call's own cost: the pass is then split in halves,
    so that both phases take the whole pass's ratio."""
    forward = [fw for fw, _ in passes]
    whole = [fwbw for _, fwbw in passes]
    fw, pass_us = statistics.median(forward), statistics.median(whole)
    spread = max(_iqr(forward), _iqr(whole))
    if pass_us - fw > spread:
        return {"FW": fw, "BW": pass_us - fw}, True
    return {"FW": pass_us / 2, "BW": pass_us / 2}, False


def _iqr(values: list[float]) -> float:
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[2] - quartiles[0]


@contextlib.contextmanager
def _state_kept(model: Any) -> Iterator[None]:
    """The model's non-trainable variables (BatchNorm's statistics, seed generators' states) put back as they were
    whatever happens inside (``training=True`` passes update them; the trainable ones are never assigned)."""
    saved = [(variable, variable.numpy()) for variable in model.non_trainable_variables]
    try:
        yield
    finally:
        for variable, value in saved:
            variable.assign(value)


def compile_probe(model: Any, inputs: Any, *, strategy: Any, rows: int, passes: int = COMPILE_PASSES,
                  budget_s: float = PROBE_BUDGET_S) -> tuple[Probe, bool]:
    """``model``'s forward and backward on ``inputs`` (``rows`` samples) without and with XLA: two warm-up calls of
    each function (tracing, XLA's compile), then ``passes`` alternating pairs (fewer past ``budget_s``, at least
    ``MIN_PASSES``). Returns the compile probe of ``<root>`` (each phase's median µs, ``_phases``) and whether its
    forward and backward were told apart (else both carry the whole pass's ratio). The model's state is kept."""
    began = time.perf_counter()
    functions = {jit: _pass_functions(model, strategy, jit) for jit in (False, True)}
    with _state_kept(model):
        for pair in functions.values():
            for function in pair:
                for _ in range(2):
                    _timed_us(function, inputs, strategy)
        pairs = []
        while len(pairs) < passes and (len(pairs) < MIN_PASSES or time.perf_counter() - began < budget_s):
            pairs.append(_one_pair(functions, inputs, strategy))
    eager, eager_apart = _phases([p[False] for p in pairs])
    compiled, compiled_apart = _phases([p[True] for p in pairs])
    apart = eager_apart and compiled_apart
    if not apart:  # both modes split alike, so that FW and BW both take the whole pass's ratio
        eager = {k: sum(eager.values()) / 2 for k in eager}
        compiled = {k: sum(compiled.values()) / 2 for k in compiled}
    probe = Probe(None, rows, len(pairs), compiled, sum(compiled.values()), 0, compile=ROOT_MODULE, eager=eager)
    return probe, apart


def _rows(inputs: Any) -> int | None:
    """Dim 0 of the first tensor of ``inputs``."""
    for item in tf.nest.flatten(inputs):
        shape = getattr(item, "shape", None)
        if shape is not None and len(shape) > 0 and shape[0] is not None:
            return int(shape[0])
    return None


def error_line(err: BaseException, limit: int = 300) -> str:
    """``Type: the line that says what failed`` of an error: TensorFlow's graph errors open with lines naming where
    (``Graph execution error:``, ``Detected at node ...``, ``<stack traces unavailable>``), which are passed over."""
    boilerplate = ("Graph execution error", "Detected at node", "<stack traces unavailable>")
    lines = [line.strip() for line in str(getattr(err, "message", None) or err).splitlines()]
    said = next((line for line in lines if line and not line.startswith(boilerplate)), "")
    return f"{type(err).__name__}: {said}"[:limit]


def _cannot_probe(model: Any, batch: Callable[[], Any] | None, rows: int | None) -> str | None:
    """Why the compile probe cannot run on ``model``, or None."""
    if runs_jit_compiled(model):
        return "the model already runs under jit_compile"
    if batch is None and not rows:
        return "the batch size is not known (DproCallback(batch_size=...)): no batch to probe"
    return None


def _root_probe(model: Any, strategy: Any, batch: Callable[[], Any] | None,
                rows: int | None) -> tuple[Probe, bool] | str:
    """The compile probe of ``<root>`` and whether its phases were told apart (``compile_probe``), or why it was
    skipped."""
    why = _cannot_probe(model, batch, rows)
    if why is not None:
        return why
    try:
        inputs = batch() if batch is not None else symbolic_batch(model, int(rows or 0))
        found = _rows(inputs)
        if found is None:
            return "the batch holds no tensor with a batch dimension"
        return compile_probe(model, inputs, strategy=strategy, rows=found)
    except Exception as err:  # noqa: BLE001 - XLA, the user's model or its data may raise anything: the probe is
        # skipped with a note and the job goes on (dpro never fails a job)
        return error_line(err)


def probe_document(model: Any, *, rank: int, strategy: Any, batch: Callable[[], Any] | None,
                   rows: int | None) -> dict[str, Any]:
    """The probe document (``dpro.probes/1``) of rank ``rank``: the compile probe of ``<root>`` when
    ``$DPRO_PROBE_COMPILE`` asks for it, on ``batch()`` (else ``rows`` samples of the model's symbolic inputs); a
    probe that cannot run is skipped with why."""
    regions = compile_regions_wanted()
    skipped = [{"probe": f"compile {region}", "why": WHOLE_MODEL_ONLY} for region in regions if region != ROOT_MODULE]
    results: list[Probe] = []
    note = NOTE
    if ROOT_MODULE in regions:
        found = _root_probe(model, strategy, batch, rows)
        if isinstance(found, tuple):
            results.append(found[0])
            if not found[1]:
                note += f"; {WHOLE_PASS}"
        else:
            logger.warning("the compile probe was skipped (%s)", found)
            skipped.append({"probe": f"compile {ROOT_MODULE}", "why": found})
    return {"schema": PROBES_SCHEMA, "rank": rank, "batch": results[0].batch if results else rows,
            "probes": [p.to_json() for p in results], "skipped": skipped, "note": note}


def write_probes(run_dir: Path, rank: int, doc: dict[str, Any]) -> None:
    """Write the probe document of ``rank`` (``probes_file``)."""
    path = run_dir / probes_file(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, doc)
