"""Apply a dpro config to a Gluon job: the ``compile`` knob, as ``hybridize(static_alloc=True)`` of the blocks it
names (``<root>``: the whole net; other paths as the recorder names blocks, ``0``, ``features.3``).

The compile probe (``dpro.plugins.mxnet.probes``) measured exactly this call, so the config applies what was priced.
A block whose hybridized forward fails (a ``hybrid_forward`` that reads an array's shape, an operator without a
symbol) runs imperative again, as it did before, from that call on, with a note: applying a config never stops the
job. A failure Gluon raises only in the backward is not caught.

The other knobs of a config for an MXNet job are the launcher's (``env``: ``DMLC_NUM_SERVER``,
``MXNET_KVSTORE_BIGARRAY_BOUND``); knobs the MXNet plugin cannot apply (``recompute``, ``amp``, ...) are named in
what ``apply`` returns.

Unmodified scripts under ``dpro-launch --apply`` get it at their first ``Trainer.step`` (``autoattach``). A loop of
one's own, once the net's parameters have their shapes (after ``initialize`` with known shapes, or its first
forward)::

    config = load_config(net=net, trainer=trainer)   # $DPRO_CONFIG, or None; refuses a config for another job
    if config is not None:
        apply(net, config)
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mxnet as mx

from dpro.config import DPRO_CONFIG, Config, check_fingerprint, knob_table, read_config
from dpro.engines.mxnet_ps import NAME as ENGINE_PS
from dpro.errors import ConfigError
from dpro.logs import get_logger
from dpro.plugins.mxnet.blocks import (
    HYBRIDIZED_BY_DPRO,
    find_block,
    hybrid_state,
    hybridize_region,
    hybridized_by_dpro,
    set_hybrid_state,
)
from dpro.plugins.mxnet.recorder import fingerprint_of

__all__ = ["APPLIED_ELSEWHERE", "FRAMEWORK", "SINGLE_WORKER_ENGINE", "apply", "apply_compile", "compiled",
           "fingerprint", "job_engine", "load_config", "world_size"]

logger = get_logger("dpro.plugins.mxnet")

FRAMEWORK = "mxnet"
SINGLE_WORKER_ENGINE = "mxnet"  # what the recorder writes without a dist kvstore
APPLIED_ELSEWHERE = ("env",)  # set by dpro-launch before the processes start
COMPILE = "compile"


def _kvstore_type(trainer: Any) -> str:
    """The trainer's kvstore type, created or only named (before its first step a trainer may hold the name)."""
    kv = getattr(trainer, "_kvstore", None)
    given = (getattr(trainer, "_kvstore_params", None) or {}).get("kvstore")
    kv = kv if kv is not None else given
    return str(kv.type) if isinstance(kv, mx.kvstore.KVStore) else str(kv or "")


def job_engine(trainer: Any) -> str:
    """The engine a run of this job records, which its configs name: ``mxnet-ps`` on a ``dist_*`` kvstore."""
    return ENGINE_PS if "dist" in _kvstore_type(trainer) else SINGLE_WORKER_ENGINE


def world_size(trainer: Any) -> int:
    """The job's workers: ps-lite's ``DMLC_NUM_WORKER`` on a dist kvstore, else 1."""
    if job_engine(trainer) != ENGINE_PS:
        return 1
    try:
        return max(1, int(os.environ.get("DMLC_NUM_WORKER", "1")))
    except ValueError:
        return 1


def fingerprint(net: Any, trainer: Any) -> str:
    """The model hash dpro records in run.json for this net and trainer (``recorder.fingerprint_of``)."""
    return fingerprint_of(net, list(trainer._params))


