"""Apply a dpro config to a TensorFlow job: the ``tf-mwms`` knobs of ``dpro.config.knob_table()``.

- ``tf.mwms.bytes_per_pack`` and ``tf.mwms.implementation``: the strategy's
  ``tf.distribute.experimental.CommunicationOptions``. MultiWorkerMirroredStrategy merges the options it was
  built with into every collective it launches, so they can be set on a strategy built without them, as long
  as it is before the first step is traced (``apply_to_strategy``; ``DproCallback(config=...)`` and
  ``dpro-launch --apply`` do it at the start of ``fit``).

A custom loop::

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model()
    config = load_config(model=model)          # $DPRO_CONFIG, or None; refuses a config made for another job
    if config is not None:
        apply_to_strategy(strategy, config)    # before the first strategy.run of the training function

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
from dpro.errors import ConfigError, UsageError
from dpro.plugins.tf.recorder import gradient_fingerprint, is_mwms, model_layout
from dpro.plugins.tf.transport import tf_config

__all__ = ["ENGINE", "FRAMEWORK", "apply_to_strategy", "communication_options", "fingerprint", "load_config"]

FRAMEWORK = "tf"
ENGINE = "tf-mwms"
BYTES_PER_PACK, IMPLEMENTATION = "tf.mwms.bytes_per_pack", "tf.mwms.implementation"
APPLIED_ELSEWHERE = ("env",)  # set by dpro-launch before the workers start


def fingerprint(model: Any) -> str:
    """The model hash dpro records in run.json for a Keras model (``TFRecorder.fingerprint``)."""
    return gradient_fingerprint(model_layout(model)[1])


def world_size() -> int:
    """The number of workers ``TF_CONFIG`` names (1 without one)."""
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
        ConfigError: the file is not a valid config, or its fingerprint (framework "tf", engine "tf-mwms", world
            size, model hash) does not match the job and ``force`` is False.
    """
    if path is None:
        path = os.environ.get(DPRO_CONFIG) or None
        if path is None:
            return None
    config = path if isinstance(path, Config) else read_config(path)
    mismatches = check_fingerprint(config, framework=FRAMEWORK, engine=ENGINE,
                                   world_size=world_size() if workers is None else workers,
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
    unapplied = sorted(k for k, v in config.knobs.items() if k not in wanted and k not in APPLIED_ELSEWHERE and v)
    if unapplied:
        warnings.warn(f"dpro: {config.source}: the TensorFlow plugin does not apply {', '.join(unapplied)} yet; "
                      "they are ignored", stacklevel=2)
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
