"""Communication engines, looked up by name: each one's knobs, how its collectives group the gradients, its
search for ``dpro optimize``, how its traces are completed at load time and how its config is applied.

An engine lives in one module (``torch_ddp``, ``horovod``) defining ``ENGINE``; the registry below names the
module and imports it on first use. Nothing outside an engine's module says its name. A run whose engine is not
registered (a single process, plain ``torch.distributed`` collectives) gets ``GENERIC``: no engine knobs, the
common search (recomputation) only.

Adding an engine: a module with ``ENGINE = Engine(...)`` and one line in ``REGISTRY``.
"""

from __future__ import annotations

import importlib

from dpro.engines.base import GENERIC, Engine

__all__ = ["GENERIC", "REGISTRY", "Engine", "engine_knobs", "engine_names", "get_engine"]

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


def engine_knobs() -> list:
    """Every registered engine's knobs (``dpro.config.Knob``), engine by engine."""
    return [knob for name in REGISTRY for knob in get_engine(name).knobs]
