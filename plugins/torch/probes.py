"""Probe passes after the recorded window: the captured batch run again, forward and backward, under another
precision (``torch.autocast``) and in slices of the batch (dim 0), each module timed by the recorder's own hooks
(and, where a step ran several micro-batches, on all of them joined: fewer micro-batches are then priced between
probes, not beyond them); then regions of the model timed alone under ``torch.compile`` and without it, in paired
passes, the hooks removed.

They price three knobs by measurement, not by FLOP counts: ``amp`` (bf16 autocast can be several times slower than
fp32 on a CPU without bf16 units), ``micro_batches`` (ops do not scale linearly at small batches) and ``compile``
(the compiled region against its eager self). The results go to ``RUN/probes/rank-<r>.json`` (``dpro.io.probes``
reads them), never into the rank's trace, so no model of the recorded configuration sees them.

The compile probe compiles each region of ``$DPRO_PROBE_COMPILE`` (module paths, comma-separated; ``<root>``, the
whole model, when unset; "0": none) with ``torch.compile``, which wraps the module without changing it: nothing
compiled stays installed. Its regions' inputs are those the region received in an eager forward of the captured
batch. Compiling counts against the probes' budget.

A probe must not change training: every parameter's ``.grad`` (the object, so DDP's bucket views survive), every
buffer (BatchNorm's running statistics) and the RNG states are put back; the inner module runs under DDP's
``no_sync`` (no allreduce); the optimizer is never stepped. Anything that fails skips that probe with a note.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dpro.logs import get_logger
from dpro.record.protocol import compile_regions_wanted
from dpro.record.trace import PROBES_SCHEMA, ROOT_MODULE, Probe, probe_label, probes_file, write_json_atomic

if TYPE_CHECKING:
    from pathlib import Path

    from dpro.plugins.torch.recorder import TorchRecorder

__all__ = ["AMP_DTYPES", "COMPILE_PASSES", "MAX_JOINED", "PROBE_BUDGET_S", "PROBE_PASSES", "batch_size", "joined",
           "model_passes", "run_probes", "sliced", "training_state_kept", "write_probes"]

logger = get_logger("dpro.plugins.torch")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PROBE_PASSES = 3  # timed passes per probe, after one warm-up pass (autocast's first pass builds its casts)
PROBE_BUDGET_S = 60.0  # no further probe starts once the probes took this long (bf16 on a CPU may be 10x slower)
PROBED_FRACTIONS = (2, 4)  # micro-batch probes at B/2 and B/4 (a batch that divides)
MAX_JOINED = 8  # a step's micro-batches joined into one probe at most
COMPILE_PASSES = 15  # eager and compiled passes, alternating, after the compile's warm-up (a pass is cheap
# beside the compile; another rank compiling meanwhile makes single passes noisy)


@dataclass
class _Probes:
    results: list[Probe] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)

    def skip(self, probe: str, why: str) -> None:
        self.skipped.append({"probe": probe, "why": why})


def batch_size(batch: Any) -> int | None:
    """Dim 0 of the first tensor in a forward's arguments (tensors, or tuples/lists/dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        found = batch_size(item)
        if found is not None:
            return found
    return None


