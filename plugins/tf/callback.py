"""``DproCallback``: record a window of ``model.fit`` steps with one Keras callback.

    model.fit(ds, epochs=3, callbacks=[DproCallback(run_dir="runs/x", steps=range(10, 20))])

It serves tf_keras 2.x (``TF_USE_LEGACY_KERAS=1``, the Keras that works with MultiWorkerMirroredStrategy's
``fit`` today) and Keras 3 (``_callback_base``). Steps are counted from 0 over every epoch of the fit. The
recorder is made at ``on_train_begin`` (the workers agree on the run directory there) and writes when the
window ends or the fit ends.

With ``config`` (a path, a ``dpro.config.Config``, or ``"env"`` for ``$DPRO_CONFIG``) the callback applies a
config made by ``dpro optimize`` for this model at the start of the fit, before the first step is traced
(``dpro.plugins.tf.apply``); ``steps=None`` then applies it without recording.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpro.errors import DproError
from dpro.plugins.tf.probes import first_rows
from dpro.plugins.tf.recorder import TFRecorder
from dpro.record.protocol import StepClock

__all__ = ["DproCallback", "StepClockCallback"]


def _callback_base() -> type:
    """tf_keras's ``Callback`` when TensorFlow is told to use the legacy Keras (``TF_USE_LEGACY_KERAS``) or Keras 3
    is missing, else Keras 3's. The two keep ``model`` differently (an attribute, a property), so one class cannot
    subclass both; either one's ``fit`` calls the hooks of the other's callbacks alike."""
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")
    order = ("tf_keras", "keras") if legacy else ("keras", "tf_keras")
    for name in order:
        try:
            return importlib.import_module(name).callbacks.Callback
        except (ImportError, AttributeError):
            continue
    raise ImportError("dpro.plugins.tf.DproCallback needs Keras: install tf_keras or keras")


class DproCallback(_callback_base()):  # type: ignore[misc]
    """Records steps ``steps`` of ``model.fit`` into ``run_dir``.

    Args:
        run_dir: a new or empty directory, or None for ``dpro-runs/<timestamp>`` (worker 0 decides; every worker
            writes its own files there).
        steps: the batches to record, counted from 0 over all epochs (e.g. ``range(10, 20)``; skip the first
            steps, which trace and warm up the function); None records nothing (apply ``config`` only).
        config: a config to apply (path, ``Config``, or ``"env"`` for ``$DPRO_CONFIG``); refused when it was
            made for another model, engine or number of workers, unless ``force``.
        force: apply a config made for another job anyway (with a warning).
        batch_size: the fit's global batch size (what ``fit(batch_size=)`` or the dataset's ``batch()`` gives);
            with it model.json holds each layer's activation bytes and ``dpro optimize --memory-budget`` can
            choose layers to recompute. ``dpro-launch`` finds it from the fit's arguments.
        quiet: a window the recorder refuses (beyond the fit's steps, a used run directory) is said on stderr and
            the fit goes on unrecorded, instead of raising (dpro-launch's auto-attach: dpro never stops a job).
        probe_batch: returns one batch of the model's inputs (the fit's ``x`` for one step, global batch) for the
            compile probe after the window; None: ``batch_size`` samples made from the model's symbolic inputs.
            ``dpro-launch`` passes the fit's first batch.
    """

    def __init__(self, run_dir: str | Path | None = None, steps: Any = range(10, 20), *, config: Any = None,
                 force: bool = False, batch_size: int | None = None, quiet: bool = False,
                 probe_batch: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.probe_batch = probe_batch
        self.quiet = quiet
        self.batch_size = batch_size
        self.run_dir = run_dir
        self.steps = steps
        self.config = config
        self.force = force
        self.applied: dict[str, Any] = {}
        self.recorder: TFRecorder | None = None

    def _apply_config(self) -> None:
        from dpro.plugins.tf.apply import apply_config, load_config

        config = load_config(None if self.config == "env" else self.config, model=self.model, force=self.force)
        if config is not None:
            self.applied = apply_config(self.model, config)

    def on_train_begin(self, logs: Any = None) -> None:
        if self.config is not None and not self.applied:
            self._apply_config()  # before the first step is traced: packing and recompute take effect
        if self.recorder is None and self.steps is not None:
            if self.quiet:
                try:
                    self._start_recorder()
                except DproError as err:  # the same on every worker: none of them records, none waits
                    print(f"[dpro] not recording this fit: {err}", file=sys.stderr, flush=True)
                    self.steps = None
            else:
                self._start_recorder()

    def _start_recorder(self) -> None:
        total = self.params.get("steps") if isinstance(getattr(self, "params", None), dict) else None
        epochs = self.params.get("epochs") if isinstance(getattr(self, "params", None), dict) else None
        replicas = int(getattr(self.model.distribute_strategy, "num_replicas_in_sync", 1) or 1)
        per_worker = -(-self.batch_size // replicas) if self.batch_size else None
        batch = self.probe_batch
        if batch is not None and per_worker is not None and replicas > 1:  # the global batch, one worker's share
            batch = functools.partial(first_rows, batch, per_worker)
        self.recorder = TFRecorder(self.model, self.run_dir, self.steps, who="dpro.plugins.tf.DproCallback",
                                   total_steps=total * epochs if total and epochs else None, batch_size=per_worker,
                                   probe_batch=batch)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.recorder is not None:
            self.recorder.begin_step()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.recorder is not None:
            self.recorder.end_step()

    def on_train_end(self, logs: Any = None) -> None:
        if self.recorder is not None:
            self.recorder.close()


class StepClockCallback(_callback_base()):  # type: ignore[misc]
    """Times the end of every batch of ``model.fit`` into ``path`` (``dpro.record.protocol.StepClock``): an
    unrecorded job's steps, which benches compare a recorded one against (``$DPRO_STEP_TIMES`` under dpro-launch's
    auto-attach)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.clock = StepClock(path)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.clock.step_ended()

    def on_train_end(self, logs: Any = None) -> None:
        self.clock.write()
