"""Communication engines, looked up by name: each one's knobs, how its collectives group the gradients, its
search for ``dpro optimize``, how its traces complete a loaded run (``prepared``, ``load_prepared``: the step of
analysis after ``dpro.io.load.load_run``, which only reads) and how its config is applied.

An engine lives in one module (``torch_ddp``, ``horovod``) defining ``ENGINE``; the registry below names the
module and imports it on first use. Nothing outside an engine's module says its name. A run whose engine is not
registered (a single process, plain ``torch.distributed`` collectives) gets ``GENERIC``: no engine knobs, the
common search (recomputation) only.

Adding an engine: a module with ``ENGINE = Engine(...)`` and one line in ``REGISTRY``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from dpro.engines.base import GENERIC, Engine
from dpro.errors import TraceError
from dpro.io.load import Run, load_run
from dpro.io.pool import collector_paused

if TYPE_CHECKING:
    from dpro.config import Knob

__all__ = ["GENERIC", "REGISTRY", "Engine", "engine_knobs", "engine_names", "get_engine", "load_prepared",
           "prepared"]

REGISTRY: dict[str, str] = {
    "torch-ddp": "dpro.engines.torch_ddp",
    "horovod": "dpro.engines.horovod",
    "tf-mwms": "dpro.engines.tf_mwms",
    "mxnet-ps": "dpro.engines.mxnet_ps",
    "torch-fsdp": "dpro.engines.torch_fsdp",
}


def engine_names() -> list[str]:
    return list(REGISTRY)


def get_engine(name: str | None) -> Engine:
    """The engine named ``name`` (run.json's ``engine``); ``GENERIC`` for an engine dpro has no model of."""
    module = REGISTRY.get(name or "")
    if module is None:
        return GENERIC
    return importlib.import_module(module).ENGINE


def engine_knobs() -> list[Knob]:
    """Every registered engine's knobs (``dpro.config.Knob``), engine by engine."""
    return [knob for name in REGISTRY for knob in get_engine(name).knobs]


def prepared(run: Run) -> Run:
    """``run`` completed by its engine from the engine's own traces (``Engine.prepare_run``: Horovod merges its
    timeline, so each tensor's COMM ends with its fused buffer), once however often it is called; returns ``run``.

    A trace of the engine's that cannot be read is a problem of the run (``Run.problems``), not an error: the
    recorded events are kept.
    """
    if run.engine_prepared:
        return run
    run.engine_prepared = True
    try:
        get_engine((run.meta or {}).get("engine")).prepare_run(run)
    except TraceError as err:
        run.problems.append(f"{err}; the engine's own trace was not merged (the recorded events are kept)")
    for trace in run.ranks.values():
        trace.compact()  # what the engine changed, as columns again
    return run


def load_prepared(path: str | Path, *, jobs: int | None = None) -> Run:
    """``load_run`` then ``prepared``: the run every command analyzes (``jobs``: as ``load_run``'s)."""
    with collector_paused():
        return prepared(load_run(path, jobs=jobs))
