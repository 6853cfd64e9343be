"""The launchers that start a job, by name (``--engine``): each a small class with ``command(config)`` (the argv
lists it will run: one per host for torch, one per worker for tf; ``--verbose`` prints them) and ``launch(config)``
(runs the job, returns its exit status), in a module of its own over the shared process plumbing
(``dpro.launch.process``). A new launcher is a module and one line here."""

from __future__ import annotations

from dpro.launch.horovod_run import HorovodLauncher
from dpro.launch.mxnet_run import MXNetLauncher
from dpro.launch.tf_run import TFLauncher
from dpro.launch.torch_run import TorchLauncher

__all__ = ["LAUNCHERS", "HorovodLauncher", "MXNetLauncher", "TFLauncher", "TorchLauncher"]

LAUNCHERS: dict[str, type] = {TorchLauncher.name: TorchLauncher, HorovodLauncher.name: HorovodLauncher,
                              TFLauncher.name: TFLauncher, MXNetLauncher.name: MXNetLauncher}
