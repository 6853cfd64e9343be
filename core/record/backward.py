"""Backward spans from the moments gradients were ready: what a recorder writes as BW events when it marks
gradients, not every module's backward (cheaper: one mark per parameter, no hook per activation).

A backward pass runs its units one after another (the autograd engine's, or MXNet's, one thread), in the reverse
of their forward order, and a unit's parameter gradients are ready when its backward has produced them. So each unit
runs from the moment the gradients of the unit before it (in backward order) were ready to the moment its own were.
"""

from __future__ import annotations

__all__ = ["split_backward"]


def split_backward(order: list[tuple[str, float | None, float]], start_us: float, segment_us: float = 0.0,
                   busy: list[tuple[float, float]] | None = None) -> list[tuple[str, float, float, int]]:
    """Backward spans of units from when their gradients were ready.

    ``order``: (unit, gradients ready µs, forward µs) in backward order; ready is None for a unit without gradients
    of its own (an activation, a frozen layer): its backward runs before the next unit that has some, and shares
    that unit's span. ``start_us``: when the backward began. Units whose gradients came out within ``segment_us`` of
    the unit before (one bulked engine segment) share a span too. A shared span (a segment) is split in proportion
    to its units' forward times. ``busy``: other recorded work inside the backward ((start, end) µs, such as a
    checkpointed forward recomputed there): a segment's units start after such work that begins inside its span.
    Units without gradients after the last unit with some are left out (nothing bounds their end).
    Returns (unit, start µs, end µs, segment) in backward order; units of one segment share its number.
    """
    segments: list[tuple[list[tuple[str, float]], float]] = []  # (units with their forward µs, end)
    waiting: list[tuple[str, float]] = []
    previous = start_us
    for unit, ready, fw in order:
        waiting.append((unit, fw))
        if ready is None:
            continue
        ready = max(ready, previous)
        if segments and ready - previous <= segment_us and len(waiting) == 1:
            segments[-1] = (segments[-1][0] + waiting, ready)
        else:
            segments.append((waiting, ready))
        waiting = []
        previous = ready
    out: list[tuple[str, float, float, int]] = []
    begin = start_us
    for k, (units, end) in enumerate(segments):
        at = max([begin, *(stop for start, stop in busy or () if begin <= start < end)])
        at = min(at, end)
        weights = [max(fw, 1e-3) for _, fw in units]
        total, span = sum(weights), end - at
        for (unit, _), w in zip(units, weights, strict=True):
            stop = at + span * w / total
            out.append((unit, at, stop, k))
            at = stop
        begin = end
    return out
