"""Walking a Gluon net: its blocks by dotted path (the names of the recorder's ops and of the ``compile`` knob's
regions), and their hybridization. The recorder, the probes and the config's application share these."""

from __future__ import annotations

from typing import Any

import mxnet as mx
from mxnet import gluon

from dpro.record.trace import ROOT_MODULE

__all__ = ["HYBRIDIZED_BY_DPRO", "HYBRID_STATE", "block_paths", "find_block", "hybrid_blocks", "hybrid_state",
           "hybridize_region", "hybridized_by_dpro", "ndarrays", "runs_hybridized", "set_hybrid_state"]

HYBRIDIZED_BY_DPRO = "_dpro_hybridized"  # on a block a config's ``compile`` hybridized (dpro.plugins.mxnet.apply)
HYBRID_STATE = ("_active", "_flags", "_backend", "_backend_opts", "_cached_graph", "_cached_op", "_cached_op_args",
                "_in_format", "_out_format")  # what hybridize() and the first hybridized call set on a HybridBlock


def block_paths(net: Any) -> list[tuple[Any, str, str | None]]:
    """Every block under ``net`` with its dotted path (children's names as Gluon keys them: ``0``, ``features.3``;
    the net itself is ``""``) and its parent's path, outer blocks first. A block reached twice keeps its first
    path."""
    out: list[tuple[Any, str, str | None]] = [(net, "", None)]
    seen = {id(net)}

    def visit(block: Any, path: str) -> None:
        for name, child in getattr(block, "_children", {}).items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            child_path = f"{path}.{name}" if path else str(name)
            out.append((child, child_path, path))
            visit(child, child_path)

    visit(net, "")
    return out


def find_block(net: Any, path: str) -> Any | None:
    """The block at ``path`` (as ``block_paths`` names it; ``<root>``: ``net`` itself), or None."""
    if path == ROOT_MODULE:
        return net
    return next((block for block, at, _ in block_paths(net) if at == path), None)


def hybrid_blocks(block: Any) -> list[Any]:
    """``block`` and the blocks under it that can be hybridized (``gluon.HybridBlock``)."""
    return [b for b, _, _ in block_paths(block) if isinstance(b, gluon.HybridBlock)]


def runs_hybridized(block: Any) -> bool:
    """Whether ``block`` runs as a cached graph: it is an active HybridBlock, or (a plain Block) every HybridBlock
    under it is active."""
    if isinstance(block, gluon.HybridBlock):
        return bool(block._active)
    hybrid = hybrid_blocks(block)
    return bool(hybrid) and all(b._active for b in hybrid)


def hybridized_by_dpro(net: Any) -> list[str]:
    """Paths of the blocks a config's ``compile`` hybridized that still run so (``<root>`` for ``net``)."""
    return [path or ROOT_MODULE for block, path, _ in block_paths(net)
            if getattr(block, HYBRIDIZED_BY_DPRO, False) and runs_hybridized(block)]


def hybrid_state(block: Any) -> list[tuple[Any, dict[str, Any]]]:
    """The hybridization of ``block`` and of every HybridBlock under it (``HYBRID_STATE``), to put back later."""
    return [(b, {name: getattr(b, name) for name in HYBRID_STATE if hasattr(b, name)}) for b in hybrid_blocks(block)]


def set_hybrid_state(state: list[tuple[Any, dict[str, Any]]]) -> None:
    """Put back what ``hybrid_state`` saved (the same objects: a cached op built before runs again, not rebuilt)."""
    for block, saved in state:
        for name, value in saved.items():
            setattr(block, name, value)


def hybridize_region(block: Any) -> None:
    """What the ``compile`` knob does to a region: ``hybridize(static_alloc=True)`` (its HybridBlocks, a plain
    Block's hybrid children). ``static_shape`` is left off: a last batch of another size would rebuild the graph.
    Gluon's warning about forward hooks on a hybridized block is the caller's to handle."""
    block.hybridize(True, static_alloc=True)


def ndarrays(value: Any) -> list[Any]:
    """The NDArrays in ``value`` (an array, or lists and tuples of them, nested), in order."""
    if isinstance(value, mx.nd.NDArray):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in ndarrays(v)]
    return []
