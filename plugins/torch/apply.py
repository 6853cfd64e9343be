"""Apply a dpro config to a PyTorch job: the torch knobs of ``dpro.config.KNOBS``, each by one function.

- ``torch.ddp.bucket_cap_mb``: ``ddp_kwargs`` -> ``DistributedDataParallel(bucket_cap_mb=)``
- ``torch.ddp.first_bucket_cap_mb``: ``ddp_kwargs`` -> ``bucket_cap_mb_list=[first, rest]``
- ``tensor_groups``: ``ddp_kwargs`` -> ``bucket_cap_mb_list`` (one cap per group, exact in bytes)
- ``recompute``: ``apply`` / ``apply_recompute``: checkpoint wrappers, before DDP wraps the model
- ``gradient_compression``: ``register_compression``: DDP's fp16/bf16 compress hook, after DDP
- ``amp``: ``apply`` / ``apply_amp``: the model's forward under ``torch.autocast`` (its outputs back in fp32, so the
  loss computed from them is too); for fp16, dynamic loss scaling
- ``compile``: ``apply`` / ``apply_compile``: the listed modules compiled in place (``nn.Module.compile``), eager again
  if compiling fails
- ``micro_batches`` k (passes per optimizer step over the samples one step takes now, ``micro_batch_rows``): a
  Trainer's own accumulation (``transformers_callback.accumulate``, set by dpro-launch's auto-attach); Lightning's
  ``accumulate_grad_batches`` over a DataLoader of the micro-batches' rows (``micro_batch_loader``, applied by
  ``DproCallback``); a plain loop, DDP's or Horovod's, changes its code (``micro_batches_change`` says how)
- ``env``: the launcher (``dpro-launch``), before the process starts; ``load_config`` warns when unset

A plain training loop::

    model = build_model()
    config = load_config(model=model)           # $DPRO_CONFIG, or None; refuses a config for another job
    if config is not None:
        model = apply(model, config)            # recompute: must happen before DDP wraps the model
    ddp = DistributedDataParallel(model, **(ddp_kwargs(config, model=model) if config else {}))
    if config is not None:
        register_compression(ddp, config)       # before dpro's Profiler (DDP takes one comm hook)

With Lightning, ``DproCallback(config=...)`` does the same (see ``dpro.plugins.torch.lightning``).
"""

from __future__ import annotations

import contextlib
import os
import types
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from dpro.config import DPRO_CONFIG, Config, check_fingerprint, read_config
from dpro.engines.torch_ddp.buckets import BUCKET_CAP, FIND_UNUSED, FIRST_BUCKET_CAP
from dpro.engines.torch_ddp.buckets import NAME as ENGINE
from dpro.errors import ConfigError, UsageError
from dpro.logs import get_logger
from dpro.record.trace import ROOT_MODULE, model_fingerprint

__all__ = [
    "ENGINE",
    "FRAMEWORK",
    "amp_in_force",
    "apply",
    "apply_amp",
    "apply_compile",
    "apply_recompute",
    "compiled",
    "ddp_kwargs",
    "fingerprint",
    "load_config",
    "micro_batch_loader",
    "micro_batch_rows",
    "micro_batches_change",
    "recomputed",
    "register_compression",
]

FRAMEWORK = "torch"
_DDP_DEFAULT_BUCKET_CAP_MB = 25.0
_BUCKET, _FIRST, _FIND_UNUSED, _GROUPS = BUCKET_CAP, FIRST_BUCKET_CAP, FIND_UNUSED, "tensor_groups"


def _key(knob: str) -> str:
    return f'knobs["{knob}"]'


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _warn(message: str) -> None:
    """Users hear from rank 0 only."""
    if _rank() == 0:
        warnings.warn(message, stacklevel=3)


def fingerprint(model: nn.Module) -> str:
    """The model hash dpro records in run.json (``TorchRecorder.fingerprint``): (name, shape, dtype) of the
    trainable parameters of the model (the inner module of a DDP wrapper), in ``named_parameters`` order."""
    return model_fingerprint((n, p.shape, str(p.dtype)) for n, p in _inner(model).named_parameters()
                             if p.requires_grad)


