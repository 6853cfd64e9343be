"""Record an unmodified Gluon script started by ``dpro-launch`` (``DPRO_AUTO_RECORD=1``), and apply a config to it
(``$DPRO_CONFIG``: ``--apply FILE``; ``$DPRO_APPLY_SEARCH``: ``--apply auto``, the newest config made for this net,
engine and number of workers under it).

``dpro-launch``'s ``sitecustomize`` calls ``install(when_imported)`` at interpreter start when MXNet is installed.
``install`` imports nothing: it registers ``PATCHES``, which run when the script imports ``mxnet.gluon``:

- ``Block.__call__`` remembers, until the first ``Trainer.step``, the last outermost block called that holds
  parameters (the network; a loss block holds none);
- ``Trainer.step``, at the first call of the process, applies the config's ``compile`` to that network
  (``dpro.plugins.mxnet.apply``: the blocks hybridized with ``static_alloc``, from the next step on), then attaches
  a ``GluonRecorder`` for the network and the trainer (writing ``$DPRO_RUN_DIR`` for the steps ``$DPRO_PROFILE``,
  "10:20"), and marks the end of every iteration after it. A trainer whose network cannot be told (no block with
  its parameters was called) is neither configured nor recorded, with a note. A config that does not fit the job
  is not applied, with a note (the torch plugin stops such a job; here nothing may raise into the script).

Only in worker processes (``DMLC_ROLE`` unset or ``worker``): in the scheduler and the servers ``import mxnet``
serves the job and never returns. Nothing here raises into the user's program: a failure to attach is printed and
ignored.
"""

from __future__ import annotations

import atexit
import functools
import os
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from dpro.record import job_env

__all__ = ["PATCHES", "install"]

AUTO_RECORD, PROFILE, RUN_DIR = job_env.AUTO_RECORD, job_env.PROFILE, job_env.RUN_DIR
CONFIG, APPLY_SEARCH, FORCE = job_env.CONFIG, job_env.APPLY_SEARCH, job_env.FORCE
_STATE: dict[str, Any] = {"installed": False, "attached": False, "stepped": False, "root": None, "depth": 0}


def _window(text: str | None) -> list[int]:
    from dpro.record.protocol import window_steps

    return window_steps(text, job_env.say)


def _wrap_call(block_class: type) -> None:
    original = block_class.__call__
    if getattr(original, "_dpro_patched", False):
        return

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _STATE["stepped"]:
            return original(self, *args, **kwargs)
        outermost = _STATE["depth"] == 0
        _STATE["depth"] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _STATE["depth"] -= 1
            if outermost and getattr(self, "_reg_params", None) is not None:
                try:
                    if self.collect_params().keys():
                        _STATE["root"] = weakref.ref(self)
                except Exception:  # noqa: BLE001 - a block we cannot ask is not the network
                    pass

    __call__._dpro_patched = True  # type: ignore[attr-defined]
    block_class.__call__ = __call__


def _network(trainer: Any) -> Any:
    """The network last called before the first ``trainer.step`` that holds the trainer's parameters, or None."""
    root = _STATE["root"]() if _STATE["root"] is not None else None
    trained = {id(p) for p in getattr(trainer, "_params", [])}
    if root is None or not trained & {id(p) for p in root.collect_params().values()}:
        return None
    return root


def _first_worker(trainer: Any) -> bool:
    """Users hear from worker 0 (a trainer whose kvstore is not created yet cannot tell: every worker says it)."""
    kv = getattr(trainer, "_kvstore", None) or (getattr(trainer, "_kvstore_params", None) or {}).get("kvstore")
    return getattr(kv, "rank", 0) == 0


def _config_path(net: Any, trainer: Any) -> str | None:
    """The config to apply: ``$DPRO_CONFIG``, or the one ``--apply auto`` finds for this net and trainer."""
    path = os.environ.get(CONFIG) or None
    search = os.environ.get(APPLY_SEARCH) or None
    if path is not None or search is None:
        return path
    from dpro.config import find_config
    from dpro.plugins.mxnet.apply import FRAMEWORK, fingerprint, job_engine, world_size

    wanted = {"framework": FRAMEWORK, "engine": job_engine(trainer), "world_size": world_size(trainer),
              "model": fingerprint(net, trainer)}
    found = find_config(search, wanted)
    if found is None and _first_worker(trainer):
        job_env.say(f"--apply auto: no config made for this job ({wanted['world_size']} workers, model "
                    f"{wanted['model'][:12]}) under {search}; running without one")
    return None if found is None else str(found)


