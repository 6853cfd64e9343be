"""Apply a dpro config to a TensorFlow job: the ``tf-mwms`` knobs of ``dpro.config.knob_table()``.

- ``tf.mwms.bytes_per_pack`` and ``tf.mwms.implementation``: the strategy's
  ``tf.distribute.experimental.CommunicationOptions``. MultiWorkerMirroredStrategy merges the options it was
  built with into every collective it launches, so they can be set on a strategy built without them, as long
  as it is before the first step is traced (``apply_to_strategy``; ``DproCallback(config=...)`` and
  ``dpro-launch --apply`` do it at the start of ``fit``).
- ``recompute``: the listed layers (dotted paths, ``block1`` or ``encoder.block2``) run their forward again in
  the backward instead of keeping their inner activations: their ``call`` is wrapped in ``tf.recompute_grad``
  (tf_keras) or ``keras.remat`` (Keras 3) before the first step is traced (``apply_recompute``). A layer's
  output is kept either way, so checkpointing a layer without sublayers saves little: the search picks blocks.
- ``compile``: ``<root>`` (Keras compiles its whole train function; other paths are not applied, with a warning):
  ``model.jit_compile = True`` and the train function built again (``apply_compile``), so that ``fit`` runs its
  train step under XLA. When the first step fails to compile, the train function is built again without XLA and
  that call retried on the next batch (a warning says so); a model Keras says cannot be compiled is left as it is.

A custom loop::

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model()
    config = load_config(model=model)          # $DPRO_CONFIG, or None; refuses a config made for another job
    if config is not None:
        apply_config(model, config, strategy)  # before the first strategy.run of the training function

or, building the strategy yourself: ``MultiWorkerMirroredStrategy(communication_options=
communication_options(config))``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import tensorflow as tf

from dpro.config import DPRO_CONFIG, Config, check_fingerprint, read_config
from dpro.engines.horovod.knobs import NAME as HOROVOD_ENGINE  # hvd.keras jobs
from dpro.engines.tf_mwms import NAME as ENGINE
from dpro.errors import ConfigError, UsageError
from dpro.logs import get_logger
from dpro.plugins.tf.probes import error_line
from dpro.plugins.tf.recorder import gradient_fingerprint, is_mwms, layer_paths, model_layout
from dpro.plugins.tf.transport import horovod_running, horovod_size, tf_config
from dpro.record.trace import ROOT_MODULE

__all__ = ["ENGINE", "FRAMEWORK", "apply_compile", "apply_config", "apply_recompute", "apply_to_strategy",
           "communication_options", "fingerprint", "job_engine", "load_config"]

logger = get_logger("dpro.plugins.tf")

FRAMEWORK = "tf"
SINGLE_WORKER_ENGINE = "tf"  # what the recorder writes for one worker (no collective to tune)
BYTES_PER_PACK, IMPLEMENTATION = "tf.mwms.bytes_per_pack", "tf.mwms.implementation"
RECOMPUTE = "recompute"
COMPILE = "compile"
APPLIED_ELSEWHERE = ("env",)  # set by dpro-launch before the workers start


def fingerprint(model: Any) -> str:
    """The model hash dpro records in run.json for a Keras model (``TFRecorder.fingerprint``)."""
    return gradient_fingerprint(model_layout(model)[1])


def job_engine(workers: int) -> str:
    """The engine a run of this job records, which its configs name: ``horovod`` in a Horovod job, MWMS with
    several TF_CONFIG workers, else ``tf``."""
    if horovod_running():
        return HOROVOD_ENGINE
    return ENGINE if workers > 1 else SINGLE_WORKER_ENGINE


def world_size() -> int:
    """The number of workers: Horovod's ranks in a Horovod job, else those ``TF_CONFIG`` names (1 without one)."""
    if horovod_running():
        return horovod_size(os.environ)
    workers, _ = tf_config()
    return max(1, len(workers))