def load_config(
    path: str | Path | None = None, *, model: nn.Module, world_size: int | None = None, force: bool = False,
    engine: str = ENGINE,
) -> Config | None:
    """Read the config to apply to this job and check that it was made for it.

    Args:
        path: the config file; None reads ``$DPRO_CONFIG`` (set by ``dpro-launch``).
        model: the model the config will be applied to (plain or DDP-wrapped).
        world_size: this job's world size; None asks torch.distributed (1 when it is not initialized).
        force: apply a config made for another job anyway (a warning lists what differs).
        engine: the job's engine ("torch-ddp"; another torch engine, e.g. Horovod's, passes its own).

    Returns:
        The config, or None when no path is given and ``$DPRO_CONFIG`` is unset or empty.

    Raises:
        ConfigError: the file is not a valid config, or its fingerprint (framework "torch", the engine,
            world size, model hash) does not match the job and ``force`` is False.
    """
    if path is None:
        path = os.environ.get(DPRO_CONFIG) or None
        if path is None:
            return None
    config = read_config(path)
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    mismatches = check_fingerprint(config, framework=FRAMEWORK, engine=engine, world_size=world_size,
                                   model=fingerprint(model), force=force)
    if mismatches:
        _warn(f"dpro: applying {path} although it was made for another job (force=True): " + "; ".join(mismatches))
    unset = sorted(k for k, v in config.knobs.get("env", {}).items() if os.environ.get(k) != v)
    if unset:
        _warn(f"dpro: {path} sets environment variables that are not in force here: {', '.join(unset)}; "
              "they are set by dpro-launch before the job starts (or set them yourself)")
    return config


# ---- DDP arguments -----------------------------------------------------------------------------------


def ddp_kwargs(config: Config, *, model: nn.Module | None = None) -> dict[str, Any]:
    """Keyword arguments for ``DistributedDataParallel`` from the config's bucket knobs.

    - ``torch.ddp.bucket_cap_mb`` -> ``bucket_cap_mb``.
    - ``torch.ddp.first_bucket_cap_mb`` (when it differs from the bucket size) -> ``bucket_cap_mb_list=
      [first, bucket]``: DDP gives its first bucket the first cap and repeats the last cap for the rest.
    - ``torch.ddp.find_unused_parameters`` -> ``find_unused_parameters``.
    - ``tensor_groups`` -> ``bucket_cap_mb_list``, one cap per group, each exactly the group's bytes.
      DDP fills buckets with gradients in the order they become ready (after its first iteration,
      when it rebuilds its buckets) and closes a bucket when it reaches its cap, so each bucket is
      exactly one group provided the groups list every trainable gradient once, in gradient-ready
      (backward) order, as ``model.json`` lists them, and the gradients of a group become ready one
      after another. The first iteration still uses DDP's initial assignment (parameters in reverse
      definition order). The groups need the parameter sizes, so pass ``model``; without it, or when
      the parameters mix dtypes or devices (DDP buckets them separately), the groups are only
      approximated by ``torch.ddp.bucket_cap_mb`` and a warning says so. Groups take precedence
      over the two bucket sizes.

    Args:
        config: the applied config.
        model: the model DDP will wrap (needed for ``tensor_groups``).

    Returns:
        A dict for ``DistributedDataParallel(model, **ddp_kwargs(config, model=model))``; empty when the
        config sets no bucket knob.

    Raises:
        ConfigError: ``tensor_groups`` name a parameter the model does not have, or leave one out.
    """
    knobs = config.knobs
    flags = {"find_unused_parameters": knobs[_FIND_UNUSED]} if _FIND_UNUSED in knobs else {}
    groups = knobs.get(_GROUPS)
    if groups:
        caps = _group_caps(config, groups, model)
        if caps is not None:
            return {"bucket_cap_mb_list": caps, **flags}
    cap, first = knobs.get(_BUCKET), knobs.get(_FIRST)
    if first is not None and first != (cap if cap is not None else _DDP_DEFAULT_BUCKET_CAP_MB):
        return {"bucket_cap_mb_list": [first, cap if cap is not None else _DDP_DEFAULT_BUCKET_CAP_MB], **flags}
    return flags if cap is None else {"bucket_cap_mb": cap, **flags}


