"""The ``tf-mwms`` engine: TensorFlow's MultiWorkerMirroredStrategy (collective all-reduce between workers).

How it communicates (TensorFlow 2.21): Keras's optimizer all-reduces the gradients once the backward is done,
packed into ``bytes_per_pack``-sized all-reduces (``tf.distribute.experimental.CommunicationOptions``): the
gradients in reverse order of the model's variables (last layer first), a new pack once the current one holds
more than ``bytes_per_pack`` (0: one pack). Each pack is concatenated, all-reduced (``CollectiveReduceV2``, RING
or AUTO on CPU, NCCL on GPU) and split again. TensorFlow chains its collectives with ordering tokens, so one is
launched only after the one before it completed; the step's outputs (loss, metrics) are reduced the same way
after the update. The TF plugin records packs as ``COMM.pack<k>.allreduce``.

Knobs: ``tf.mwms.bytes_per_pack`` (what-if regroups the gradients by the rule above; optimize replays every
distinct packing) and ``tf.mwms.implementation`` (RING, AUTO, NCCL: applied, not priced). The TF plugin applies
both to the strategy's ``CommunicationOptions`` at the start of ``fit`` (``dpro.plugins.tf.apply``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from dpro.config import Knob, _count
from dpro.engines.base import Engine
from dpro.errors import ConfigError
from dpro.sim.choices import clears, optimize_common
from dpro.sim.whatif import predict

if TYPE_CHECKING:
    from dpro.sim.choices import OptimizeResult
    from dpro.sim.whatif import Context

__all__ = ["BYTES_PER_PACK", "ENGINE", "IMPLEMENTATION", "mwms_packs"]

NAME = "tf-mwms"
BYTES_PER_PACK = "tf.mwms.bytes_per_pack"
IMPLEMENTATION = "tf.mwms.implementation"
IMPLEMENTATIONS = ("AUTO", "RING", "NCCL")  # tf.distribute.experimental.CommunicationImplementation


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


def groups(ctx: Context, knobs: dict[str, Any]) -> list[list[str]] | None:
    if BYTES_PER_PACK not in knobs:
        return None
    return mwms_packs(ctx.gradients, int(knobs[BYTES_PER_PACK]))


PACK_CANDIDATES = (0, *(2**k for k in range(14, 29, 2)))  # one pack, then 16 KiB .. 256 MiB


def best_bytes_per_pack(ctx: Context) -> list[tuple[int, Any]]:
    """Replay every candidate ``bytes_per_pack`` (one per distinct packing, the smallest value that gives it);
    best first."""
    seen: set[tuple[int, ...]] = set()
    results = []
    for size in sorted(set(PACK_CANDIDATES) | {int(ctx.knobs.get(BYTES_PER_PACK) or 0)}):
        shape = tuple(len(p) for p in mwms_packs(ctx.gradients, size))
        if shape in seen:
            continue
        seen.add(shape)
        results.append((size, predict(ctx, {BYTES_PER_PACK: size})))
    return sorted(results, key=lambda sp: (sp[1].predicted_step_ms, sp[0]))


def sweeps(ctx: Context) -> list[tuple[str, list[Any]]]:
    """``bytes_per_pack`` over the sizes the search tries and the one in force (``dpro report``'s curves)."""
    return [(BYTES_PER_PACK, sorted({*PACK_CANDIDATES, int(ctx.knobs.get(BYTES_PER_PACK) or 0)}))]


def search(ctx: Context, *, memory_budget_bytes: int | None = None, allow_compression: bool = False) -> OptimizeResult:
    """MWMS's ``bytes_per_pack`` (every distinct packing replayed), then the common searches."""
    began = time.perf_counter()
    baseline = predict(ctx, {})
    in_force = int(ctx.knobs.get(BYTES_PER_PACK) or 0)
    ranked = best_bytes_per_pack(ctx)
    size, best = ranked[0]
    now = next((p for s, p in ranked if s == in_force), None) or predict(ctx, {BYTES_PER_PACK: in_force})
    gain = now.predicted_step_ms - best.predicted_step_ms
    knobs: dict[str, Any] = {}
    explain: list[dict[str, Any]] = []
    packs = len(mwms_packs(ctx.gradients, size))
    worth, shown = clears(ctx, gain, now.predicted_step_ms, change=({BYTES_PER_PACK: in_force}, {BYTES_PER_PACK: size}))
    if worth and size != in_force:
        knobs[BYTES_PER_PACK] = size
        explain.append({"knob": BYTES_PER_PACK, "predicted_gain_ms": gain,
                        "why": f"{_shown_bytes(size)} packs ({packs} all-reduces) instead of "
                               f"{_shown_bytes(in_force)}, {shown}: fewer chained collectives or more overlap"})
    else:
        explain.append({"knob": BYTES_PER_PACK, "predicted_gain_ms": 0.0,
                        "why": f"the best packing found ({_shown_bytes(size)}, {packs} all-reduces: "
                               f"{best.predicted_step_ms:.2f} ms against {now.predicted_step_ms:.2f} ms, {shown}) "
                               f"gains no more than the prediction can tell: {_shown_bytes(in_force)} is kept"})
    return optimize_common(ctx, memory_budget_bytes=memory_budget_bytes, allow_compression=allow_compression,
                           knobs=knobs, explain=explain, baseline=baseline, began=began)


def _shown_bytes(size: int) -> str:
    if size <= 0:
        return "one pack"
    return f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size / 2**10:g} KiB"


def _bytes_per_pack(value: Any, source: str, key: str) -> int:
    return _count(value, source, key)


def _implementation(value: Any, source: str, key: str) -> str:
    if not isinstance(value, str) or value.upper() not in IMPLEMENTATIONS:
        raise ConfigError(source, f"must be one of {', '.join(IMPLEMENTATIONS)}, found {value!r:.40}", key)
    return value.upper()


ENGINE = Engine(
    name=NAME,
    doc="TensorFlow MultiWorkerMirroredStrategy: gradients all-reduced in packs after the backward",
    knobs=(Knob(BYTES_PER_PACK, "bytes per gradient all-reduce pack of MultiWorkerMirroredStrategy (0: one pack)",
                _bytes_per_pack, default=0, engine=NAME),
           Knob(IMPLEMENTATION, "MultiWorkerMirroredStrategy's collective implementation (AUTO, RING, NCCL)",
                _implementation, default="AUTO", whatif=False, engine=NAME)),
    groups=groups,
    optimize=search,
    comm_knobs=(BYTES_PER_PACK,),
    apply="the strategy's CommunicationOptions, set by the TF plugin at the start of fit (DproCallback(config=), "
          "dpro-launch's auto-attach, dpro.plugins.tf.apply)",
    chained_launch=True,
    comm_after_backward=True,
    sweeps=sweeps,
)
