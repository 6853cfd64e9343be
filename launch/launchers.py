"""The launchers that start a job, by name (``--engine``), in the order their flags and defaults are taken: each a
``dpro.launch.launcher.Launcher`` in a module of its own over the shared process plumbing (``dpro.launch.process``),
with ``command(config)`` (the argv lists it will run: one per host for torch, one per worker for tf; ``--verbose``
prints them), ``launch(config)`` (runs the job, returns its exit status) and the protocol's hooks (its flags, its
options, its environment). The first is the default. A new launcher is a module and one line here."""

from __future__ import annotations

from dpro.launch.horovod_run import HorovodLauncher
from dpro.launch.launcher import Launcher
from dpro.launch.mxnet_run import MXNetLauncher
from dpro.launch.tf_run import TFLauncher
from dpro.launch.torch_run import TorchLauncher

__all__ = ["LAUNCHERS", "HorovodLauncher", "MXNetLauncher", "TFLauncher", "TorchLauncher"]

LAUNCHERS: dict[str, type[Launcher]] = {
    launcher.name: launcher for launcher in (TorchLauncher, HorovodLauncher, TFLauncher, MXNetLauncher)}