def sliced(batch: Any, full: int, rows: int) -> Any:
    """``batch`` with every tensor whose dim 0 is ``full`` cut to its first ``rows`` (others as they are)."""
    if isinstance(batch, torch.Tensor):
        return batch[:rows] if batch.dim() > 0 and batch.shape[0] == full else batch
    if isinstance(batch, dict):
        return {k: sliced(v, full, rows) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(sliced(v, full, rows) for v in batch)
    if isinstance(batch, list):
        return [sliced(v, full, rows) for v in batch]
    return batch


def joined(batches: list[Any], full: int) -> Any:
    """The micro-batches of one step as one batch: every tensor whose dim 0 is ``full`` concatenated along it
    (others taken from the last micro-batch).

    Raises:
        ValueError: the micro-batches differ in structure or in a tensor's other dims.
    """
    last = batches[-1]
    if isinstance(last, torch.Tensor):
        if not all(isinstance(b, torch.Tensor) and b.shape == last.shape for b in batches):
            raise ValueError("the micro-batches' tensors differ in shape")
        return torch.cat([b.detach() for b in batches]) if last.dim() > 0 and last.shape[0] == full else last
    if isinstance(last, dict):
        if any(not isinstance(b, dict) or b.keys() != last.keys() for b in batches):
            raise ValueError("the micro-batches differ in their keys")
        return {k: joined([b[k] for b in batches], full) for k in last}
    if isinstance(last, (tuple, list)):
        if any(not isinstance(b, (tuple, list)) or len(b) != len(last) for b in batches):
            raise ValueError("the micro-batches differ in structure")
        items = [joined([b[i] for b in batches], full) for i in range(len(last))]
        return tuple(items) if isinstance(last, tuple) else items
    return last


@contextlib.contextmanager
def training_state_kept(module: nn.Module) -> Iterator[None]:
    """Run a probe without changing training: gradients (set aside, the same objects put back), buffers and RNG
    states restored afterwards, whatever happens inside."""
    grads = [(p, p.grad) for p in module.parameters()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    for p, _ in grads:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in grads:
            p.grad = grad
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _probe_loss(output: Any) -> torch.Tensor | None:
    """A scalar whose backward reaches everything the output depends on: the sum of its floating tensors that need
    a gradient, in fp32 (the recorded loss is computed outside the model and cannot be run again safely)."""
    if isinstance(output, torch.Tensor):
        tensors = [output]
    elif isinstance(output, dict):
        tensors = list(output.values())
    elif isinstance(output, (tuple, list)):
        tensors = list(output)
    else:
        tensors = [getattr(output, k) for k in getattr(output, "keys", lambda: [])()]
    parts = [t.float().sum() for t in tensors
             if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    return torch.stack(parts).sum() if parts else None


def _one_pass(rec: TorchRecorder, args: tuple, kwargs: dict, amp: str | None) -> tuple[dict[str, float], float, int]:
    """One forward and backward of the inner module, timed by the recorder's hooks (``TorchRecorder.probe_pass``),
    under autocast when ``amp``, its backward from ``_probe_loss``."""
    device = "cuda" if rec.cuda else "cpu"
    cast = torch.autocast(device, dtype=AMP_DTYPES[amp]) if amp else contextlib.nullcontext()
    return rec.probe_pass(args, kwargs, cast, _probe_loss)


def _probe(rec: TorchRecorder, args: tuple, kwargs: dict, amp: str | None, rows: int) -> Probe:
    _one_pass(rec, args, kwargs, amp)  # warm-up
    passes = [_one_pass(rec, args, kwargs, amp) for _ in range(PROBE_PASSES)]
    names = set().union(*(p[0] for p in passes))
    ops = {n: statistics.median(p[0].get(n, 0.0) for p in passes) for n in sorted(names)}
    return Probe(amp, rows, len(passes), ops, statistics.median(p[1] for p in passes), passes[-1][2])


def _variants(full: int, step_rows: int | None = None) -> list[tuple[str | None, int]]:
    """The probes to run, cheapest first: the batch as recorded (the reference every other probe is compared
    with), its slices, the step's micro-batches joined (``step_rows``), then each precision."""
    out: list[tuple[str | None, int]] = [(None, full)]
    out += [(None, full // k) for k in PROBED_FRACTIONS if full % k == 0 and full // k >= 1]
    out += [(None, step_rows)] if step_rows else []
    out += [(amp, full) for amp in AMP_DTYPES]
    return out


Batch = tuple[tuple, dict, bool]  # a forward's arguments, and whether its forward was replaced for that call


def run_probes(rec: TorchRecorder, batch: Batch | None, step_batches: list[Batch] | None = None) -> dict[str, Any]:
    """Run the probes on ``batch`` (the inner module's last recorded forward arguments, and whether its forward was
    replaced for that call; ``step_batches``: every forward of the last recorded step, joined into one probe where
    there are several) and return the probe document (``dpro.probes/1``); a failed probe is skipped with a note."""
    found = _Probes()
    why = _cannot_rerun(rec, batch)
    if why is not None:
        found.skip("all", why)
    else:
        full = batch_size(batch[:2])
        _probe_all(rec, batch, full, found, _step_batch(step_batches or [], full, found))
    return {"schema": PROBES_SCHEMA, "rank": rec.rank, "batch": batch_size(batch[:2]) if why is None else None,
            "probes": [r.to_json() for r in found.results],
            "skipped": found.skipped, "note": "probe passes after the window: not part of the recorded steps"}


def _step_batch(batches: list[Batch], full: int, found: _Probes) -> Batch | None:
    """A step's micro-batches (``full`` rows each) joined into one batch; None for a step of one forward, or with
    a note where they cannot be joined."""
    if len(batches) < 2:
        return None
    label = probe_label(None, full * len(batches))
    if len(batches) > MAX_JOINED:
        found.skip(label, f"the step ran more than {MAX_JOINED} forwards")
        return None
    if any(b[2] or batch_size(b[:2]) != full for b in batches):
        found.skip(label, "the step's micro-batches differ in rows, or ran through a replaced forward")
        return None
    try:
        return joined([b[0] for b in batches], full), joined([b[1] for b in batches], full), False
    except ValueError as err:
        found.skip(label, str(err))
        return None


def _cannot_rerun(rec: TorchRecorder, batch: Batch | None) -> str | None:
    """Why the captured ``batch`` cannot be run through the model again after the window; None where it can."""
    if batch is None or batch_size(batch[:2]) is None:
        return "no forward of the model with a batch tensor was seen in the window"
    if len(batch) > 2 and batch[2]:
        return ("the model was called through a forward put on the instance for that call (Lightning runs "
                "training_step that way): its arguments are not its forward's")
    if any(isinstance(m, nn.SyncBatchNorm) for m in rec.module.modules()):
        return "the model has SyncBatchNorm, whose forward communicates"
    return None


@contextlib.contextmanager
def model_passes(rec: TorchRecorder, batch: Batch | None) -> Iterator[Callable[[], None] | None]:
    """A forward and backward of the inner module on the captured ``batch`` as a callable (DDP's allreduce off,
    training state kept while the context is open): the interference probes' compute, the job's own ops rather than
    a stand-in kernel (a memory-bound backward suffers more beside a collective's copies than a cached matrix
    product). None where the batch cannot be run again or its pass fails."""
    if rec.module is None or _cannot_rerun(rec, batch) is not None:
        yield None
        return
    args, kwargs, _ = batch
    with _no_sync(rec), training_state_kept(rec.module), torch.enable_grad():

        def compute() -> None:
            _timed_pass(rec.module, args, kwargs, rec.cuda)

        try:
            compute()  # the first pass allocates; one that fails leaves the probes their stand-in kernel
        except Exception as err:  # noqa: BLE001 - the user's model may raise anything; dpro never fails a job
            logger.info("%s: the model's pass cannot be rerun for the interference probes (%s)", rec.who, _why(err))
            yield None
            return
        yield compute


def _probe_all(rec: TorchRecorder, batch: Batch, full: int, found: _Probes, step_batch: Batch | None) -> None:
    began = time.perf_counter()
    _hooked_probes(rec, batch, full, found, began, step_batch)
    _compile_probes(rec, batch, full, found, began)


def _no_sync(rec: TorchRecorder) -> contextlib.AbstractContextManager:
    return rec.ddp.no_sync() if rec.ddp is not None else contextlib.nullcontext()


def _hooked_probes(rec: TorchRecorder, batch: Batch, full: int, found: _Probes, began: float,
                   step_batch: Batch | None = None) -> None:
    """The probes timed by the recorder's hooks: the batch as recorded, its slices, the step's micro-batches joined
    (``step_batch``, where the memory it needs is free), each precision."""
    args, kwargs, _ = batch
    step_rows = batch_size(step_batch[:2]) if step_batch is not None else None
    sync_off = _no_sync(rec)
    try:
        rec._install_hooks()  # inside: hooks a failed install left in place are removed below
        rec._recording = True
        # enable_grad: the auto-attach closes its recorder from an optimizer's step hook
        with sync_off, training_state_kept(rec.module), torch.enable_grad():
            for amp, rows in _variants(full, step_rows):
                label = probe_label(amp, rows)
                if time.perf_counter() - began > PROBE_BUDGET_S:
                    found.skip(label, f"the probes had taken {PROBE_BUDGET_S:.0f} s already")
                    continue
                if found.results == [] and (amp, rows) != (None, full):
                    found.skip(label, "the reference probe (the batch as recorded) failed")
                    continue
                if rows > full and not _memory_for(rec, found.results[0], rows / full):
                    found.skip(label, "the device's free memory may not hold the step's micro-batches at once")
                    continue
                inputs = step_batch[:2] if rows > full else (sliced(args, full, rows), sliced(kwargs, full, rows))
                try:
                    found.results.append(_probe(rec, *inputs, amp, rows))
                except Exception as err:  # noqa: BLE001 - the user's model on a cut batch may raise anything;
                    # the probe is skipped and the job goes on (dpro never fails a job)
                    found.skip(label, _why(err))
    finally:
        rec._recording = False
        rec._remove_hooks()
        rec._log = None


def _memory_for(rec: TorchRecorder, reference: Probe, times: float) -> bool:
    """Whether a pass ``times`` the reference's rows fits the GPU's free memory twice over (a job accumulates
    gradients to fit its memory: dpro must not run it out); always on the CPU."""
    if not rec.cuda:
        return True
    free, _ = torch.cuda.mem_get_info()
    return free > 2 * times * reference.activation_bytes


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _compile_probes(rec: TorchRecorder, batch: Batch, full: int, found: _Probes,
                    began: float) -> None:
    """Each wanted region timed under torch.compile against itself eager (``_compile_probe``), the recorder's hooks
    removed (Dynamo must not trace them), training state kept, DDP's allreduce off; skipped with a note when the
    model already runs compiled, once the probes' budget is spent, or when compiling fails."""
    regions = compile_regions_wanted()
    if regions and rec.runs_compiled:
        for region in regions:
            found.skip(probe_label(None, full, region), "the model already runs under torch.compile")
        return
    args, kwargs, _ = batch
    with _no_sync(rec), training_state_kept(rec.module), torch.enable_grad():
        for region in regions:
            label = probe_label(None, full, region)
            if time.perf_counter() - began > PROBE_BUDGET_S:
                found.skip(label, f"the probes had taken {PROBE_BUDGET_S:.0f} s already")
                continue
            try:
                found.results.append(_compile_probe(rec, region, args, kwargs, full))
            except Exception as err:  # noqa: BLE001 - compiling the user's model may raise anything (Dynamo,
                # inductor, the C++ compiler): the probe is skipped and the job goes on
                found.skip(label, _why(err))


def _compile_probe(rec: TorchRecorder, region: str, args: tuple, kwargs: dict, full: int) -> Probe:
    """``region`` alone, forward and backward (of ``_probe_loss``), eager and compiled in alternating passes after
    two compiled warm-up passes (the compile): each phase's median µs of both."""
    if region == ROOT_MODULE:
        module, inputs = rec.module, (args, kwargs)
    else:
        module = rec.module.get_submodule(region)
        inputs = _region_inputs(rec.module, module, region, args, kwargs)
    compiled = torch.compile(module)  # a wrapper: ``module`` itself is left as it was
    try:
        for _ in range(2):  # warm-up: Dynamo traces, inductor compiles forward and backward (again if a guard fails)
            _timed_pass(compiled, *inputs, rec.cuda)
        pairs = [(_timed_pass(module, *inputs, rec.cuda), _timed_pass(compiled, *inputs, rec.cuda))
                 for _ in range(COMPILE_PASSES)]
    finally:
        del compiled
    eager = {phase: statistics.median(e[i] for e, _ in pairs) for i, phase in enumerate(("FW", "BW"))}
    ops = {phase: statistics.median(c[i] for _, c in pairs) for i, phase in enumerate(("FW", "BW"))}
    return Probe(None, full, len(pairs), ops, sum(ops.values()), 0, compile=region, eager=eager)


def _timed_pass(module: Any, args: tuple, kwargs: dict, cuda: bool) -> tuple[float, float]:
    """One forward and backward of ``module`` -> (forward µs, backward µs), the device synchronised at each mark."""
    def mark() -> int:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter_ns()

    t0 = mark()
    output = module(*args, **kwargs)
    t1 = mark()
    loss = _probe_loss(output)
    if loss is None:
        raise ValueError("the region's output holds no floating tensor that needs a gradient")
    loss.backward()
    t2 = mark()
    return (t1 - t0) / 1000.0, (t2 - t1) / 1000.0


def _region_inputs(model: nn.Module, module: nn.Module, region: str, args: tuple,
                   kwargs: dict) -> tuple[tuple, dict]:
    """What ``module`` received in an eager forward of ``model`` on the batch (its first call), detached from that
    forward's graph, each floating tensor needing a gradient as it did."""
    seen: list[tuple[tuple, dict]] = []

    def keep(_: nn.Module, a: tuple, kw: dict) -> None:
        if not seen:
            seen.append((a, kw))

    handle = module.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        model(*args, **kwargs)
    finally:
        handle.remove()
    if not seen:
        raise ValueError(f"{region} was not called in the model's forward")
    return _detached(seen[0][0]), _detached(seen[0][1])


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value) if not hasattr(value, "_fields") else value
    return value


def write_probes(run_dir: Path, rank: int, doc: dict[str, Any]) -> None:
    """Write the probe document of ``rank`` (``probes_file``)."""
    path = run_dir / probes_file(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, doc)
