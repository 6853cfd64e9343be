"""How the workers of an MXNet job talk while recording: dpro's TCP side channel (``dpro.record.socket_transport``).

ps-lite has only push and pull, and every push of a key runs the optimizer on it on the servers (with
``update_on_kvstore``; the recorder's server probe pushes one key of its own only a few times, at most as often as the
trainer's keys were pushed), so the side channel pushes nothing: worker 0 listens on a port of its own:
``$DPRO_MXNET_PORT``, or the scheduler's port (``DMLC_PS_ROOT_PORT``) plus ``PORT_OFFSET``, or, when ps-lite's own
connections hold that one, a port the kernel picks. The others learn worker 0's address and port from
``$DPRO_MXNET_HOST`` and the port above, else from worker 0 itself through the kvstore: one small key
(``ADDRESS_KEY``), initialised by worker 0 and pulled by the others (``kv.broadcast``: an init and a pull, never a
push). ps-lite numbers the workers (``kv.rank``) by their addresses, so worker 0 can be on any host. Worker 0's
address is the one it reaches the scheduler from (``DMLC_NODE_HOST`` when set).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from dpro.errors import UsageError
from dpro.record.protocol import LocalTransport, Transport
from dpro.record.socket_transport import SocketTransport, side_port_of

__all__ = ["ADDRESS_KEY", "HOST_VARIABLE", "PORT_VARIABLE", "default_transport", "worker0_address"]

HOST_VARIABLE = "DPRO_MXNET_HOST"
PORT_VARIABLE = "DPRO_MXNET_PORT"
ADDRESS_KEY = 2**30 + 7919  # far above a trainer's keys (0 .. parameters - 1)
ADDRESS_CHARS = 64
ADDRESS_ATTRIBUTE = "_dpro_worker0_address"  # on the kvstore: the address, once broadcast


def _own_address(env: dict[str, str]) -> str:
    """The address this worker reaches the scheduler from (``DMLC_NODE_HOST`` when the launcher set it)."""
    if env.get("DMLC_NODE_HOST"):
        return env["DMLC_NODE_HOST"]
    scheduler = env.get("DMLC_PS_ROOT_URI") or "127.0.0.1"
    with socket.socket(socket.AF_INET6 if ":" in scheduler else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((scheduler, int(env.get("DMLC_PS_ROOT_PORT") or 9)))  # no packet is sent
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def worker0_address(kvstore: Any, env: dict[str, str], port: int | None = None) -> str:
    """Worker 0's address (``host`` or, given worker 0's ``port``, ``host|port``), sent by worker 0 to every worker
    through one kvstore key (init + pull), once per kvstore: a key is initialised only once (a second init is a push
    the other workers never match), so a later recording window of the same job reuses it."""
    import mxnet as mx

    known = getattr(kvstore, ADDRESS_ATTRIBUTE, None)
    if isinstance(known, str):
        return known
    text = (_own_address(env) + (f"|{port}" if port else "")) if int(kvstore.rank) == 0 else ""
    codes = [ord(c) for c in text[:ADDRESS_CHARS]] + [0] * (ADDRESS_CHARS - len(text[:ADDRESS_CHARS]))
    value = mx.nd.array(codes, dtype="float32")  # the servers store floating-point arrays only
    out = mx.nd.zeros((ADDRESS_CHARS,), dtype="float32")
    kvstore.broadcast(ADDRESS_KEY, value, out=out)
    address = "".join(chr(int(c)) for c in out.asnumpy() if c)
    setattr(kvstore, ADDRESS_ATTRIBUTE, address)
    return address


def default_transport(kvstore: Any, environ: dict[str, str] | None = None) -> Transport:
    """The side channel between the workers of ``kvstore`` (a ``dist_*`` kvstore); one process otherwise."""
    env = dict(os.environ) if environ is None else environ
    if kvstore is None or "dist" not in str(kvstore.type) or int(kvstore.num_workers) <= 1:
        return LocalTransport()
    try:
        port = int(env.get(PORT_VARIABLE) or side_port_of(int(env.get("DMLC_PS_ROOT_PORT", ""))))
    except ValueError as err:
        raise UsageError(f"{PORT_VARIABLE} / DMLC_PS_ROOT_PORT is not a port number: {err}") from err
    label, rank = "dpro's MXNet side channel", int(kvstore.rank)
    if env.get(HOST_VARIABLE):  # told where worker 0 listens: that port and no other
        return SocketTransport.connect(rank, int(kvstore.num_workers), env[HOST_VARIABLE], port, label=label,
                                       port_variable=PORT_VARIABLE)
    # worker 0 listens before it sends its address, with the port it got: a port of its own when ps-lite's
    # connections hold the one derived from the scheduler's (unless $DPRO_MXNET_PORT names one)
    listener = None
    if rank == 0 and getattr(kvstore, ADDRESS_ATTRIBUTE, None) is None:
        listener = SocketTransport.listen(_own_address(env), port, any_port=not env.get(PORT_VARIABLE), label=label,
                                          port_variable=PORT_VARIABLE)
    address = worker0_address(kvstore, env, listener.getsockname()[1] if listener is not None else None)
    host, _, got = address.partition("|")
    return SocketTransport.connect(rank, int(kvstore.num_workers), host, int(got or port), label=label,
                                   port_variable=PORT_VARIABLE, listener=listener)
