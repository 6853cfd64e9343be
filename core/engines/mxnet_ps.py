"""The ``mxnet-ps`` engine: MXNet's kvstore parameter server (``dist_sync`` on ps-lite).

How it communicates (MXNet 1.9): ``gluon.Trainer.step`` issues one ``pushpull`` per parameter, key = the
parameter's index in the trainer, priority ``-key``. The engine runs it once the gradient is written: one ps-lite
request carries the gradient to the key's servers, and each server answers once every worker's push of the key has
arrived (with ``update_on_kvstore``, the default on a ``dist`` kvstore, after running the optimizer on it). A key
of fewer than ``MXNET_KVSTORE_BIGARRAY_BOUND`` elements lives on one server, ``(key * 9973) % num_servers``; a
larger one is split evenly over all servers (``key_servers``). A server handles its requests one after another,
so a server holding many or large keys is a hot spot.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["BIGARRAY_BOUND", "DEFAULT_BIGARRAY_BOUND", "NAME", "NUM_SERVERS", "bigarray_bound", "key_servers"]

NAME = "mxnet-ps"
BIGARRAY_BOUND = "mxnet.kvstore.bigarray_bound"
NUM_SERVERS = "num_servers"
DEFAULT_BIGARRAY_BOUND = 1_000_000          # MXNET_KVSTORE_BIGARRAY_BOUND's default (elements)
BIGARRAY_BOUND_ENV = "MXNET_KVSTORE_BIGARRAY_BOUND"
NUM_SERVERS_ENV = "DMLC_NUM_SERVER"
KEY_SPREAD = 9973                           # MXNet's multiplier spreading small keys over the servers


def bigarray_bound(environ: Mapping[str, str]) -> int:
    """The partition bound in force (elements), from ``MXNET_KVSTORE_BIGARRAY_BOUND`` or MXNet's default."""
    try:
        return max(1, int(environ.get(BIGARRAY_BOUND_ENV, DEFAULT_BIGARRAY_BOUND)))
    except ValueError:
        return DEFAULT_BIGARRAY_BOUND


def key_servers(key: int, elements: int, num_servers: int, bound: int) -> list[tuple[int, float]]:
    """The servers holding kvstore key ``key`` of ``elements`` elements, each with its share of the key:
    one server below ``bound`` elements, else an even split over all ``num_servers`` (MXNet's rule)."""
    servers = max(1, int(num_servers))
    if elements < bound or servers == 1:
        return [((key * KEY_SPREAD) % servers, 1.0)]
    cuts = [round(elements / servers * i) for i in range(servers + 1)]
    return [(i, (cuts[i + 1] - cuts[i]) / elements) for i in range(servers)]
