"""The ``tf-mwms`` engine: TensorFlow's MultiWorkerMirroredStrategy (collective all-reduce between workers).

How it communicates (TensorFlow 2.21): Keras's optimizer all-reduces the gradients once the backward is done,
packed into ``bytes_per_pack``-sized all-reduces (``tf.distribute.experimental.CommunicationOptions``): the
gradients in reverse order of the model's variables (last layer first), a new pack once the current one holds
more than ``bytes_per_pack`` (0: one pack). Each pack is concatenated, all-reduced (``CollectiveReduceV2``, RING
or AUTO on CPU, NCCL on GPU) and split again. TensorFlow chains its collectives with ordering tokens, so one is
launched only after the one before it completed; the step's outputs (loss, metrics) are reduced the same way
after the update. The TF plugin records packs as ``COMM.pack<k>.allreduce``.

Knob: ``tf.mwms.bytes_per_pack`` (what-if regroups the gradients by the rule above). Not applied from a config
yet: the user passes it to the strategy's ``CommunicationOptions``.
"""

from __future__ import annotations

from typing import Any

from dpro.config import Knob, _count
from dpro.engines.base import Engine

__all__ = ["BYTES_PER_PACK", "ENGINE", "mwms_packs"]

NAME = "tf-mwms"
BYTES_PER_PACK = "tf.mwms.bytes_per_pack"


def mwms_packs(gradients_ready_order: list[tuple[str, int]], bytes_per_pack: int) -> list[list[str]]:
    """MWMS's packs of gradients given in ready order (the reverse of the model's variable order, which is the
    order MWMS packs in): a new pack once the current one holds more than ``bytes_per_pack``; 0: one pack."""
    if bytes_per_pack <= 0:
        return [[n for n, _ in gradients_ready_order]] if gradients_ready_order else []
    packs: list[list[str]] = []
    size = 0
    for name, nbytes in gradients_ready_order:
        if not packs or size > bytes_per_pack:
            packs.append([])
            size = 0
        packs[-1].append(name)
        size += nbytes
    return packs


def groups(ctx: Any, knobs: dict[str, Any]) -> list[list[str]] | None:
    if BYTES_PER_PACK not in knobs:
        return None
    return mwms_packs(ctx.gradients, int(knobs[BYTES_PER_PACK]))


def _bytes_per_pack(value: Any, source: str, key: str) -> int:
    return _count(value, source, key)


ENGINE = Engine(
    name=NAME,
    doc="TensorFlow MultiWorkerMirroredStrategy: gradients all-reduced in packs after the backward",
    knobs=(Knob(BYTES_PER_PACK, "bytes per gradient all-reduce pack of MultiWorkerMirroredStrategy (0: one pack)",
                _bytes_per_pack, default=0, config=False, engine=NAME),),
    groups=groups,
    comm_knobs=(BYTES_PER_PACK,),
    apply="not applied by dpro yet: pass tf.distribute.experimental.CommunicationOptions(bytes_per_pack=...) to "
          "the strategy",
    chained_launch=True,
)
