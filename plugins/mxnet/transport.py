"""How the workers of an MXNet job talk while recording: dpro's TCP side channel (``dpro.record.socket_transport``).

ps-lite has only push and pull, and a recorder must not put keys of its own on the job's servers (with
``update_on_kvstore`` they would run the optimizer), so worker 0 listens on a port of its own: ``$DPRO_MXNET_PORT``,
or the scheduler's port (``DMLC_PS_ROOT_PORT``) plus ``PORT_OFFSET``, on ``$DPRO_MXNET_HOST`` or the scheduler's
host (``DMLC_PS_ROOT_URI``: worker 0 runs next to the scheduler, as ``dpro-launch --engine mxnet`` starts them).
Ranks are the kvstore's (``kv.rank``: ps-lite numbers the workers as they connect).
"""

from __future__ import annotations

import os
from typing import Any

from dpro.errors import UsageError
from dpro.record.protocol import LocalTransport, Transport
from dpro.record.socket_transport import SocketTransport, side_port_of

__all__ = ["HOST_VARIABLE", "PORT_VARIABLE", "default_transport"]

HOST_VARIABLE = "DPRO_MXNET_HOST"
PORT_VARIABLE = "DPRO_MXNET_PORT"


def default_transport(kvstore: Any, environ: dict[str, str] | None = None) -> Transport:
    """The side channel between the workers of ``kvstore`` (a ``dist_*`` kvstore); one process otherwise."""
    env = dict(os.environ) if environ is None else environ
    if kvstore is None or "dist" not in str(kvstore.type) or int(kvstore.num_workers) <= 1:
        return LocalTransport()
    host = env.get(HOST_VARIABLE) or env.get("DMLC_PS_ROOT_URI") or "127.0.0.1"
    try:
        port = int(env.get(PORT_VARIABLE) or side_port_of(int(env.get("DMLC_PS_ROOT_PORT", ""))))
    except ValueError as err:
        raise UsageError(f"{PORT_VARIABLE} / DMLC_PS_ROOT_PORT is not a port number: {err}") from err
    return SocketTransport.connect(int(kvstore.rank), int(kvstore.num_workers), host, port,
                                   label="dpro's MXNet side channel", port_variable=PORT_VARIABLE)