def _apply_config(trainer: Any) -> None:
    """Apply the job's config (if any) to the network, at the process's first ``Trainer.step``; a config that
    cannot be applied is told and left out."""
    if not (os.environ.get(CONFIG) or os.environ.get(APPLY_SEARCH)):
        return
    net = _network(trainer)
    if net is None:
        job_env.say("not applying the config: no network holding this trainer's parameters was called before "
                    "trainer.step()")
        return
    path = _config_path(net, trainer)
    if path is None:
        return
    from dpro.plugins.mxnet.apply import apply, load_config

    try:
        config = load_config(path, net=net, trainer=trainer, force=os.environ.get(FORCE) == "1")
        left = apply(net, config) if config is not None else []
    except Exception as err:  # noqa: BLE001 - a config that does not fit must not stop the user's training
        job_env.say(f"not applying {path}: {type(err).__name__}: {err}")
        return
    if _first_worker(trainer):
        compiled = config.knobs.get("compile") or []
        job_env.say(f"applying {path}: " + (f"hybridized {', '.join(compiled)} (static_alloc)" if compiled else
                                             "nothing for the MXNet plugin beyond the launcher's env")
                    + (f"; not applied to MXNet jobs: {', '.join(left)}" if left else ""))


def _attach(trainer: Any) -> Any:
    """A recorder for ``trainer`` and the network last called, at the process's first ``Trainer.step``."""
    if _STATE["attached"]:
        return None
    _STATE["attached"] = True
    root = _network(trainer)
    if root is None:
        job_env.say("not recording: no network holding this trainer's parameters was called before trainer.step()")
        return None
    from dpro.plugins.mxnet.recorder import GluonRecorder, active_recorders

    if any(r.trainer is trainer for r in active_recorders()):
        return None  # the script records itself (dpro.plugins.mxnet.Profiler): once is enough
    recorder = GluonRecorder(root, trainer, os.environ.get(RUN_DIR) or None, _window(os.environ.get(PROFILE)),
                             who="dpro-launch (auto-attach)")
    atexit.register(_close_at_exit, weakref.ref(recorder))
    return recorder


def _close_at_exit(ref: Any) -> None:
    """A script that ends inside the window still leaves its rank file (the steps it finished)."""
    recorder = ref()
    if recorder is not None:
        try:
            recorder.close(error=None)
        except Exception as err:  # noqa: BLE001 - at exit: report, do not raise
            job_env.say(f"could not finish the recording: {type(err).__name__}: {err}")


def _wrap_step(trainer_class: type) -> None:
    original = trainer_class.step
    if getattr(original, "_dpro_patched", False):
        return

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = getattr(self, "_dpro_recorder", None)
        if not _STATE["stepped"]:
            _STATE["stepped"] = True
            try:
                _apply_config(self)
            except Exception as err:  # noqa: BLE001 - applying must never stop the user's training
                job_env.say(f"not applying the config: {type(err).__name__}: {err}")
        if recorder is None and not _STATE["attached"] and os.environ.get(AUTO_RECORD) == "1":
            try:
                recorder = _attach(self)
                if recorder is not None:
                    self._dpro_recorder = recorder
                    recorder.begin_step()
            except Exception as err:  # noqa: BLE001 - recording must never stop the user's training
                job_env.say(f"not recording: {type(err).__name__}: {err}")
                recorder = None
        out = original(self, *args, **kwargs)
        if recorder is not None:
            try:
                recorder.end_step()
                recorder.begin_step()
            except Exception as err:  # noqa: BLE001 - recording must never stop the user's training
                job_env.say(f"recording stopped: {type(err).__name__}: {err}")
                self._dpro_recorder = None
                try:
                    recorder.close(error=err)
                except Exception:  # noqa: BLE001 - what could be written was
                    pass
        return out

    step._dpro_patched = True  # type: ignore[attr-defined]
    trainer_class.step = step


def _patch_block(module: ModuleType) -> None:
    _wrap_call(module.Block)


def _patch_trainer(module: ModuleType) -> None:
    _wrap_step(module.Trainer)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "mxnet.gluon.block": _patch_block,
    "mxnet.gluon.trainer": _patch_trainer,
}


def install(when_imported: Callable[[str, Callable[[ModuleType], None]], None]) -> None:
    """Register the patches (once per process, in workers only, when the job records or applies a config) with
    dpro-launch's post-import hook."""
    wanted = os.environ.get(AUTO_RECORD) == "1" or os.environ.get(CONFIG) or os.environ.get(APPLY_SEARCH)
    if _STATE["installed"] or not wanted:
        return
    if os.environ.get("DMLC_ROLE", "worker") != "worker":
        return
    _STATE["installed"] = True
    for module_name, patch in PATCHES.items():
        when_imported(module_name, patch)
