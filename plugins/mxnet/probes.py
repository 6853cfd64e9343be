"""The compile probe of a Gluon net, after the recorded window: each region of ``$DPRO_PROBE_COMPILE`` (block paths
as the recorder names them, ``<root>`` for the whole net, the default; "0": none) timed forward and backward on the
net's last recorded batch, imperative against ``hybridize(static_alloc=True)``, in alternating passes.

It prices the ``compile`` knob for MXNet the way ``dpro.plugins.torch.probes`` does for torch.compile, and writes the
same probe file (``RUN/probes/rank-<r>.json``, schema ``dpro.probes/1``), which ``dpro.io.probes`` reads: one entry
per region with ``compile`` set, ``ops`` the hybridized forward and backward (``FW``, ``BW``, median µs) and
``eager`` the same passes as the job runs them. What ``dpro.plugins.mxnet.apply`` does with a config's ``compile``
is what this measures: the same call, ``static_alloc`` only.

A pass runs as the job does, under ``autograd.record()``; the loss computed outside the net cannot be reached, so
its backward starts from the sum of the region's outputs. MXNet runs operators asynchronously: a forward ends when
its outputs are written (``wait_to_read``), a backward when the engine is idle again (``waitall``).

A probe must not change training: every gradient buffer keeps its values (copied before, written back after, the
same arrays, which the kvstore and the trainer hold), so do the parameters no gradient updates (BatchNorm's running
statistics), and every hybrid block's hybridization (active or not, flags, cached graph and op) is put back exactly
as it was; the trainer is never stepped. A region already hybridized is skipped, and anything that fails skips its
region with a note. MXNet 1.x cannot save its random generators' state: a net with dropout draws from them.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd

from dpro.plugins.mxnet.blocks import (
    find_block,
    hybrid_blocks,
    hybrid_state,
    hybridize_region,
    ndarrays,
    runs_hybridized,
    set_hybrid_state,
)
from dpro.record.protocol import compile_regions_wanted
from dpro.record.trace import PROBES_SCHEMA, Probe, probe_label, probes_file, write_json_atomic

__all__ = ["COMPILE_PASSES", "MIN_PASSES", "PROBE_BUDGET_S", "run_compile_probes", "training_state_kept",
           "write_probes"]

COMPILE_PASSES = 12  # imperative and hybridized passes, alternating, after the hybridized warm-up (the graph built)
MIN_PASSES = 3  # pairs timed at least, even past the budget
PROBE_BUDGET_S = 20.0  # no further pair (nor region) starts once the probes took this long


class _Skip(Exception):
    """A region the probe leaves out, and why (not a failure)."""


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _gradient_arrays(net: Any) -> list[Any]:
    return [g for p in net.collect_params().values() if p.grad_req != "null" and p._data is not None
            for g in p.list_grad()]


def _untrained_arrays(net: Any) -> list[Any]:
    """Parameters no gradient updates, which a training forward may write (BatchNorm's running statistics)."""
    return [d for p in net.collect_params().values() if p.grad_req == "null" and p._data is not None
            for d in p.list_data()]


@contextlib.contextmanager
def training_state_kept(net: Any) -> Iterator[None]:
    """Run probes without changing training: gradient buffers and untrained parameters keep their values (written
    back into the same arrays), every hybrid block its hybridization, whatever happens inside."""
    mx.nd.waitall()
    kept = [(a, a.copy()) for a in (*_gradient_arrays(net), *_untrained_arrays(net))]
    hybrid = hybrid_state(net)
    try:
        yield
    finally:
        mx.nd.waitall()  # nothing of a probe's pass still writes into the arrays put back
        set_hybrid_state(hybrid)
        for array, saved in kept:
            saved.copyto(array)
        mx.nd.waitall()


def _floating(array: Any) -> bool:
    return np.dtype(array.dtype).kind == "f"


def _probe_loss(output: Any) -> Any:
    """The sum of the region's floating outputs: a scalar whose backward reaches all it computed."""
    parts = [a.sum() for a in ndarrays(output) if _floating(a)]
    if not parts:
        raise ValueError("the region's output holds no floating array")
    return parts[0] if len(parts) == 1 else mx.nd.add_n(*parts)


def _timed_pass(block: Any, args: tuple[Any, ...]) -> tuple[float, float]:
    """One forward and backward of ``block`` under ``autograd.record()`` -> (forward µs, backward µs)."""
    mx.nd.waitall()
    t0 = time.perf_counter_ns()
    with autograd.record():
        output = block(*args)
        for array in ndarrays(output):
            array.wait_to_read()
        t1 = time.perf_counter_ns()
        loss = _probe_loss(output)
    loss.backward()
    mx.nd.waitall()
    t2 = time.perf_counter_ns()
    return (t1 - t0) / 1000.0, (t2 - t1) / 1000.0


def _paired_passes(block: Any, args: tuple[Any, ...], as_job: list[tuple[Any, dict[str, Any]]],
                   began: float) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """Two hybridized warm-up passes (the graph built, its memory allocated), then (imperative, hybridized) pairs:
    ``COMPILE_PASSES``, or ``MIN_PASSES`` once the budget is spent. Switching is setting saved attributes back: the
    cached op is built once."""
    for _ in range(2):
        _timed_pass(block, args)
    compiled = hybrid_state(block)
    pairs = []
    while len(pairs) < COMPILE_PASSES and (len(pairs) < MIN_PASSES or time.perf_counter() - began < PROBE_BUDGET_S):
        set_hybrid_state(as_job)
        eager = _timed_pass(block, args)
        set_hybrid_state(compiled)
        pairs.append((eager, _timed_pass(block, args)))
    return pairs


def _region_inputs(net: Any, block: Any, region: str, batch: tuple[Any, ...]) -> tuple[Any, ...]:
    """What ``block`` received in a training forward of ``net`` on the batch (its first call), detached; an input
    computed inside the net gets a gradient, as it did in the job (the batch's own arrays do not)."""
    if block is net:
        return batch
    seen: list[tuple[Any, ...]] = []

    def keep(_: Any, inputs: Any) -> None:
        if not seen:
            seen.append(tuple(inputs))

    handle = block.register_forward_pre_hook(keep)
    try:
        with autograd.record():
            net(*batch)
    finally:
        handle.detach()
    if not seen:
        raise ValueError(f"{region} was not called in the net's forward")
    given = {id(a) for a in ndarrays(batch)}
    return tuple(_detached(a, given) for a in seen[0])


def _detached(value: Any, given: set[int]) -> Any:
    if not isinstance(value, mx.nd.NDArray) or id(value) in given:
        return value
    out = value.detach()
    if _floating(out):
        out.attach_grad()
    return out


def _compile_probe(net: Any, region: str, batch: tuple[Any, ...], rows: int, began: float) -> Probe:
    """``region`` alone, imperative and hybridized in alternating passes (``_paired_passes``): each phase's median
    µs of both; the region's hybridization put back as it was."""
    block = find_block(net, region)
    if block is None:
        raise _Skip(f"no block at {region!r} (block paths as the recorder names them: 0, features.3)")
    if runs_hybridized(block):
        raise _Skip("it already runs hybridized")
    if not hybrid_blocks(block):
        raise _Skip("it holds no HybridBlock to hybridize")
    args = _region_inputs(net, block, region, batch)
    as_job = hybrid_state(block)
    try:
        with warnings.catch_warnings():  # Gluon warns of forward hooks on a hybridized block: the user's, left alone
            warnings.simplefilter("ignore")
            hybridize_region(block)
        pairs = _paired_passes(block, args, as_job, began)
    finally:
        set_hybrid_state(as_job)  # the next region sees the net as the job runs it
    eager_us = {phase: statistics.median(e[i] for e, _ in pairs) for i, phase in enumerate(("FW", "BW"))}
    ops = {phase: statistics.median(c[i] for _, c in pairs) for i, phase in enumerate(("FW", "BW"))}
    return Probe(None, rows, len(pairs), ops, sum(ops.values()), 0, compile=region, eager=eager_us)


def _batch_rows(batch: tuple[Any, ...] | None) -> int | None:
    """Dim 0 of the first array among the net's arguments."""
    arrays = ndarrays(list(batch or ()))
    return int(arrays[0].shape[0]) if arrays and arrays[0].ndim > 0 and arrays[0].shape[0] > 0 else None


def run_compile_probes(net: Any, batch: tuple[Any, ...] | None, rank: int) -> dict[str, Any]:
    """The compile probe of each wanted region on ``batch`` (the net's arguments in its last recorded forward), as
    a probe document (``dpro.probes/1``); a region that fails or cannot be probed is skipped with a note. No
    trainer is involved: nothing is stepped."""
    regions = compile_regions_wanted()
    rows = _batch_rows(batch)
    skipped: list[dict[str, str]] = []
    results: list[Probe] = []
    if regions and (batch is None or rows is None):
        why = "no forward of the net with a batch array was seen in the window"
        skipped = [{"probe": probe_label(None, None, r), "why": why} for r in regions]
    elif regions:
        began = time.perf_counter()
        with training_state_kept(net):
            for region in regions:
                why = _probe_region(net, region, batch, rows, began, results)
                if why:
                    skipped.append({"probe": probe_label(None, None, region), "why": why})
    return {"schema": PROBES_SCHEMA, "rank": rank, "batch": rows, "probes": [p.to_json() for p in results],
            "skipped": skipped, "note": "probe passes after the window: not part of the recorded steps; the compile "
                                        "probe times hybridize(static_alloc=True) against the net as it ran"}


def _probe_region(net: Any, region: str, batch: tuple[Any, ...], rows: int, began: float,
                  results: list[Probe]) -> str | None:
    """Probe one region into ``results``; the reason when it is skipped."""
    if time.perf_counter() - began > PROBE_BUDGET_S:
        return f"the probes had taken {PROBE_BUDGET_S:.0f} s already"
    try:
        results.append(_compile_probe(net, region, batch, rows, began))
    except _Skip as skip:
        return str(skip)
    except Exception as err:  # noqa: BLE001 - hybridizing the user's blocks may raise anything (a hybrid_forward
        # that reads shapes, an op without a symbol): the region is skipped and the job goes on
        return _why(err)
    return None


def write_probes(run_dir: Path, rank: int, doc: dict[str, Any]) -> None:
    """Write the probe document of ``rank`` (``probes_file``)."""
    path = Path(run_dir) / probes_file(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, doc)
