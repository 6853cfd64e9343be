"""Record an unmodified Keras script started by ``dpro-launch`` (``DPRO_AUTO_RECORD=1``).

``dpro-launch``'s ``sitecustomize`` calls ``install(when_imported)`` at interpreter start when TensorFlow is
installed. ``install`` imports nothing: it registers ``PATCHES``, which wrap ``Model.fit`` of tf_keras
(``tf_keras.src.engine.training``) and of Keras 3's TensorFlow trainer (``keras.src.backend.tensorflow.trainer``)
when the script imports them. The first ``fit`` of the process gets a ``DproCallback`` writing ``$DPRO_RUN_DIR``
for the steps ``$DPRO_PROFILE`` ("10:20"), unless its callbacks already hold one (a script that records itself
is recorded once). With ``$DPRO_CONFIG`` (``dpro-launch --apply FILE``) or ``$DPRO_APPLY_SEARCH`` (``--apply auto``:
the newest config made for this model, engine and number of workers under it) the first fit gets the config's
communication options, recomputed layers and ``jit_compile`` first (``dpro.plugins.tf.apply``). The fit's batch size
(``fit_batch_size``) gives the recorder each layer's activation bytes, and its first batch (``fit_probe_batch``, read
after the window) the compile probe's inputs. Nothing here raises into the user's
program: a failure to patch is printed and ignored; a config that does not fit the job stops it, as the torch
plugin does. With ``$DPRO_STEP_TIMES`` (benches), worker 0's first fit also times the end of each batch there
(``StepClockCallback``), recorded or not.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from dpro.record import job_env

__all__ = ["PATCHES", "install"]

AUTO_RECORD, PROFILE, RUN_DIR = job_env.AUTO_RECORD, job_env.PROFILE, job_env.RUN_DIR
CONFIG, APPLY_SEARCH, FORCE = job_env.CONFIG, job_env.APPLY_SEARCH, job_env.FORCE
STEP_TIMES = job_env.STEP_TIMES
_STATE = {"installed": False, "attached": False, "configured": False, "clocked": False}


def _window(text: str | None) -> list[int]:
    from dpro.record.protocol import window_steps

    return window_steps(text, job_env.say)


def _config_path(model: Any) -> str | None:
    """The config to apply to the first fit: ``$DPRO_CONFIG``, or the one ``--apply auto`` finds for ``model``."""
    path = os.environ.get(CONFIG) or None
    search = os.environ.get(APPLY_SEARCH) or None
    if path is not None or search is None:
        return path
    from dpro.config import find_config
    from dpro.plugins.tf.apply import FRAMEWORK, fingerprint, job_engine, world_size

    workers = world_size()
    wanted = {"framework": FRAMEWORK, "engine": job_engine(workers), "world_size": workers,
              "model": fingerprint(model)}
    found = find_config(search, wanted)
    if found is None:
        job_env.say(f"--apply auto: no config made for this job ({wanted['world_size']} workers, model "
             f"{wanted['model'][:12]}) under {search}; running without one")
        return None
    return str(found)


def _apply_config(model: Any) -> None:
    """Apply the job's config (if any) to ``model``'s strategy, once per process."""
    if _STATE["configured"]:
        return
    _STATE["configured"] = True
    path = _config_path(model)
    if path is None:
        return
    from dpro.plugins.tf.apply import apply_config, load_config

    config = load_config(path, model=model, force=os.environ.get(FORCE) == "1")
    applied = apply_config(model, config) if config is not None else {}
    from dpro.plugins.tf.transport import horovod_running, tf_config

    first = os.environ.get("HOROVOD_RANK", "0") == "0" if horovod_running() else tf_config()[1] == 0
    if first:  # users hear it from worker 0
        job_env.say(f"applying {path}: "
                    + (", ".join(f"{k}={v}" for k, v in applied.items()) or "nothing for TensorFlow"))


def fit_batch_size(arguments: dict[str, Any]) -> int | None:
    """The global batch size of a ``fit`` call from its arguments: ``batch_size``, else a ``tf.data`` dataset's
    batch (its static shape, or the first batch of a fresh iterator over it: the fit's own iterator is not
    touched), else Keras's default of 32 for arrays; None when it cannot be told (a generator, a Sequence)."""
    if isinstance(arguments.get("batch_size"), int):
        return arguments["batch_size"]
    x = arguments.get("x")
    if x is None:
        return None
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        specs = tf.nest.flatten(x.element_spec)
        static = specs[0].shape[0] if specs and getattr(specs[0], "shape", None) is not None and \
            len(specs[0].shape) else None
        if static is not None:
            return int(static)
        try:
            first = tf.nest.flatten(next(iter(x.take(1))))
        except (StopIteration, TypeError, ValueError, tf.errors.OpError):
            return None
        return int(first[0].shape[0]) if first and len(first[0].shape) else None
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # an array (numpy, a tensor)
        return 32
    return None


