"""Stage 5, cost: models fitted from the run itself (never constants from another cluster).

- ``CommModel``: time of an allreduce of ``bytes`` on ``world_size`` ranks, ring algorithm:
  ``2 (N-1) * latency + 2 (N-1) / N * bytes * seconds_per_byte``. Its shape is fitted on the all_reduce
  probe the recorder runs at a few sizes when recording starts (or on the in-step transfers), its level
  on the recorded run itself (``dpro.sim.whatif.calibrate``).
- ``MemoryModel``: peak memory from parameter, gradient, optimizer-state and activation bytes.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "CommModel",
    "MemoryModel",
    "OPTIMIZER_STATE_COPIES",
    "fit_comm_model",
    "memory_model",
    "robust_line",
    "scale_to_reach",
]


OPTIMIZER_STATE_COPIES = {"SGD": 1, "Adam": 2, "AdamW": 2, "RMSprop": 1, "Adagrad": 1}  # per parameter


@dataclass(frozen=True)
class CommModel:
    """Ring allreduce time in µs; ``latency_us`` per message hop, ``us_per_byte`` per byte and link."""

    latency_us: float
    us_per_byte: float
    world_size: int
    source: str = ""

    def allreduce_us(self, nbytes: float, world_size: int | None = None, bandwidth_scale: float = 1.0) -> float:
        n = world_size or self.world_size
        if n <= 1:
            return 0.0
        return 2 * (n - 1) * self.latency_us + 2 * (n - 1) / n * nbytes * self.us_per_byte / bandwidth_scale

    @property
    def gbit_per_s(self) -> float:
        return 8e-3 / self.us_per_byte if self.us_per_byte > 0 else float("inf")


def scale_to_reach(value_at: Callable[[float], float], target: float, lo: float, hi: float,
                   rounds: int = 24) -> float:
    """The scale in [``lo``, ``hi``] at which ``value_at`` (growing with the scale) reaches ``target``, by bisection on
    a log scale; an end where ``target`` lies beyond it. How each model is calibrated to the step a run recorded."""
    if value_at(lo) >= target:
        return lo
    if value_at(hi) <= target:
        return hi
    for _ in range(rounds):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if value_at(mid) < target else (lo, mid)
    return (lo * hi) ** 0.5


def _line(points: list[tuple[float, float]], *, relative: bool = False) -> tuple[float, float]:
    """Least-squares intercept and slope, both kept non-negative; with ``relative``, of the points' relative errors
    (each residual over its time; the plain line where a time is not positive or the slope comes out <= 0)."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    if len(set(x.tolist())) < 2:
        return float(max(np.median(y), 0.0)), 0.0
    relative = relative and bool((y > 0).all())
    w = 1.0 / y if relative else np.ones_like(y)
    intercept, slope = np.linalg.lstsq(np.column_stack([w, x * w]), y * w, rcond=None)[0]
    if slope <= 0:
        return _line(points) if relative else (float(max(np.median(y), 0.0)), 0.0)
    if intercept < 0:
        slope = float(np.sum(w * w * x * y) / np.sum(w * w * x * x))  # through the origin
        intercept = 0.0
    return float(intercept), float(slope)


def robust_line(samples: list[tuple[float, float]], intercept_quantile: float = 0.5) -> tuple[float, float] | None:
    """Intercept and slope (µs, µs per byte) of transfer time vs bytes, robust to outliers (Theil-Sen): the
    median slope over pairs of transfers whose sizes differ at least twofold, then the intercept at
    ``intercept_quantile`` of the residuals (the median; lower for times that waiting can only lengthen).
    ``None`` when no two transfers differ that much."""
    ordered = sorted(samples)
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(ordered) for x2, y2 in ordered[i + 1:]
              if x2 >= 2 * max(x1, 1.0)]
    if not slopes:
        return None
    slope = max(0.0, statistics.median(slopes))
    residuals = sorted(y - slope * x for x, y in samples)
    at = intercept_quantile * (len(residuals) - 1)
    low = int(at)
    intercept = residuals[low] + (at - low) * (residuals[min(low + 1, len(residuals) - 1)] - residuals[low])
    return max(0.0, intercept), slope


