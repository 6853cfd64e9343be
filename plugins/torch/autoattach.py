"""Record (and configure) an unmodified PyTorch script started by ``dpro-launch``.

``dpro-launch`` puts ``dpro/launch/autoattach`` first on ``PYTHONPATH``; its ``sitecustomize.py`` calls
``install()`` at interpreter start when torch is installed. ``install`` imports nothing heavy: it puts a
post-import hook on ``sys.meta_path`` and patches, when (and if) the script imports them,

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
- Lightning's ``Trainer.__init__`` (``lightning.pytorch`` and ``pytorch_lightning``): a ``DproCallback`` is
  added unless the callbacks hold one; it records and applies the config itself.

The recorder is closed at interpreter exit, so a run shorter than the window still leaves its steps.
Nothing here raises into the user's import of torch: a failure to patch is printed and ignored.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
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

__all__ = ["install", "installed"]

# The variables dpro-launch sets (dpro.launch.env names them too; a plugin does not import the launcher).
AUTO_RECORD, PROFILE, RUN_DIR = "DPRO_AUTO_RECORD", "DPRO_PROFILE", "DPRO_RUN_DIR"
CONFIG, APPLY_SEARCH, FORCE = "DPRO_CONFIG", "DPRO_APPLY_SEARCH", "DPRO_FORCE"
ELSEWHERE_FILE = "recorded-elsewhere.json"
WHO = "dpro-launch"


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0") or 0)


def _say(message: str) -> None:
    """Users hear from rank 0 only."""
    if _rank() == 0:
        print(f"[dpro] {message}", file=sys.stderr, flush=True)


# ---- post-import hooks ------------------------------------------------------------------------------


class _ThenLoader(importlib.abc.Loader):
    """Runs the real loader, then a callback on the fresh module; the module keeps the real loader."""

    def __init__(self, inner: Any, callback: Callable[[ModuleType], None]) -> None:
        self.inner = inner
        self.callback = callback

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        _run_callback(self.callback, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _run_callback(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as err:  # never break the user's import
        _say(f"could not attach to {module.__name__}: {type(err).__name__}: {err}")


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path``: calls ``callbacks[name](module)`` once module ``name`` has been executed."""

    def __init__(self) -> None:
        self.callbacks: dict[str, Callable[[ModuleType], None]] = {}

    def when_imported(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        module = sys.modules.get(name)
        if module is not None:
            _run_callback(callback, module)
        else:
            self.callbacks[name] = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        callback = self.callbacks.pop(fullname, None)
        if callback is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenLoader(spec.loader, callback)
        return spec


# ---- the process's state: the auto-attached recorder ----------------------------------------------------


@dataclass
class _State:
    record: bool
    window: tuple[int, int] | None
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

    # -- the config ----------------------------------------------------------------------------------

    def config_for(self, module: Any) -> Any:
        """The config to apply to a model about to be wrapped in DDP, or None."""
        path = os.environ.get(CONFIG) or None
        search = os.environ.get(APPLY_SEARCH) or None
        if self.lightning_callback or (path is None and search is None):
            return None
        import torch.distributed as dist

        from dpro.plugins.torch.apply import fingerprint, load_config

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(
            os.environ.get("WORLD_SIZE", "1"))
        if path is None:
            from dpro.config import find_config

            wanted = {"framework": "torch", "engine": "torch-ddp", "world_size": world, "model": fingerprint(module)}
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
        return config

    # -- DDP ------------------------------------------------------------------------------------------

    def ddp_built(self, ddp: Any) -> None:
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
        if ddp is None:
            return
        self.decided = True
        self.attach(ddp, optimizer)

    def attach(self, ddp: Any, optimizer: Any) -> None:
        from dpro.errors import DproError
        from dpro.plugins.torch.apply import recomputed
        from dpro.plugins.torch.recorder import TorchRecorder, active_recorders

        others = active_recorders()
        if others or self.lightning_callback:
            self.elsewhere = sorted({str(Path(r.run_dir).resolve()) for r in others})
            self.unhook()
            return
        steps = [s for s in range(*self.window) if s >= 1]
        knobs = {"dpro.launch": "autoattach", "recompute": recomputed(ddp.module)}
        if self.config_source:
            knobs["dpro.config"] = self.config_source
        try:
            self.recorder = TorchRecorder(ddp, optimizer, self.run_dir, steps, extra_knobs=knobs, who=WHO)
        except DproError as err:
            _say(f"not recording: {err}")
            self.unhook()
            return
        self.optimizer = weakref.ref(optimizer)
        self.recorder.start()
        self.recorder.step()  # iteration 0 ended with this optimizer step

    def unhook(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    def at_exit(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        if self.elsewhere and self.run_dir and _rank() == 0:
            root = Path(self.run_dir).resolve()
            outside = [d for d in self.elsewhere if root not in Path(d).parents and Path(d) != root]
            if outside and root.is_dir():
                note = {"note": "the script recorded itself (dpro Profiler or DproCallback) into these runs",
                        "runs": outside}
                (root / ELSEWHERE_FILE).write_text(json.dumps(note, indent=2) + "\n", encoding="utf-8")


_STATE: _State | None = None
_FINDER: _PostImportFinder | None = None


def installed() -> bool:
    """True once ``install`` ran in this process."""
    return _FINDER is not None


def _window(text: str | None) -> tuple[int, int] | None:
    if not text:
        return (10, 20)
    start, _, stop = text.partition(":")
    try:
        return int(start), int(stop)
    except ValueError:
        _say(f"{PROFILE}={text!r} is not START:STOP; using 10:20")
        return (10, 20)


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
        if config is not None and config.knobs.get("gradient_compression"):
            from dpro.plugins.torch.apply import register_compression

            register_compression(self, config)
        if state is not None:
            state.ddp_built(self)

    __init__._dpro_patched = True
    ddp_class.__init__ = __init__


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
                listed.append(DproCallback(run_dir=state.run_dir, steps=range(*state.window)))
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
            from dpro.plugins.torch.apply import fingerprint

            found = find_config(search, {"framework": "torch", "engine": "torch-ddp",
                                         "world_size": trainer.world_size, "model": fingerprint(pl_module)})
            if found is not None:
                callback.config_path = str(found)
                if trainer.global_rank == 0:
                    print(f"[dpro] applying {found}", file=sys.stderr, flush=True)
        return original(trainer, pl_module, stage)

    callback.setup = setup


def install() -> None:
    """Install the post-import patches (once per process). Reads the DPRO_* variables set by dpro-launch."""
    global _STATE, _FINDER
    if _FINDER is not None:
        return
    record = os.environ.get(AUTO_RECORD) == "1"
    _STATE = _State(record=record, window=_window(os.environ.get(PROFILE)) if record else None,
                    run_dir=os.environ.get(RUN_DIR) or None)
    _FINDER = _PostImportFinder()
    sys.meta_path.insert(0, _FINDER)
    _FINDER.when_imported("torch.nn.parallel.distributed", _patch_ddp)
    _FINDER.when_imported("lightning.pytorch.trainer.trainer", _patch_trainer)
    _FINDER.when_imported("pytorch_lightning.trainer.trainer", _patch_trainer)
    atexit.register(_STATE.at_exit)
