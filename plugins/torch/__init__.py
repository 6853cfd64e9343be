"""dpro's PyTorch plugin: record DDP and Lightning jobs (``Profiler``, ``lightning.DproCallback``)."""

from dpro.plugins.torch.profiler import Profiler
from dpro.plugins.torch.recorder import TorchRecorder

__all__ = ["Profiler", "TorchRecorder"]
