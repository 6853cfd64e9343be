"""The ``torch-fsdp`` engine's name and knobs as dpro spells them, shared by the engine and the torch plugin."""

from __future__ import annotations

from dpro.io.kineto import TRACES_DIR

__all__ = ["NAME", "RESHARD", "TRACES_DIR"]

NAME = "torch-fsdp"
RESHARD = "torch.fsdp.reshard_after_forward"   # fully_shard's reshard_after_forward, for the units inside the root