def _group_caps(config: Config, groups: list[list[str]], model: nn.Module | None) -> list[float] | None:
    """One cap (MiB) per tensor group, or None when the groups can only be approximated (with a warning)."""
    fallback = (f"using torch.ddp.bucket_cap_mb ({config.knobs[_BUCKET]} MiB) instead" if _BUCKET in config.knobs
                else "using DDP's default bucket size instead")
    if model is None:
        _warn(f"dpro: {config.source}: tensor_groups need the parameter sizes; call ddp_kwargs(config, "
              f"model=model) to apply them; {fallback}")
        return None
    params = {n: p for n, p in _inner(model).named_parameters() if p.requires_grad}
    key = _key(_GROUPS)
    for i, group in enumerate(groups):
        for j, name in enumerate(group):
            if name not in params:
                raise ConfigError(config.source, f"the model has no trainable parameter {name!r}", f"{key}[{i}][{j}]")
    grouped = {name for group in groups for name in group}
    left_out = [name for name in params if name not in grouped]
    if left_out:
        raise ConfigError(config.source, f"the groups leave out {len(left_out)} gradient(s): "
                          f"{', '.join(left_out[:5])}{', ...' if len(left_out) > 5 else ''}", key)
    kinds = {(p.dtype, p.device) for p in params.values()}
    if len(kinds) > 1:
        _warn(f"dpro: {config.source}: DDP buckets each dtype and device separately, and the parameters mix "
              f"{', '.join(sorted(f'{d}/{v}' for d, v in kinds))}; the tensor groups cannot be applied exactly; "
              f"{fallback}")
        return None
    return [sum(params[n].numel() * params[n].element_size() for n in group) / 2**20 for group in groups]


# ---- recomputation ----------------------------------------------------------------------------------


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a module under ``apply_recompute``: non-reentrant activation checkpointing.

    A bound method of the module (not a closure), so ``copy.deepcopy`` of the model rebinds it.
    """
    inner = self._dpro_inner_forward
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    return checkpoint(inner, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: nn.Module, module_paths: Iterable[str], *, source: str = "apply_recompute") -> list[str]:
    """Recompute the activations of the named submodules in backward instead of keeping them.

    Each module's ``forward`` is wrapped, in place, with ``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False)``: its forward runs without saving intermediate activations, and runs again
    during backward. The module's own hooks run once per call; hooks of its children also run
    during the recomputation (dpro then records their FW events twice in a step). Under
    ``torch.no_grad()`` the original forward runs. Wrapping a module twice is a no-op.

    Call it before ``DistributedDataParallel`` wraps the model.

    Args:
        model: the model (not yet DDP-wrapped); paths are ``named_modules`` names, e.g. "encoder.0".
        module_paths: the submodules to recompute.
        source: how errors name the caller (e.g. the config file).

    Returns:
        The paths that are recomputed.

    Raises:
        UsageError: ``model`` is already wrapped in DDP.
        ConfigError: a path names no submodule of ``model`` (nothing is wrapped then).
    """
    if isinstance(model, DistributedDataParallel):
        raise UsageError("apply_recompute: the model is already wrapped in DistributedDataParallel; apply the "
                         "config to the module before wrapping it (DDP must see the checkpointed forward)")
    paths = list(module_paths)
    modules = _submodules(model, paths, "recompute", source)
    for module in modules:
        if getattr(module, "_dpro_inner_forward", None) is None:
            module._dpro_inner_forward = module.forward
            module.forward = types.MethodType(_checkpointed_forward, module)
    return paths


def _submodules(model: nn.Module, paths: list[str], knob: str, source: str) -> list[nn.Module]:
    """The submodules ``paths`` name (``<root>``: ``model`` itself, for the compile knob).

    Raises:
        ConfigError: a path is not a string or names no submodule (the message gives the knob's index).
    """
    modules = []
    for i, path in enumerate(paths):
        if not isinstance(path, str) or not path:
            raise ConfigError(source, f"a module path must be a non-empty string, found {path!r}", f"{_key(knob)}[{i}]")
        if path == ROOT_MODULE and knob == "compile":
            modules.append(model)
            continue
        try:
            modules.append(model.get_submodule(path))
        except AttributeError:
            raise ConfigError(source, f"{type(model).__name__} has no submodule {path!r} (a path of "
                              "model.named_modules(), e.g. 'encoder.0')", f"{_key(knob)}[{i}]") from None
    return modules


def recomputed(model: nn.Module) -> list[str]:
    """Paths of the submodules whose activations ``apply_recompute`` made recomputed."""
    return [name for name, mod in _inner(model).named_modules()
            if getattr(mod, "_dpro_inner_forward", None) is not None]


# ---- compilation -------------------------------------------------------------------------------------


def _compiled_call(module: nn.Module) -> Callable[..., Any]:
    """``module``'s call (hooks and forward) under torch.compile, through a function of dpro's: Dynamo inlines a
    module from there even where it skips the module's own frames (torch's containers, e.g. ``nn.Sequential``,
    which ``nn.Module.compile`` leaves uncompiled)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return module._call_impl(*args, **kwargs)

    return torch.compile(call)