def load_config(path: str | Path | Config | None = None, *, model: Any, workers: int | None = None,
                force: bool = False) -> Config | None:
    """Read the config to apply to this job and check that it was made for it.

    Args:
        path: the config file (or a ``Config`` already read); None reads ``$DPRO_CONFIG`` (set by
            ``dpro-launch --apply``).
        model: the Keras model the config will be applied to.
        workers: this job's number of workers; None counts ``TF_CONFIG``'s.
        force: apply a config made for another job anyway (a warning lists what differs).

    Returns:
        The config, or None when no path is given and ``$DPRO_CONFIG`` is unset or empty.

    Raises:
        ConfigError: the file is not a valid config, or its fingerprint (framework "tf", engine ``job_engine``, world
            size, model hash) does not match the job and ``force`` is False.
    """
    if path is None:
        path = os.environ.get(DPRO_CONFIG) or None
        if path is None:
            return None
    config = path if isinstance(path, Config) else read_config(path)
    workers = world_size() if workers is None else workers
    mismatches = check_fingerprint(config, framework=FRAMEWORK, engine=job_engine(workers), world_size=workers,
                                   model=fingerprint(model), force=force)
    if mismatches:
        warnings.warn(f"dpro: applying {config.source} although it was made for another job (force=True): "
                      + "; ".join(mismatches), stacklevel=2)
    return config


def communication_options(config: Config) -> Any:
    """The ``tf.distribute.experimental.CommunicationOptions`` a config asks for (fields it leaves out keep
    TensorFlow's defaults)."""
    kwargs: dict[str, Any] = {}
    knobs = config.knobs
    if BYTES_PER_PACK in knobs:
        kwargs["bytes_per_pack"] = int(knobs[BYTES_PER_PACK])
    if IMPLEMENTATION in knobs:
        kwargs["implementation"] = getattr(tf.distribute.experimental.CommunicationImplementation,
                                           str(knobs[IMPLEMENTATION]))
    return tf.distribute.experimental.CommunicationOptions(**kwargs)


def apply_to_strategy(strategy: Any, config: Config) -> dict[str, Any]:
    """Put the config's communication options on a MultiWorkerMirroredStrategy, over the ones it was built with.

    Call it before the training function's first step (TensorFlow reads the options when it traces the step).

    Returns:
        The knobs set, e.g. ``{"tf.mwms.bytes_per_pack": 4194304}`` (empty when the config sets none).

    Raises:
        UsageError: the config sets MWMS knobs and ``strategy`` is not a MultiWorkerMirroredStrategy.
    """
    wanted = {k: v for k, v in config.knobs.items() if k in (BYTES_PER_PACK, IMPLEMENTATION)}
    if not wanted:
        return {}
    if not is_mwms(strategy):
        raise UsageError(f"{config.source}: {', '.join(sorted(wanted))} apply to a MultiWorkerMirroredStrategy; "
                         f"this job's strategy is {type(strategy).__name__}")
    extended = strategy.extended
    current = getattr(extended, "_communication_options", None)
    if current is None:  # a TensorFlow whose MWMS keeps its options elsewhere: refuse rather than ignore
        raise ConfigError(config.source, f"TensorFlow {tf.__version__}'s MultiWorkerMirroredStrategy does not "
                          "take communication options after construction; pass communication_options(config) "
                          "to its constructor")
    extended._communication_options = current.merge(communication_options(config))
    return wanted


def apply_recompute(model: Any, modules: list[str], source: str = "config") -> list[str]:
    """Make the layers at ``modules`` (dotted paths from ``model``) recompute their forward in the backward.

    Call it before the training function is first traced (a traced function keeps the layers as they were).

    Returns:
        The paths wrapped (those already wrapped are not wrapped twice).

    Raises:
        ConfigError: a path names no layer of ``model``.
    """
    by_path = {path: layer for layer, path, _ in layer_paths(model)}
    unknown = [m for m in modules if m not in by_path]
    if unknown:
        raise ConfigError(source, f"recompute names no layer of model {model.name!r}: {', '.join(unknown)} "
                          f"(its layers: {', '.join(sorted(by_path)[:12])})", RECOMPUTE)
    done = []
    for path in modules:
        layer = by_path[path]
        if not getattr(layer.call, "_dpro_recompute", False):
            layer.call = _recomputed(layer)
        done.append(path)
    return done


def _recomputed(layer: Any) -> Any:
    """``layer.call`` recomputed in the backward: ``keras.remat`` for a Keras 3 layer, ``tf.recompute_grad``
    for tf_keras. Both take tensors only, so the call's other arguments (``training``, ``mask``) are closed over."""
    original = layer.call
    keras3 = type(layer).__module__.startswith("keras.")
    if keras3:
        import keras

        checkpoint = keras.remat
    else:
        checkpoint = tf.recompute_grad

    def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(lambda x: original(x, *args, **kwargs))(inputs)

    call._dpro_recompute = True  # type: ignore[attr-defined]
    return call


