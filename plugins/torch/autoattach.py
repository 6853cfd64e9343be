"""Record (and configure) an unmodified PyTorch script started by ``dpro-launch``.

``dpro-launch`` puts ``dpro/launch/autoattach`` first on ``PYTHONPATH``; its ``sitecustomize.py`` calls
``install(when_imported)`` at interpreter start when torch is installed, with the post-import hook of
``dpro.launch.post_import``. ``install`` imports nothing heavy: it registers ``PATCHES``, which patch, when
(and if) the script imports them,

- ``torch.nn.parallel.DistributedDataParallel.__init__``: before DDP wraps the model, the config named by
  ``$DPRO_CONFIG`` (or the newest config made for this model under ``$DPRO_APPLY_SEARCH``) is applied:
  recomputation on the module and its bucket sizes in DDP's arguments (``dpro.plugins.torch.apply``); after,
  its gradient compression. The first DDP model also registers a global optimizer step hook
  (``torch.optim.optimizer.register_optimizer_step_post_hook``).
- at the end of the first optimizer step of an optimizer that owns a DDP model's parameters, a
  ``TorchRecorder`` is attached to that model and optimizer (one optimizer step = one iteration; iteration 0
  has just ended, so the window starts at 1 or later) writing ``$DPRO_RUN_DIR``, window ``$DPRO_PROFILE``
  ("10:20"). A script that records itself (``Profiler`` or ``DproCallback``: a recorder is active then) is
  left alone, and rank 0 leaves a note in ``$DPRO_RUN_DIR/recorded-elsewhere.json`` naming where it recorded.
- FSDP2's ``fully_shard`` (``torch.distributed.fsdp``): each sharded module is noted, with the
  ``reshard_after_forward`` it was given; a config of engine ``torch-fsdp`` (``$DPRO_CONFIG``) sets its
  ``torch.fsdp.reshard_after_forward`` where the script passes none (where it passes one, the config is not
  applied there, and rank 0 says so). At the end of the first optimizer step of an optimizer updating a sharded
  model (no DDP model), an ``FsdpRecorder`` (``dpro.plugins.torch.fsdp``) records the window with the profiler.
- ``transformers.Trainer.__init__``: a config's ``micro_batches`` k becomes the Trainer's own accumulation
  (``per_device_train_batch_size / k``, ``gradient_accumulation_steps * k``: ``transformers_callback.accumulate``).
  A plain DDP loop cannot be split from outside: rank 0 says what code change it takes
  (``apply.micro_batches_change``) when the config reaches its DDP model.
- Lightning's ``Trainer.__init__`` (``lightning.pytorch`` and ``pytorch_lightning``): a ``DproCallback`` is
  added unless the callbacks hold one; it records and applies the config itself.
- Horovod's ``horovod.torch.DistributedOptimizer`` (the factory; same signature and result): the optimizer
  it returns gets a ``HorovodRecorder`` (``dpro.plugins.torch.horovod``) at the end of its first step, as
  above (one ``step()`` of the Horovod optimizer = one iteration; torch's step hooks fire once per class
  level of Horovod's optimizer, so nested calls are counted once). With ``$DPRO_CONFIG`` (or a config
  made for this model and engine ``horovod`` under ``$DPRO_APPLY_SEARCH``) its ``recompute`` is applied to
  the model and its ``tensor_groups`` become ``groups=`` (unless the script passes ``groups``/
  ``num_groups``); its ``env`` knobs (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``) were set by
  the launcher. Horovod knows no model, only parameters, so the model is found (``owning_model``) as
  the ``nn.Module`` instances alive in the process (``gc.get_objects()``) that hold the optimizer's
  first parameter, walked up through their parents to the outermost one whose trainable parameters
  are all in the optimizer; a module whose ``named_parameters()`` equal the ``named_parameters=`` given
  to Horovod (names and tensors) is taken first. Limits: the model must be an ``nn.Module`` alive when
  the optimizer is built; parameters of the optimizer outside that module (e.g. a loss module's) are
  allreduced but not attributed to a layer; a parameter shared by two unrelated models picks the
  larger; with several Horovod optimizers the first one to finish a step is recorded.

``$DPRO_MECHANISMS`` (comma-separated, e.g. ``forward,backward,grad_ready,update``) narrows what the recorder
hooks (``dpro.plugins.torch.recorder.MECHANISMS``), for benches that price each mechanism; unset, all of them.

Step clock: with ``$DPRO_STEP_TIMES`` set to a file, rank 0 writes there (at exit, and every 25 steps) the
wall-clock time (``time.time()``) at the end of each ``step()`` of the script's ``hvd.DistributedOptimizer``
(outermost call only) and the process's CPU time then (``time.process_time()``) as JSON
``{"rank": 0, "step_ends": [...], "cpu_ends": [...]}``: an unmodified script's step times, with
one wrapper call per step of overhead and no recorder (``bench/launch.py --script`` uses it).

The recorder is closed at interpreter exit, so a run shorter than the window still leaves its steps.
Nothing here raises into the user's import of torch: a failure to patch is printed and ignored.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from dpro.record import job_env

__all__ = ["install", "installed", "owning_model"]

# The variables dpro-launch sets (dpro.launch.env names them too; a plugin does not import the launcher).
AUTO_RECORD, PROFILE, RUN_DIR = job_env.AUTO_RECORD, job_env.PROFILE, job_env.RUN_DIR
CONFIG, APPLY_SEARCH, FORCE = job_env.CONFIG, job_env.APPLY_SEARCH, job_env.FORCE
BACKWARD_MARKS = job_env.BACKWARD_MARKS
MECHANISMS_VAR = job_env.MECHANISMS
STEP_TIMES = job_env.STEP_TIMES
ELSEWHERE_FILE = "recorded-elsewhere.json"
SEEN_FILE = job_env.SEEN_FILE
WHO = "dpro-launch"
HVD_ENGINE = "horovod"  # the engine dpro.plugins.torch.horovod records (a config's fingerprint names it)


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK") or os.environ.get("HOROVOD_RANK") or 0)


def _mechanisms() -> tuple[str, ...]:
    """``$DPRO_MECHANISMS`` (comma-separated, e.g. to price each one in an overhead bench), else all of them."""
    from dpro.plugins.torch.recorder import MECHANISMS

    text = os.environ.get(MECHANISMS_VAR, "")
    return tuple(m.strip() for m in text.split(",") if m.strip()) if text else MECHANISMS


def _backward_marks() -> str:
    """How dpro-launch asked the recorders to time BW (``--backward-marks``; a recorder refuses a wrong value)."""
    return os.environ.get(BACKWARD_MARKS) or "gradients"


def _say(message: str) -> None:
    """Users hear from rank 0 only."""
    if _rank() == 0:
        from dpro.logs import get_logger  # imported late: this module loads at every interpreter start

        get_logger("dpro.plugins.torch.autoattach").info(message)


# ---- the process's state: the auto-attached recorder ----------------------------------------------------


@dataclass
class _State:
    record: bool
    window: list[int] | None  # the iterations to record
    run_dir: str | None
    ddps: list[weakref.ref] = field(default_factory=list)
    recorder: Any = None
    optimizer: weakref.ref | None = None
    hook: Any = None
    decided: bool = False
    elsewhere: list[str] = field(default_factory=list)
    lightning_callback: bool = False
    config_applied: bool = False
    config_source: str | None = None
    hvd_candidates: list[tuple[weakref.ref, weakref.ref]] = field(default_factory=list)  # (optimizer, model)
    hvd_depth: dict[int, int] = field(default_factory=dict)  # id(optimizer) -> step() calls running
    hvd_hooks: list[Any] = field(default_factory=list)
    fsdps: list[weakref.ref] = field(default_factory=list)  # modules fully_shard was applied to
    fsdp_reshard: dict[int, Any] = field(default_factory=dict)  # id(module) -> the reshard_after_forward given
    steps_seen: int = 0  # optimizer steps watched (what the launcher says when nothing was recorded)
    built: dict[str, int] = field(default_factory=dict)  # what the script built, by kind (the same note)
    micro_batches_applied: bool = False  # a Trainer took the config's micro_batches as its own accumulation
    warned: set[str] = field(default_factory=set)
    config_of: dict[int, tuple[weakref.ref, Any]] = field(default_factory=dict)  # id(model) -> (model, its config)

    # -- the config ----------------------------------------------------------------------------------

    def config_for(self, module: Any) -> Any:
        """The config to apply to a model about to be wrapped in DDP (or handed to a Trainer), or None."""
        ref, known = self.config_of.get(id(module), (None, None))
        if ref is not None and ref() is module:  # a Trainer's model, about to be wrapped in DDP: already checked
            return known
        path = os.environ.get(CONFIG) or None
        search = os.environ.get(APPLY_SEARCH) or None
        if self.lightning_callback or (path is None and search is None):
            return None
        import torch.distributed as dist

        from dpro.plugins.torch.apply import ENGINE, fingerprint, load_config

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(
            os.environ.get("WORLD_SIZE", "1"))
        if path is None:
            from dpro.config import find_config

            wanted = {"framework": "torch", "engine": ENGINE, "world_size": world, "model": fingerprint(module)}
            found = find_config(search, wanted)
            if found is None:
                if not self.config_applied:
                    _say(f"--apply auto: no config made for this job (world size {world}, model "
                         f"{wanted['model'][:12]}) under {search}; running without one")
                return None
            path = str(found)
        if self.config_applied:  # a second DDP model: apply only if the config was made for it
            from dpro.config import read_config

            if read_config(path).fingerprint.model != fingerprint(module):
                return None
        config = load_config(path, model=module, world_size=world, force=os.environ.get(FORCE) == "1")
        if not self.config_applied:
            _say(f"applying {path}")
        self.config_applied = True
        self.config_source = path
        self.config_of[id(module)] = (weakref.ref(module), config)
        return config

    # -- DDP ------------------------------------------------------------------------------------------

    def ddp_built(self, ddp: Any) -> None:
        self.built["ddp_models"] = self.built.get("ddp_models", 0) + 1
        self.ddps.append(weakref.ref(ddp))
        if self.record and self.hook is None and not self.decided:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self.hook = register_optimizer_step_post_hook(self.on_step)

    def _ddp_of(self, optimizer: Any) -> Any:
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for ref in self.ddps:
            ddp = ref()
            if ddp is not None and any(id(p) in owned for p in ddp.module.parameters()):
                return ddp
        return None

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer post-step hook: the end of an iteration."""
        self.steps_seen += 1
        recorder = self.recorder
        if recorder is not None:
            if self.optimizer is not None and self.optimizer() is optimizer:
                recorder.step()
                if recorder.iteration > recorder.steps[-1]:
                    self.unhook()
            return
        if self.decided:
            return
        ddp = self._ddp_of(optimizer)
        if ddp is not None:
            self.decided = True
            self.attach(ddp, optimizer)
            return
        root = self._fsdp_of(optimizer)
        if root is not None:
            self.decided = True
            self.fsdp_attach(root, optimizer)

    def _recorded_by_the_script(self) -> bool:
        """The script records itself (a ``Profiler`` or ``DproCallback`` is active): the auto-attach steps aside,
        noting where the script records."""
        from dpro.plugins.torch.recorder import active_recorders

        others = active_recorders()
        if not (others or self.lightning_callback):
            return False
        self.elsewhere = sorted({str(Path(r.run_dir).resolve()) for r in others})
        self.unhook()
        return True

    def attach(self, ddp: Any, optimizer: Any) -> None:
        from dpro.plugins.torch.apply import recomputed
        from dpro.plugins.torch.recorder import TorchRecorder

        if not self._recorded_by_the_script():
            self._start(TorchRecorder, ddp, recomputed(ddp.module), optimizer, self.unhook)

    # -- FSDP ---------------------------------------------------------------------------------------

    def fsdp_sharded(self, module: Any, reshard: Any) -> None:
        """``fully_shard`` was applied to ``module`` (``reshard``: its ``reshard_after_forward``, None when not
        given): watch optimizer steps (the first whose parameters are an FSDP model's attaches)."""
        self.built["fsdp_modules"] = self.built.get("fsdp_modules", 0) + 1
        self.fsdps.append(weakref.ref(module))
        self.fsdp_reshard[id(module)] = reshard
        if self.record and self.hook is None and not self.decided:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self.hook = register_optimizer_step_post_hook(self.on_step)

    def _fsdp_of(self, optimizer: Any) -> Any:
        """The outermost sharded module whose parameters the optimizer updates, or None."""
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        modules = [m for m in (ref() for ref in self.fsdps) if m is not None]
        inner = {id(child) for m in modules for child in m.modules() if child is not m}
        for module in modules:
            if id(module) not in inner and any(id(p) in owned for p in module.parameters()):
                return module
        return None

    def fsdp_attach(self, root: Any, optimizer: Any) -> None:
        from dpro.errors import DproError
        from dpro.plugins.torch.fsdp import FsdpRecorder

        if self._recorded_by_the_script():
            return
        knobs: dict[str, Any] = {"dpro.launch": "autoattach"}
        if self.config_source:
            knobs["dpro.config"] = self.config_source
        try:
            self.recorder = FsdpRecorder(root, optimizer, self.run_dir, [s for s in self.window if s >= 1],
                                         extra_knobs=knobs, reshard=dict(self.fsdp_reshard), who=WHO)
        except DproError as err:
            _say(f"not recording: {err}")
            self.unhook()
            return
        self.optimizer = weakref.ref(optimizer)
        self.recorder.step()  # iteration 0 ended with this optimizer step

    def fsdp_config_knobs(self) -> dict[str, Any]:
        """The knobs of the config to apply to an FSDP job (engine ``torch-fsdp``, ``$DPRO_CONFIG``), or {}."""
        path = os.environ.get(CONFIG) or None
        if path is None:
            return {}
        from dpro.config import read_config
        from dpro.engines.torch_fsdp.knobs import NAME

        config = read_config(path)
        if config.fingerprint.engine != NAME:
            return {}
        if self.config_source != path:
            _say(f"applying {path}")
        self.config_applied = True
        self.config_source = path
        return dict(config.knobs)

    # -- Horovod ------------------------------------------------------------------------------------

    def hvd_config_for(self, model: Any, world_size: int) -> Any:
        """The config to apply to a Horovod job's model (engine ``horovod``), or None."""
        path = os.environ.get(CONFIG) or None
        search = os.environ.get(APPLY_SEARCH) or None
        if path is None and search is None:
            return None
        from dpro.plugins.torch.apply import fingerprint, load_config

        if path is None:
            from dpro.config import find_config

            wanted = {"framework": "torch", "engine": HVD_ENGINE, "world_size": world_size,
                      "model": fingerprint(model)}
            found = find_config(search, wanted)
            if found is None:
                _say(f"--apply auto: no config made for this job (horovod, world size {world_size}, model "
                     f"{wanted['model'][:12]}) under {search}; running without one")
                return None
            path = str(found)
        config = load_config(path, model=model, world_size=world_size, force=os.environ.get(FORCE) == "1",
                             engine=HVD_ENGINE)
        _say(f"applying {path}")
        self.config_applied = True
        self.config_source = path
        return config

    def hvd_optimizer_built(self, optimizer: Any, model: Any) -> None:
        """A ``hvd.DistributedOptimizer`` was built for ``model``: watch its steps (first step: attach)."""
        if not self.record or self.decided or model is None:
            return
        self.built["horovod_optimizers"] = self.built.get("horovod_optimizers", 0) + 1
        self.hvd_candidates.append((weakref.ref(optimizer), weakref.ref(model)))
        if not self.hvd_hooks:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self.hvd_hooks = [register_optimizer_step_pre_hook(self.on_hvd_step_begin),
                              register_optimizer_step_post_hook(self.on_hvd_step_end)]

    def _hvd_watched(self, optimizer: Any) -> Any:
        """The model of a watched Horovod optimizer, or None."""
        for opt_ref, model_ref in self.hvd_candidates:
            if opt_ref() is optimizer:
                return model_ref()
        return None

    def on_hvd_step_begin(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.decided and (self.optimizer is None or self.optimizer() is not optimizer):
            return
        if not self.hvd_depth.get(id(optimizer)) and _inside_state_broadcast():
            return  # not an iteration: Horovod steps the wrapped optimizer once to create the state it broadcasts
        if self.decided or self._hvd_watched(optimizer) is not None:
            self.hvd_depth[id(optimizer)] = self.hvd_depth.get(id(optimizer), 0) + 1

    def on_hvd_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer post-step hook; the outermost ``step()`` of the Horovod optimizer ends an iteration."""
        depth = self.hvd_depth.get(id(optimizer), 0)
        if depth == 0:
            return
        self.hvd_depth[id(optimizer)] = depth = depth - 1
        if depth:
            return  # the wrapped optimizer's own step, inside Horovod's
        self.steps_seen += 1
        recorder = self.recorder
        if recorder is not None:
            recorder.step()
            if recorder.iteration > recorder.steps[-1]:
                self.hvd_unhook()
            return
        if self.decided:
            return
        model = self._hvd_watched(optimizer)
        self.decided = True
        self.hvd_candidates = []
        self.hvd_attach(model, optimizer)

    def hvd_attach(self, model: Any, optimizer: Any) -> None:
        from dpro.plugins.torch.apply import recomputed
        from dpro.plugins.torch.horovod import HorovodRecorder
        from dpro.plugins.torch.recorder import active_recorders

        others = active_recorders()
        if others:  # the script records itself (record_horovod)
            self.elsewhere = sorted({str(Path(r.run_dir).resolve()) for r in others})
            self.hvd_unhook()
            return
        self._start(HorovodRecorder, model, recomputed(model), optimizer, self.hvd_unhook)

    def _start(self, recorder_class: Any, model: Any, recompute: list[str], optimizer: Any,
               unhook: Callable[[], None]) -> None:
        """Create the recorder (DDP or Horovod) after iteration 0's optimizer step and count that step."""
        from dpro.errors import DproError

        steps = [s for s in self.window if s >= 1]
        knobs: dict[str, Any] = {"dpro.launch": "autoattach", "recompute": recompute}
        if self.config_source:
            knobs["dpro.config"] = self.config_source
        try:
            self.recorder = recorder_class(model, optimizer, self.run_dir, steps, extra_knobs=knobs, who=WHO,
                                           backward_marks=_backward_marks(), mechanisms=_mechanisms())
        except DproError as err:
            _say(f"not recording: {err}")
            unhook()
            return
        self.optimizer = weakref.ref(optimizer)
        self.recorder.start()
        self.recorder.step()  # iteration 0 ended with this optimizer step

    def hvd_unhook(self) -> None:
        """Stop watching steps. Called from the global post hook: the pre hook goes at once; the post hook
        goes when it is the last global post hook (torch iterates that dict while calling it), else it
        stays, doing nothing."""
        self.hvd_candidates = []
        self.optimizer = None
        self.hvd_depth.clear()
        for handle in self.hvd_hooks:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks and next(reversed(hooks)) != handle.id:
                continue
            handle.remove()
        self.hvd_hooks = []

    def unhook(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    def at_exit(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        # only a rank that built something: the launcher's agents and the helper processes a job starts (torch.compile's
        # workers inherit RANK) load the auto-attach too, and a note written early would make the run directory taken
        if self.record and self.run_dir and (self.built or self.steps_seen) and _rank() == 0 and (
                self.recorder is None or not self.recorder.started):
            self._write_seen(Path(self.run_dir))
        if self.elsewhere and self.run_dir and _rank() == 0:
            root = Path(self.run_dir).resolve()
            outside = [d for d in self.elsewhere if root not in Path(d).parents and Path(d) != root]
            if outside and root.is_dir():
                note = {"note": "the script recorded itself (dpro Profiler or DproCallback) into these runs",
                        "runs": outside}
                (root / ELSEWHERE_FILE).write_text(json.dumps(note, indent=2) + "\n", encoding="utf-8")


    def _write_seen(self, run_dir: Path) -> None:
        """What this process saw of the job, for the launcher to say why nothing was recorded (``SEEN_FILE``)."""
        seen = {"ddp_models": self.built.get("ddp_models", 0), "fsdp_modules": self.built.get("fsdp_modules", 0),
                "horovod_optimizers": self.built.get("horovod_optimizers", 0),
                "lightning_trainer": self.lightning_callback, "optimizer_steps": self.steps_seen,
                "window": self.window[:1] + self.window[-1:] if self.window else []}
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / SEEN_FILE).write_text(json.dumps(seen) + "\n", encoding="utf-8")
        except OSError:
            pass  # a note for the launcher; never a reason to fail the job


_STATE: _State | None = None
_INSTALLED = False


def installed() -> bool:
    """True once ``install`` ran in this process."""
    return _INSTALLED


def _window(text: str | None) -> list[int]:
    from dpro.record.protocol import window_steps

    return window_steps(text, _say)


# ---- patches -----------------------------------------------------------------------------------------


def _patch_ddp(module: ModuleType) -> None:
    ddp_class = module.DistributedDataParallel
    original = ddp_class.__init__
    if getattr(original, "_dpro_patched", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        state = _STATE
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)  # let DDP report the mistake
        inner = bound.arguments.get("module")
        inner = getattr(inner, "_forward_module", inner)  # a Lightning wrapper holds the user's module
        config = state.config_for(inner) if state is not None and inner is not None else None
        if config is not None:
            from dpro.plugins.torch.apply import apply, ddp_kwargs

            apply(inner, config)
            extra = ddp_kwargs(config, model=inner)
            if extra:
                for key in ("bucket_cap_mb", "bucket_cap_mb_list"):
                    bound.arguments.pop(key, None)
                bound.arguments.update(extra)
        original(*bound.args, **bound.kwargs)
        micro = int(config.knobs.get("micro_batches") or 1) if config is not None else 1
        if micro > 1 and state is not None and not state.micro_batches_applied:
            from dpro.plugins.torch.apply import micro_batches_change

            _warn_once(state, micro_batches_change(micro))
        if config is not None and config.knobs.get("gradient_compression"):
            from dpro.plugins.torch.apply import register_compression

            register_compression(self, config)
        if state is not None:
            state.ddp_built(self)

    __init__._dpro_patched = True
    ddp_class.__init__ = __init__


def _warn_once(state: _State, message: str) -> None:
    if message not in state.warned:
        state.warned.add(message)
        if _rank() == 0:
            job_env.say(message)


def _patch_hf_trainer(module: ModuleType) -> None:
    """``transformers.Trainer.__init__``: a config's ``micro_batches`` becomes the Trainer's own accumulation
    (``transformers_callback.accumulate``), before the Trainer reads its arguments."""
    trainer_class = module.Trainer
    original = trainer_class.__init__
    if getattr(original, "_dpro_patched", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        state = _STATE
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)  # let the Trainer report the mistake
        model, training = bound.arguments.get("model"), bound.arguments.get("args")
        config = state.config_for(model) if state is not None and model is not None and training is not None else None
        micro = config.knobs.get("micro_batches") if config is not None else None
        if micro is not None:
            state.micro_batches_applied = True  # the Trainer's own accumulation: the DDP patch need not say how
        if micro is not None and int(micro) != int(training.gradient_accumulation_steps):
            from dpro.errors import ConfigError
            from dpro.plugins.torch.transformers_callback import accumulate

            try:
                accumulate(training, int(micro), config.source)
                _say(f"micro_batches={micro}: per_device_train_batch_size {training.per_device_train_batch_size}, "
                     f"gradient_accumulation_steps {training.gradient_accumulation_steps}")
            except ConfigError as err:
                _warn_once(state, f"not applied: {err}")
        return original(*bound.args, **bound.kwargs)

    __init__._dpro_patched = True
    trainer_class.__init__ = __init__


def _patch_trainer(module: ModuleType) -> None:
    trainer_class = module.Trainer
    original = trainer_class.__init__
    if getattr(original, "_dpro_patched", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        from dpro.plugins.torch.lightning import DproCallback

        state = _STATE
        if state is not None and state.record:
            given = kwargs.get("callbacks")
            listed = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
            if not any(isinstance(cb, DproCallback) for cb in listed):
                listed.append(DproCallback(run_dir=state.run_dir, steps=state.window,
                                           backward_marks=_backward_marks()))
                kwargs["callbacks"] = listed
        original(self, *args, **kwargs)
        callbacks = [cb for cb in getattr(self, "callbacks", []) if isinstance(cb, DproCallback)]
        if state is not None and callbacks:
            state.lightning_callback = True
            search = os.environ.get(APPLY_SEARCH)
            for cb in callbacks:
                if search and cb.config_path is None:
                    _search_config_in_setup(cb, search)

    __init__._dpro_patched = True
    trainer_class.__init__ = __init__


def _search_config_in_setup(callback: Any, search: str) -> None:
    """``--apply auto`` with Lightning: pick the config made for the LightningModule just before setup."""
    original = callback.setup

    def setup(trainer: Any, pl_module: Any, stage: str) -> None:
        if callback.config_path is None and stage == "fit":
            from dpro.config import find_config
            from dpro.plugins.torch.apply import ENGINE, fingerprint

            found = find_config(search, {"framework": "torch", "engine": ENGINE,
                                         "world_size": trainer.world_size, "model": fingerprint(pl_module)})
            if found is not None:
                callback.config_path = str(found)
                if trainer.global_rank == 0:
                    _say(f"applying {found}")
        return original(trainer, pl_module, stage)

    callback.setup = setup


def owning_model(params: list[Any], named: list[tuple[str, Any]] | None = None,
                 objects: list[Any] | None = None) -> Any:
    """The model (``nn.Module``) that an optimizer's parameters belong to, or None.

    Horovod is given parameters, not a model, so the modules are searched: the ``nn.Module`` instances in
    ``objects`` (default: ``gc.get_objects()`` after a collection, every object the collector tracks,
    which includes every module) that hold ``params[0]`` directly, and their ancestors (modules holding
    them in ``_modules``). With ``named`` (Horovod's ``named_parameters``), an ancestor whose
    ``named_parameters()`` are exactly those names and tensors is the model (the script passed
    ``model.named_parameters()``). Otherwise the model is the outermost one whose trainable parameters
    are all in ``params`` (walking up stops at a module holding a trainable parameter the optimizer
    does not update); of several such, the one with the most parameters, then the outermost found.
    """
    if not params:
        return None
    import gc

    from torch import nn

    if objects is None:
        gc.collect()  # a module that is already garbage must not be taken for the model
        objects = gc.get_objects()
    first = params[0]
    wanted = {id(p) for p in params}
    parents: dict[int, list[Any]] = {}
    owners = []
    module_type = nn.Module
    for module in objects:
        if not issubclass(type(module), module_type):  # type(), not isinstance: no object's __class__ is asked
            continue
        for child in module._modules.values():
            if child is not None:
                parents.setdefault(id(child), []).append(module)
        if any(p is first for p in module._parameters.values()):
            owners.append(module)
    ancestors: list[Any] = []  # breadth first: the owners, their parents, ...
    seen: set[int] = set()
    queue = list(owners)
    while queue:
        module = queue.pop(0)
        if id(module) not in seen:
            seen.add(id(module))
            ancestors.append(module)
            queue.extend(parents.get(id(module), ()))
    if named is not None:
        given = sorted((n, id(p)) for n, p in named)
        for module in ancestors:
            if sorted((n, id(p)) for n, p in module.named_parameters()) == given:
                return module
    owner_ids = {id(m) for m in owners}
    valid: dict[int, int] = {}  # id(module) -> trainable parameters, for modules that qualify
    best: tuple[int, Any] | None = None
    for module in ancestors:
        children = module._modules.values()
        if id(module) not in owner_ids and not any(c is not None and id(c) in valid for c in children):
            continue  # not reached through qualifying modules
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable or any(id(p) not in wanted for p in trainable):
            continue
        valid[id(module)] = len(trainable)
        if best is None or len(trainable) >= best[0]:
            best = (len(trainable), module)
    return None if best is None else best[1]


def _patch_horovod(module: ModuleType) -> None:
    """Wrap ``horovod.torch.DistributedOptimizer`` (and ``horovod.torch.optimizer``'s) for ``_State``."""
    original = getattr(module, "DistributedOptimizer", None)
    if original is None or getattr(original, "_dpro_patched", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def DistributedOptimizer(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - Horovod's name
        state = _STATE
        if state is None or not (state.record or os.environ.get(CONFIG) or os.environ.get(APPLY_SEARCH)):
            return _step_clock(original(*args, **kwargs))
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # let Horovod report the mistake
        named = bound.arguments.get("named_parameters")
        if named is not None and not isinstance(named, (list, tuple)):
            try:  # e.g. model.named_parameters(), a generator: read once here, Horovod gets the list (as it
                named = list(named)  # would make itself)
                bound.arguments["named_parameters"] = named
            except TypeError:
                pass  # Horovod reports it
        model = None
        try:
            inner = bound.arguments["optimizer"]
            params = [p for group in inner.param_groups for p in group["params"]]
            pairs = named if isinstance(named, (list, tuple)) and all(
                isinstance(x, tuple) and len(x) == 2 for x in named) else None
            model = owning_model(params, pairs)
            if model is None:
                _say("no nn.Module holds the parameters given to hvd.DistributedOptimizer: the job is not "
                     "recorded and no config is applied")
            else:
                _hvd_apply_config(state, module, model, bound)
        except Exception as err:  # never break the user's optimizer
            if isinstance(err, _ConfigRefused):
                raise err.__cause__ from None
            _say(f"could not prepare hvd.DistributedOptimizer: {type(err).__name__}: {err}")
        optimizer = _step_clock(original(*bound.args, **bound.kwargs))
        try:
            state.hvd_optimizer_built(optimizer, model)
        except Exception as err:
            _say(f"not recording: {type(err).__name__}: {err}")
        return optimizer

    DistributedOptimizer._dpro_patched = True
    module.DistributedOptimizer = DistributedOptimizer
    inner_module = sys.modules.get("horovod.torch.optimizer")
    if inner_module is not None and getattr(inner_module, "DistributedOptimizer", None) is original:
        inner_module.DistributedOptimizer = DistributedOptimizer


def _inside_state_broadcast(depth: int = 8) -> bool:
    """Whether Horovod's ``broadcast_optimizer_state`` is on the stack: for a stateful optimizer with no state yet it
    runs one ``step()`` of the wrapped optimizer on zero gradients, which neither the script nor the step clock
    counts as an iteration (so neither may the recorder, or its window would begin a step early)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "broadcast_optimizer_state" and "horovod" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def _step_clock(optimizer: Any) -> Any:
    """With ``$DPRO_STEP_TIMES``: time the end of every ``step()`` of ``optimizer`` on rank 0 (the first
    Horovod optimizer built; an instance attribute, so the wrapped optimizer's own ``step`` inside Horovod's
    is not counted again)."""
    path = os.environ.get(STEP_TIMES)
    if not path or _rank() != 0 or getattr(_step_clock, "installed", False):
        return optimizer
    from dpro.record.protocol import StepClock

    clock = StepClock(path)
    step = optimizer.step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        clock.step_ended()
        return out

    try:
        optimizer.step = functools.wraps(step)(timed_step)
    except AttributeError:
        return optimizer
    _step_clock.installed = True
    atexit.register(clock.write)
    return optimizer


class _ConfigRefused(Exception):
    """A config that does not fit the job: raised to the script, as ``load_config`` would."""


def _hvd_apply_config(state: _State, hvd: ModuleType, model: Any, bound: inspect.BoundArguments) -> None:
    """Apply the dpro config (if any) before Horovod builds its optimizer: recompute on the model,
    ``tensor_groups`` as ``groups=`` unless the script passes groups."""
    try:
        world = hvd.size()
    except ValueError:  # not initialized: Horovod will say so
        world = int(os.environ.get("HOROVOD_SIZE", "1") or 1)
    from dpro.errors import ConfigError

    try:
        config = state.hvd_config_for(model, world)
        if config is None:
            return
        from dpro.plugins.torch.apply import apply

        apply(model, config)
    except ConfigError as err:
        raise _ConfigRefused() from err
    micro = int(config.knobs.get("micro_batches") or 1)
    if micro > 1:
        from dpro.plugins.torch.apply import micro_batches_change

        _warn_once(state, micro_batches_change(micro, horovod=True))
    groups = config.knobs.get("tensor_groups")
    if not groups or bound.arguments.get("groups") is not None or bound.arguments.get("num_groups"):
        return
    params = dict(model.named_parameters())
    unknown = [n for group in groups for n in group if n not in params]
    if unknown:
        _say(f"{config.source}: tensor_groups name parameters the model does not have ({', '.join(unknown[:3])}); "
             "not applied")
        return
    bound.arguments["groups"] = [[params[n] for n in group] for group in groups if len(group) > 1] or None


def _patch_fsdp(module: ModuleType) -> None:
    """``fully_shard`` (FSDP2): tell the state which modules are sharded, and apply a config's
    ``torch.fsdp.reshard_after_forward`` where the script does not pass its own."""
    original = getattr(module, "fully_shard", None)
    if original is None or getattr(original, "_dpro_patched", False):
        return

    @functools.wraps(original)
    def fully_shard(target: Any, *args: Any, **kwargs: Any) -> Any:
        state = _STATE
        if state is None:
            return original(target, *args, **kwargs)
        try:
            from dpro.engines.torch_fsdp.knobs import RESHARD

            wanted = state.fsdp_config_knobs().get(RESHARD)
            if wanted is not None:
                if "reshard_after_forward" not in kwargs:
                    kwargs["reshard_after_forward"] = wanted
                elif kwargs["reshard_after_forward"] != wanted:
                    _say(f"the script passes fully_shard(reshard_after_forward={kwargs['reshard_after_forward']!r}); "
                         f"the config's {RESHARD}={wanted!r} is not applied there (change the script to apply it)")
        except Exception as err:  # never break the job
            _say(f"could not apply the config to fully_shard: {type(err).__name__}: {err}")
        out = original(target, *args, **kwargs)
        try:
            for sharded in target if isinstance(target, (list, tuple)) else [target]:
                state.fsdp_sharded(sharded, kwargs.get("reshard_after_forward"))
        except Exception as err:
            _say(f"not recording: {type(err).__name__}: {err}")
        return out

    fully_shard._dpro_patched = True
    for name in ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
                 "torch.distributed.fsdp._fully_shard._fully_shard", "torch.distributed._composable.fsdp"):
        holder = sys.modules.get(name)
        if holder is not None and getattr(holder, "fully_shard", None) is original:
            holder.fully_shard = fully_shard


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "torch.nn.parallel.distributed": _patch_ddp,
    "torch.distributed.fsdp": _patch_fsdp,
    "transformers.trainer": _patch_hf_trainer,
    "lightning.pytorch.trainer.trainer": _patch_trainer,
    "pytorch_lightning.trainer.trainer": _patch_trainer,
    "horovod.torch": _patch_horovod,
}
"""The modules this plugin patches when a script imports them, and the patch of each."""


def install(when_imported: Callable[[str, Callable[[ModuleType], None]], None]) -> None:
    """Register the torch plugin's patches (once per process) with dpro-launch's post-import hook
    (``dpro.launch.post_import``): ``when_imported(module name, patch)`` calls ``patch(module)`` once that
    module has been executed. Reads the DPRO_* variables set by dpro-launch."""
    global _STATE, _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    record = os.environ.get(AUTO_RECORD) == "1"
    _STATE = _State(record=record, window=_window(os.environ.get(PROFILE)) if record else None,
                    run_dir=os.environ.get(RUN_DIR) or None)
    for module_name, patch in PATCHES.items():
        when_imported(module_name, patch)
    atexit.register(_STATE.at_exit)