def load_config(path: str | Path | Config | None = None, *, net: Any, trainer: Any,
                force: bool = False) -> Config | None:
    """Read the config to apply to this job and check that it was made for it.

    Args:
        path: the config file (or a ``Config`` already read); None reads ``$DPRO_CONFIG``.
        net: the Gluon net the config will be applied to (its parameters' shapes known).
        trainer: the ``gluon.Trainer`` training it (its kvstore tells the engine).
        force: apply a config made for another job anyway (a warning lists what differs).

    Returns:
        The config, or None when no path is given and ``$DPRO_CONFIG`` is unset or empty.

    Raises:
        ConfigError: the file is not a valid config, or its fingerprint (framework "mxnet", the engine, world size,
            model hash) does not match the job and ``force`` is False.
    """
    if path is None:
        path = os.environ.get(DPRO_CONFIG) or None
        if path is None:
            return None
    config = path if isinstance(path, Config) else read_config(path)
    mismatches = check_fingerprint(config, framework=FRAMEWORK, engine=job_engine(trainer),
                                   world_size=world_size(trainer), model=fingerprint(net, trainer), force=force)
    if mismatches:
        warnings.warn(f"dpro: applying {config.source} although it was made for another job (force=True): "
                      + "; ".join(mismatches), stacklevel=2)
    return config


def _fallback_forward(block: Any, as_before: list[tuple[Any, dict[str, Any]]]) -> Any:
    """``block``'s forward, hybridized; until one call has run so, a failure puts the blocks' hybridization back as
    it was (``as_before``) and runs the call imperatively. Gluon's ``Block.__call__`` takes the instance's
    ``forward``."""
    original = type(block).forward

    def forward(*args: Any) -> Any:
        if getattr(block, HYBRIDIZED_BY_DPRO, False) != "pending" or not isinstance(args[0], mx.nd.NDArray):
            return original(block, *args)
        try:
            out = original(block, *args)
        except Exception as err:  # noqa: BLE001 - the user's hybrid_forward may raise anything on Symbols;
            # the block runs as it did before dpro hybridized it, and the job goes on
            set_hybrid_state(as_before)
            setattr(block, HYBRIDIZED_BY_DPRO, False)
            logger.warning("compile: %s runs imperative again: hybridizing it failed (%s: %s)",
                           type(block).__name__, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            return original(block, *args)
        setattr(block, HYBRIDIZED_BY_DPRO, True)
        return out

    return forward


def apply_compile(net: Any, paths: Iterable[str], *, source: str = "apply_compile") -> list[str]:
    """Hybridize the blocks ``paths`` name (``<root>``: ``net``) with ``static_alloc=True``, in place; each falls
    back to imperative if its first hybridized forward fails (``_fallback_forward``).

    Returns:
        The paths hybridized.

    Raises:
        ConfigError: a path names no block (nothing is hybridized then).
    """
    paths = list(paths)
    blocks = [(path, find_block(net, path)) for path in paths]
    missing = [path for path, block in blocks if block is None]
    if missing:
        raise ConfigError(source, f"{', '.join(missing)} names no block of {type(net).__name__} (paths as dpro's "
                          "recorder names them: 0, features.3; <root> for the whole net)", f'knobs["{COMPILE}"]')
    for _, block in blocks:
        if getattr(block, HYBRIDIZED_BY_DPRO, False):
            continue
        as_before = hybrid_state(block)
        hybridize_region(block)
        setattr(block, HYBRIDIZED_BY_DPRO, "pending")  # True once a hybridized forward ran
        block.forward = _fallback_forward(block, as_before)
    return paths


def compiled(net: Any) -> list[str]:
    """Paths of the blocks ``apply_compile`` hybridized that still run so."""
    return hybridized_by_dpro(net)


def apply(net: Any, config: Config) -> list[str]:
    """Apply the knobs of ``config`` the MXNet plugin applies (``compile``) to ``net``, in place.

    Returns:
        The knobs it cannot apply (the launcher applies ``env``; none of the others reach an MXNet job).

    Raises:
        ConfigError: a compile path names no block.
    """
    regions = config.knobs.get(COMPILE) or []
    if regions:
        apply_compile(net, regions, source=config.source)
    table = knob_table()
    return sorted(k for k, v in config.knobs.items()
                  if k not in (COMPILE, *APPLIED_ELSEWHERE) and v is not None and v != table[k].default)