def fit_comm_model(transfers: list[tuple[float, float]], probe: list[list[float]], world_size: int) -> CommModel:
    """Fit a ``CommModel`` from the recording-time ``probe`` [[bytes, µs]] or in-step ``transfers``.

    The probe (all_reduce alone, at four sizes, on the job's own process group and network) gives the cleanest
    shape of latency vs bandwidth; in-step transfers overlap each other and backward, so they are used only when
    there is no probe. Each size counts by its mean: on a busy host an allreduce either runs at once or waits a
    scheduler slice for a core, whatever its size, so a step of many collectives pays the mean, and the median
    prices that wait as if it never came. The line fits the sizes' relative errors: a what-if moves bytes between
    collectives of every size, and a plain least-squares line, led by the largest size, can price the smallest at
    half or twice what they took. ``dpro.sim.whatif.calibrate`` then scales the model so the recorded
    configuration replays to its measured step.
    """
    n = max(world_size, 2)
    hops, frac = 2 * (n - 1), 2 * (n - 1) / n

    def to_model(intercept: float, slope: float, source: str) -> CommModel:
        return CommModel(latency_us=intercept / hops, us_per_byte=slope / frac, world_size=world_size, source=source)

    by_size: dict[float, list[float]] = defaultdict(list)
    for nbytes, us in probe:
        by_size[nbytes].append(us)
    if len(by_size) >= 2:
        return to_model(*_line([(b, statistics.fmean(v)) for b, v in by_size.items()], relative=True),
                        "all_reduce probe")
    sizes = sorted({b for b, _ in transfers})
    if len(sizes) >= 2:
        return to_model(*_line(transfers), "in-step transfers")
    if transfers:
        b, us = transfers[0]
        return to_model(0.0, us / b if b else 0.0, "one in-step size (no latency term)")
    return CommModel(0.0, 0.0, world_size, "nothing measured: communication treated as free")


@dataclass
class MemoryModel:
    """Peak memory of one rank, from byte counts the recorder stored in model.json."""

    param_bytes: int
    optimizer_copies: int
    activation_bytes: dict[str, int] = field(default_factory=dict)   # recorded module -> output bytes
    parents: dict[str, str | None] = field(default_factory=dict)

    def subtree(self, module: str) -> list[str]:
        prefix = module + "."
        return [m for m in self.activation_bytes if m == module or m.startswith(prefix)]

    def peak_bytes(self, recompute: list[str] | tuple[str, ...] = (), activation_scale: float = 1.0) -> int:
        """Parameters + gradients + optimizer state + the most activations alive at once (times
        ``activation_scale``: another precision, a smaller micro-batch).

        Without recomputation that is the end of the forward pass. A checkpointed module keeps only its
        output; its inner activations come back during its backward, when the activations of the
        modules after it (in forward order) are already freed.
        """
        order = list(self.activation_bytes)           # model.json lists modules in forward order
        inner_of = {m: [s for s in self.subtree(m) if s != m] for m in recompute}
        dropped = {s for inner in inner_of.values() for s in inner}
        kept = [m for m in order if m not in dropped]
        peak = sum(self.activation_bytes[m] for m in kept)
        for inner in inner_of.values():
            if not inner:
                continue
            first = min(order.index(s) for s in inner)
            before = sum(self.activation_bytes[m] for m in kept if order.index(m) < first)
            peak = max(peak, before + sum(self.activation_bytes[s] for s in inner))
        static = self.param_bytes * (2 + self.optimizer_copies)
        return int(static + peak * activation_scale)


def memory_model(model_json: dict[str, Any], knobs: dict[str, Any]) -> MemoryModel:
    """Build the memory model from model.json and the run's knobs (optimizer)."""
    activations = {m["name"]: int(m.get("activation_bytes") or 0) for m in model_json.get("modules", [])
                   if m.get("recorded")}
    parents = {m["name"]: m.get("parent") for m in model_json.get("modules", [])}
    copies = OPTIMIZER_STATE_COPIES.get(str(knobs.get("optimizer", "")), 1)
    return MemoryModel(int(model_json.get("param_bytes", 0)), copies, activations, parents)