def fit_probe_batch(arguments: dict[str, Any], batch_size: int | None) -> Callable[[], Any] | None:
    """A function returning the inputs of the fit's first batch (for the compile probe after the window; called only
    then): a ``tf.data`` dataset's first element from a fresh iterator (its inputs: the first of an (x, y[, weight])
    tuple), or the first ``batch_size`` rows of array inputs; None when there is neither."""
    x = arguments.get("x")
    if x is None:
        return None
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        def first_element() -> Any:
            element = next(iter(x.take(1)))
            return element[0] if isinstance(element, tuple) and 1 <= len(element) <= 3 else element

        return first_element
    arrays = tf.nest.flatten(x)
    if batch_size and arrays and all(hasattr(a, "shape") and hasattr(a, "dtype") for a in arrays):
        return lambda: tf.nest.map_structure(lambda a: tf.convert_to_tensor(a[:batch_size]), x)
    return None


def _with_step_clock(callbacks: Any) -> Any:
    """``callbacks`` plus, with ``$DPRO_STEP_TIMES`` on worker 0, a ``StepClockCallback`` for the first fit."""
    path = os.environ.get(STEP_TIMES)
    if not path or _STATE["clocked"] or _rank() != 0:
        return callbacks
    from dpro.plugins.tf.callback import StepClockCallback

    _STATE["clocked"] = True
    return [*list(callbacks or []), StepClockCallback(path)]


def _rank() -> int:
    """This worker's rank: Horovod's, else its ``TF_CONFIG`` task index, else 0."""
    if os.environ.get("HOROVOD_RANK"):
        return int(os.environ["HOROVOD_RANK"])
    try:
        return int(json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {}).get("index", 0))
    except (ValueError, AttributeError):
        return 0


def _with_recorder(callbacks: Any, batch_size: int | None = None,
                   probe_batch: Callable[[], Any] | None = None) -> Any:
    """``callbacks`` plus a ``DproCallback`` for the first fit of the process (none if it already has one)."""
    from dpro.plugins.tf.callback import DproCallback

    listed = list(callbacks or [])
    if os.environ.get(AUTO_RECORD) != "1" or _STATE["attached"] or any(isinstance(cb, DproCallback)
                                                                        for cb in listed):
        return callbacks
    _STATE["attached"] = True
    return [*listed, DproCallback(run_dir=os.environ.get(RUN_DIR) or None, steps=_window(os.environ.get(PROFILE)),
                                  batch_size=batch_size, quiet=True, probe_batch=probe_batch)]


def _wrap_fit(owner: type) -> None:
    original = owner.fit
    if getattr(original, "_dpro_patched", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        _apply_config(self)  # a config made for another job stops the job (ConfigError), as in torch
        try:
            bound = signature.bind_partial(self, *args, **kwargs)
            recording = os.environ.get(AUTO_RECORD) == "1"
            batch = fit_batch_size(bound.arguments) if recording else None
            probe_batch = fit_probe_batch(bound.arguments, batch) if recording else None
            bound.arguments["callbacks"] = _with_step_clock(_with_recorder(bound.arguments.get("callbacks"), batch,
                                                                           probe_batch))
            args, kwargs = bound.args[1:], bound.kwargs
        except Exception as err:  # noqa: BLE001 - recording must never stop the user's fit
            job_env.say(f"not recording this fit: {type(err).__name__}: {err}")
        return original(self, *args, **kwargs)

    fit._dpro_patched = True  # type: ignore[attr-defined]
    owner.fit = fit


def _patch_tf_keras(module: ModuleType) -> None:
    _wrap_fit(module.Model)


def _patch_keras3(module: ModuleType) -> None:
    _wrap_fit(module.TensorFlowTrainer)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "tf_keras.src.engine.training": _patch_tf_keras,
    "keras.src.backend.tensorflow.trainer": _patch_keras3,
}


def install(when_imported: Callable[[str, Callable[[ModuleType], None]], None]) -> None:
    """Register the patches (once per process) with dpro-launch's post-import hook; only when recording or
    applying a config."""
    wanted = os.environ.get(AUTO_RECORD) == "1" or os.environ.get(CONFIG) or os.environ.get(APPLY_SEARCH) or \
        os.environ.get(STEP_TIMES)
    if _STATE["installed"] or not wanted:
        return
    _STATE["installed"] = True
    for module_name, patch in PATCHES.items():
        when_imported(module_name, patch)