def _backward_compiled_with_forward() -> contextlib.AbstractContextManager[Any]:
    """Inductor compiles a backward graph when the backward first runs, so its failure would surface in the user's
    ``loss.backward()``, where dpro cannot step aside; this has it compiled with its forward instead (where
    ``_compiled_or_eager`` catches a failure). A torch without the switch compiles as it always does."""
    config = getattr(torch._functorch, "config", None)
    if config is None or not hasattr(config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return config.patch(force_non_lazy_backward_lowering=True)


def _compiled_or_eager(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A module's call under ``apply_compile``: the compiled call, or the eager one from the first time compiling
    fails (Dynamo's and inductor's errors, raised before the compiled graph runs, the backward's included). A bound
    method of the module, so ``copy.deepcopy`` rebinds it, and a copy compiles its own call."""
    if self._dpro_compiled_id != id(self):  # a copy of a compiled module (copy.deepcopy of the model)
        self._dpro_compiled, self._dpro_compiled_id = _compiled_call(self), id(self)
    try:
        with _backward_compiled_with_forward():
            return self._dpro_compiled(*args, **kwargs)
    except torch._dynamo.exc.TorchDynamoException as err:
        self._compiled_call_impl = None  # eager from now on: nn.Module.__call__ takes _call_impl
        self._dpro_compile_failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if _rank() == 0:
            get_logger("dpro.plugins.torch").warning("dpro: compiling %s failed; it runs eager (%s)",
                                                     type(self).__name__, self._dpro_compile_failed)
        return self._call_impl(*args, **kwargs)


def apply_compile(model: nn.Module, module_paths: Iterable[str], *, source: str = "apply_compile") -> list[str]:
    """Compile the named submodules (``<root>``: the whole model) with ``torch.compile``, in place
    (``nn.Module.compile``: the same module objects, so DDP, the state_dict's keys and dpro's module paths stay as
    they were). A module whose compiling fails in its forward runs eager from then on (a warning says so); a failure
    compiling the backward, which torch does at the first backward, is not caught. Compiling a module twice is a
    no-op. Call it before DDP wraps the model.

    Returns:
        The paths compiled.

    Raises:
        UsageError: ``model`` is already wrapped in DDP.
        ConfigError: a path names no submodule (nothing is compiled then).
    """
    if isinstance(model, DistributedDataParallel):
        raise UsageError("apply_compile: the model is already wrapped in DistributedDataParallel; apply the config "
                         "to the module before wrapping it")
    paths = list(module_paths)
    for module in _submodules(model, paths, "compile", source):
        if getattr(module, "_dpro_compiled", None) is None:
            module._dpro_compiled, module._dpro_compiled_id = _compiled_call(module), id(module)
            module._compiled_call_impl = types.MethodType(_compiled_or_eager, module)
    return paths


def compiled(model: nn.Module) -> list[str]:
    """Paths of the modules ``apply_compile`` compiled (and whose compiling has not failed)."""
    return [name or ROOT_MODULE for name, mod in _inner(model).named_modules()
            if getattr(mod, "_dpro_compiled", None) is not None and mod._compiled_call_impl is not None]


# ---- precision ---------------------------------------------------------------------------------------

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# torch.amp.GradScaler's defaults: its step() replaces optimizer.step(), which an unmodified script calls itself,
# so the same dynamic scaling is done from the optimizer's step hooks
LOSS_SCALE_INIT, LOSS_SCALE_GROWTH, LOSS_SCALE_BACKOFF, LOSS_SCALE_INTERVAL = 2.0**16, 2.0, 0.5, 2000


class _LossScale:
    """fp16 dynamic loss scaling without touching the script: the gradient entering the model's outputs is
    multiplied by ``scale`` (what scaling the loss does), and before each step of an optimizer holding the model's
    parameters their gradients are divided by it; a step with a non-finite gradient skips every parameter (their
    gradients set to None) and halves the scale, ``LOSS_SCALE_INTERVAL`` clean steps double it."""

    def __init__(self, model: nn.Module) -> None:
        self.scale, self.clean = LOSS_SCALE_INIT, 0
        self.params = {id(p) for p in model.parameters()}
        self.handle = register_optimizer_step_pre_hook(self.before_step)

    def scaled(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.scale

    def before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if id(p) in self.params and p.grad is not None]
        if not params:
            return
        finite = all(bool(torch.isfinite(p.grad).all()) for p in params)
        if not finite:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None  # the optimizer skips a parameter without a gradient: this step does nothing
            self.scale *= LOSS_SCALE_BACKOFF
            self.clean = 0
            return
        with torch.no_grad():
            for p in params:
                p.grad.div_(self.scale)
        self.clean += 1
        if self.clean >= LOSS_SCALE_INTERVAL:
            self.scale *= LOSS_SCALE_GROWTH
            self.clean = 0


def _float_outputs(output: Any, scale: _LossScale | None) -> Any:
    """Autocast's outputs back in fp32 (the loss computed from them is then fp32, as autocast would run it), each
    with the loss scale on its gradient under fp16."""
    if isinstance(output, torch.Tensor):
        if not output.is_floating_point():
            return output
        out = output.float()
        if scale is not None and out.requires_grad:
            out.register_hook(scale.scaled)
        return out
    if isinstance(output, tuple) and not hasattr(output, "_fields"):
        return tuple(_float_outputs(o, scale) for o in output)
    if isinstance(output, list):
        return [_float_outputs(o, scale) for o in output]
    if isinstance(output, dict):
        for key in list(output.keys()):  # a transformers ModelOutput is a dict kept in place
            output[key] = _float_outputs(output[key], scale)
        return output
    return output


def _autocast_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a module under ``apply_amp`` (a bound method, so ``copy.deepcopy`` rebinds it)."""
    device = next((p.device.type for p in self.parameters()), "cpu")
    with torch.autocast(device, dtype=AMP_DTYPES[self._dpro_amp]):
        output = self._dpro_precise_forward(*args, **kwargs)
    return _float_outputs(output, self._dpro_loss_scale)


def apply_amp(model: nn.Module, amp: str | None, *, source: str = "apply_amp") -> str | None:
    """Run ``model``'s forward under ``torch.autocast`` (``amp``: "bf16" or "fp16"; None does nothing), its
    outputs cast back to fp32; with fp16, dynamic loss scaling on the gradients (``_LossScale``). Parameters,
    gradients and their collectives stay fp32. Applying it twice is a no-op.

    Raises:
        UsageError: ``model`` is already wrapped in DDP (wrap the module inside, before DDP).
        ConfigError: ``amp`` is not a precision dpro knows.
    """
    if amp is None:
        return None
    if amp not in AMP_DTYPES:
        raise ConfigError(source, f"must be null, \"bf16\" or \"fp16\", found {amp!r}", _key("amp"))
    if isinstance(model, DistributedDataParallel):
        raise UsageError("apply_amp: the model is already wrapped in DistributedDataParallel; apply the config to "
                         "the module before wrapping it")
    if getattr(model, "_dpro_amp", None) is not None:
        return model._dpro_amp
    model._dpro_amp = amp
    model._dpro_loss_scale = _LossScale(model) if amp == "fp16" else None
    model._dpro_precise_forward = model.forward
    model.forward = types.MethodType(_autocast_forward, model)
    return amp


def amp_in_force(model: nn.Module) -> str | None:
    """The precision ``apply_amp`` set on ``model`` (or the module inside its DDP wrapper), or None."""
    return getattr(_inner(model), "_dpro_amp", None)


def micro_batch_rows(batch: int | None, accumulation: int, k: int, source: str) -> int:
    """The rows of each of ``k`` micro-batches that hold what an optimizer step takes now (``accumulation`` batches
    of ``batch`` rows): a config's ``micro_batches`` counts the passes of a step, whatever the job accumulated.

    Raises:
        ConfigError: those samples do not split into ``k`` equal micro-batches.
    """
    rows, rest = divmod((batch or 0) * accumulation, k) if k >= 1 else (0, 1)
    if rest or rows < 1:
        raise ConfigError(source, f"{accumulation} batch(es) of {batch} rows per optimizer step do not split into "
                          f"{k} equal micro-batches", 'knobs["micro_batches"]')
    return rows


def micro_batch_loader(loader: DataLoader, rows: int, source: str) -> DataLoader:
    """``loader`` again with batches of ``rows`` and everything else as it was: the same samples in the same order
    (a framework that accumulates that many batches per optimizer step then runs the same step in other
    micro-batches).

    Raises:
        ConfigError: the loader draws its batches from a batch sampler of its own (they cannot be resized from
            outside).
    """
    if loader.batch_size is None:
        raise ConfigError(source, "the DataLoader draws its batches from a batch sampler of its own; dpro cannot "
                          "resize them", 'knobs["micro_batches"]')
    extra = {"prefetch_factor": loader.prefetch_factor, "persistent_workers": loader.persistent_workers} \
        if loader.num_workers > 0 else {}
    return DataLoader(loader.dataset, batch_size=rows, sampler=loader.sampler, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
                      **extra)


def micro_batches_change(k: int, *, horovod: bool = False) -> str:
    """What a plain training loop (DDP's, or Horovod's with ``horovod``) changes to run its batch as ``k``
    micro-batches (dpro cannot do it from outside: the loop draws the batch, computes the loss and calls backward
    itself)."""
    skip = (f"build hvd.DistributedOptimizer(..., backward_passes_per_step={k}) so that it allreduces after the last"
            if horovod else "inside ddp_model.no_sync() for all but the last chunk")
    return (f"micro_batches={k} needs a code change in a plain training loop: split the samples of each optimizer "
            f"step into {k} chunks (x.chunk({k}) of one batch), and for each chunk run the forward and "
            f"(loss / {k}).backward(); {skip}; then optimizer.step() once. A transformers.Trainer started by "
            f"dpro-launch gets it without a change (gradient_accumulation_steps {k})")


def apply(model: nn.Module, config: Config) -> nn.Module:
    """Apply the config's knobs that change the model object (``recompute``, ``amp``, ``compile``), in place; return
    the model.

    Call it before wrapping the model in DDP; the DDP arguments come from ``ddp_kwargs(config,
    model=model)`` and gradient compression from ``register_compression(ddp_model, config)``.

    Raises:
        ConfigError: a recompute or compile path names no submodule.
    """
    paths = config.knobs.get("recompute") or []
    if paths:
        apply_recompute(model, paths, source=config.source)
    apply_amp(model, config.knobs.get("amp"), source=config.source)
    regions = config.knobs.get("compile") or []
    if regions:
        apply_compile(model, regions, source=config.source)
    return model


# ---- gradient compression ----------------------------------------------------------------------------


def register_compression(ddp_model: DistributedDataParallel, config: Config) -> str | None:
    """Register DDP's fp16 or bf16 compression hook when ``gradient_compression`` asks for it.

    DDP accepts one communication hook per model, and dpro's Profiler (or DproCallback) registers
    one to time COMM. So for now compression and dpro's COMM timing are exclusive: register the
    compression before creating the Profiler, which then records no COMM events (and says so).
    bf16 needs NCCL on CUDA (torch refuses it on gloo); fp16 works on gloo and NCCL.

    Returns:
        The hook registered ("fp16_compress_hook" / "bf16_compress_hook"), or None when the config
        asks for no compression.

    Raises:
        ConfigError: the DDP model already has a communication hook, or torch refuses the hook.
    """
    kind = config.knobs.get("gradient_compression")
    if kind is None:
        return None
    if not isinstance(ddp_model, DistributedDataParallel):
        raise UsageError(f"register_compression: expected the DistributedDataParallel model, got "
                         f"{type(ddp_model).__name__}")
    key = _key("gradient_compression")
    if getattr(ddp_model, "_comm_hooks", None):
        raise ConfigError(config.source, f"cannot register {kind} compression: the DDP model already has a "
                          "communication hook (dpro's Profiler registers one to time COMM) and DDP takes one; "
                          "call register_compression before creating the Profiler", key)
    hook = default_hooks.fp16_compress_hook if kind == "fp16" else default_hooks.bf16_compress_hook
    try:
        ddp_model.register_comm_hook(ddp_model.process_group, hook)
    except (TypeError, RuntimeError, ValueError) as err:
        raise ConfigError(config.source, f"torch refused the {kind} compression hook: {err}", key) from err
    if _rank() == 0:
        get_logger("dpro.plugins.torch").info("%s: gradients are allreduced in %s (%s)", config.source, kind,
                                              hook.__name__)
    return hook.__name__
