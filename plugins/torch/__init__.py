"""dpro's PyTorch plugin: record DDP and Lightning jobs (``Profiler``, ``lightning.DproCallback``) and apply
a dpro config to them (``load_config``, ``apply``, ``ddp_kwargs``)."""

from dpro.plugins.torch.apply import apply, ddp_kwargs, load_config
from dpro.plugins.torch.profiler import Profiler
from dpro.plugins.torch.recorder import TorchRecorder

__all__ = ["Profiler", "TorchRecorder", "apply", "ddp_kwargs", "load_config"]