def apply_compile(model: Any, regions: list[str], source: str = "config") -> list[str]:
    """Run ``model``'s train step under XLA when ``regions`` holds ``<root>``: ``model.jit_compile = True`` and its
    train function built again (``fit`` builds it before the callbacks' ``on_train_begin``), guarded so that a
    first step XLA cannot compile falls back to the train function without XLA (``_falling_back``). Other paths are
    not applied (a warning): Keras compiles the whole train function or nothing.

    Returns:
        ``["<root>"]`` when the train function now runs under XLA, else ``[]`` (Keras refused: a layer that does not
        support it, ``run_eagerly``).
    """
    parts = [r for r in regions if r != ROOT_MODULE]
    if parts:
        warnings.warn(f"dpro: {source}: compile={','.join(parts)} is not applied: Keras compiles its whole train "
                      f"function (jit_compile), so only {ROOT_MODULE} is", stacklevel=2)
    if ROOT_MODULE not in regions:
        return []
    if getattr(model, "run_eagerly", False):
        warnings.warn(f"dpro: {source}: compile={ROOT_MODULE} is not applied: the model runs eagerly "
                      "(run_eagerly=True), which Keras does not compile", stacklevel=2)
        return []
    try:
        model.jit_compile = True  # Keras sets False, with its own warning, when a layer does not support XLA
        if not model.jit_compile:
            return []
        model.make_train_function(force=True)
        model.train_function = _falling_back(model, model.train_function, source)
    except (AttributeError, TypeError, ValueError) as err:  # a model without Keras's trainer: it runs as it was
        warnings.warn(f"dpro: {source}: compile={ROOT_MODULE} is not applied ({type(err).__name__}: {err})",
                      stacklevel=2)
        return []
    return [ROOT_MODULE]


def _falling_back(model: Any, train_function: Any, source: str) -> Any:
    """``train_function`` whose first call, where XLA compiles the step, falls back on failure: jit_compile off, the
    train function built again without it and called on the same iterator (the failed call may have taken a batch).
    An error of the step itself fails again without XLA and reaches the user as it would have."""
    state = {"function": train_function, "checked": False}

    def train(iterator: Any) -> Any:
        if state["checked"]:
            return state["function"](iterator)
        state["checked"] = True
        try:
            return train_function(iterator)
        except (tf.errors.OpError, ValueError, TypeError, NotImplementedError) as err:
            logger.warning("%s: the train step did not compile under XLA (%s); it runs without jit_compile",
                           source, error_line(err))
            model.jit_compile = False
            model.make_train_function(force=True)
            state["function"] = model.train_function
            return state["function"](iterator)

    return train


def apply_config(model: Any, config: Config, strategy: Any = None) -> dict[str, Any]:
    """Everything of a config the TensorFlow plugin applies: the strategy's communication options
    (``apply_to_strategy``, on ``strategy`` or the model's), ``recompute`` (``apply_recompute``) and ``compile``
    (``apply_compile``). Knobs it does not apply are named in a warning. Call it before the first step is traced.

    Returns:
        The knobs applied, e.g. ``{"tf.mwms.bytes_per_pack": 4194304, "recompute": ["block1"]}``.
    """
    unapplied = sorted(k for k, v in config.knobs.items()
                       if k not in (BYTES_PER_PACK, IMPLEMENTATION, RECOMPUTE, COMPILE) and k not in APPLIED_ELSEWHERE
                       and v)
    if unapplied:
        warnings.warn(f"dpro: {config.source}: the TensorFlow plugin does not apply {', '.join(unapplied)} yet; "
                      "they are ignored", stacklevel=2)
    applied = apply_to_strategy(strategy if strategy is not None else model.distribute_strategy, config)
    modules = config.knobs.get(RECOMPUTE) or []
    if modules:
        applied[RECOMPUTE] = apply_recompute(model, list(modules), config.source)
    regions = config.knobs.get(COMPILE) or []
    if regions and apply_compile(model, list(regions), config.source):
        applied[COMPILE] = [ROOT_MODULE]
    return applied
