"""The ``torch-fsdp`` engine: PyTorch's fully sharded data parallelism (FSDP2, ``fully_shard``), recorded by the
profiler (``dpro.plugins.torch.fsdp``: each rank's trace in the run's ``traces/``); its knob
``torch.fsdp.reshard_after_forward`` is priced on those traces (``traces.resharded_traces``)."""

from __future__ import annotations

from typing import Any

from dpro.config import Knob
from dpro.engines.base import Engine
from dpro.engines.torch_fsdp.knobs import NAME, RESHARD, TRACES_DIR
from dpro.engines.torch_fsdp.traces import optimize_resharding, resharded_traces
from dpro.errors import ConfigError

__all__ = ["ENGINE", "NAME", "RESHARD", "TRACES_DIR"]


def _reshard(value: Any, source: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(source, f"must be true or false, got {value!r}", key)
    return value


ENGINE = Engine(
    name=NAME,
    doc="PyTorch FSDP2 (fully_shard): parameters sharded over the ranks, gathered per unit for its forward and "
        "backward, gradients reduce-scattered; recorded by the profiler",
    knobs=(Knob(RESHARD, "free each unit's gathered parameters after its forward (true: FSDP2's default for the "
                         "units inside the root) or keep them to the backward (false: no backward all-gather, more "
                         "memory)", _reshard, default=True, engine=NAME),),
    comm_knobs=(RESHARD,),
    trace_whatif=resharded_traces,
    trace_optimize=optimize_resharding,
    apply="fully_shard(reshard_after_forward=) of every unit but the root, set by dpro-launch's auto-attach where "
          "the script calls fully_shard",
)
