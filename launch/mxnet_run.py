"""The ``mxnet`` launcher: MXNet's parameter server (ps-lite) roles, a scheduler, servers and workers, each with
its ``DMLC_*`` environment, on this machine; every process is stopped when one fails. Its flag: ``--num-servers``."""

from __future__ import annotations

import argparse
import os
import shlex
import socket
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from dpro.engines.mxnet_ps import NUM_SERVERS_ENV, SERVER_HOSTS_ENV
from dpro.errors import UsageError
from dpro.launch.env import applied_env, job_env
from dpro.launch.launcher import Launcher, LauncherOptions
from dpro.launch.node import DEFAULT_GRACE_S
from dpro.launch.process import (
    Signals,
    Supervisor,
    _say,
    free_ports,
    start_local,
)

if TYPE_CHECKING:
    from dpro.launch.settings import LaunchConfig

# ---- the mxnet engine ----------------------------------------------------------------------------------

DMLC_ROLE = "DMLC_ROLE"


def dmlc_env(role: str, *, port: int, num_servers: int, num_workers: int) -> dict[str, str]:
    """The ps-lite environment of one process (what MXNet's tools/launch.py gives on one machine): its role
    (scheduler, server or worker), the scheduler's address and the job's shape."""
    return {DMLC_ROLE: role, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_SERVER": str(num_servers), "DMLC_NUM_WORKER": str(num_workers)}


@dataclass
class MXNetOptions(LauncherOptions):
    """``--num-servers``: parameter servers to start (None: one per worker, as MXNet's tools/launch.py)."""

    num_servers: int | None = None

    def check(self, config: LaunchConfig, engine: type[Launcher]) -> None:
        if engine is not MXNetLauncher:
            if self.num_servers is not None:
                raise UsageError(f"--num-servers starts MXNet parameter servers; the {engine.name} engine has none. "
                                 "Use --engine mxnet, or drop --num-servers")
            return
        if self.num_servers is not None and (not isinstance(self.num_servers, int) or self.num_servers < 1):
            raise UsageError(f"--num-servers {self.num_servers!r}: expected a positive number of servers")


def mxnet_servers(config: LaunchConfig) -> int:
    """How many parameter servers to start: the applied config's ``DMLC_NUM_SERVER`` (what dpro optimize chose),
    else ``--num-servers``, else one per worker (MXNet's launcher's default)."""
    applied = applied_env(config).get(NUM_SERVERS_ENV)
    if applied:
        try:
            count = int(applied)
        except ValueError:
            raise UsageError(f"{config.apply}: env {NUM_SERVERS_ENV}={applied!r} is not a number of servers") from None
        if count < 1:
            raise UsageError(f"{config.apply}: env {NUM_SERVERS_ENV}={applied!r}: at least one server is needed")
        given = config.options_of(MXNetOptions).num_servers
        if given and given != count:
            _say(f"{config.apply} sets {NUM_SERVERS_ENV}={count}; it overrides --num-servers {given}")
        return count
    return int(config.options_of(MXNetOptions).num_servers or config.np)


class MXNetLauncher(Launcher):
    """MXNet jobs on ps-lite (``kvstore`` ``dist_sync`` / ``dist_async``): a scheduler, ``--num-servers`` servers
    and one worker per slot, local hosts only. Every process runs the job's command with its DMLC_* environment:
    ``import mxnet`` in the scheduler or a server serves the job and exits (what MXNet's own launcher relies on).
    The job ends when its workers do: servers and scheduler left after the last worker exited get the grace
    period and are then killed; a process that fails stops all the others. (Workers are labelled in start
    order; ps-lite numbers them, ``kv.rank``, in the order they connect.)"""

    name = "mxnet"
    options_type = MXNetOptions
    local_only = True
    collectives = False
    what = "runs a ps-lite parameter server"
    nothing_recorded = "no gluon.Trainer.step ran in a worker (dpro records Gluon training loops)"

    @staticmethod
    def add_dpro_arguments(dpro: argparse._ArgumentGroup) -> None:
        dpro.add_argument("--num-servers", type=int, metavar="N",
                          help="--engine mxnet: parameter servers (default: as many as workers)")

    @classmethod
    def options_from_args(cls, args: argparse.Namespace) -> MXNetOptions:
        return MXNetOptions(num_servers=args.num_servers)

    def __init__(self, *, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.grace_s = grace_s

    def roles(self, config: LaunchConfig, port: int | None = None) -> list[tuple[str, dict[str, str]]]:
        """(label, DMLC_* environment) of every process in start order: scheduler, servers, workers."""
        port = free_ports(1)[0] if port is None else port
        servers = mxnet_servers(config)

        def env(role: str) -> dict[str, str]:
            # where the servers run, for the recorder's model of them (they share this machine)
            return {**dmlc_env(role, port=port, num_servers=servers, num_workers=config.np),
                    SERVER_HOSTS_ENV: ",".join([socket.gethostname()] * servers)}

        return ([("scheduler", env("scheduler"))] + [(f"server {k}", env("server")) for k in range(servers)]
                + [(f"worker {i}", env("worker")) for i in range(config.np)])

    def launch(self, config: LaunchConfig) -> int:
        """Start every process; the workers' first failure (or any failure) is the job's status."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
        env = {**base, **job_env(config)}
        supervisor = Supervisor(self.grace_s)
        files: list[IO[bytes]] = []
        workers: set[int] = set()
        roles = self.roles(config)
        try:
            with Signals(supervisor):
                try:
                    for index, (label, extra) in enumerate(roles):
                        if extra[DMLC_ROLE] == "worker":
                            workers.add(index)
                        files += self._start(config, label, (index, len(roles)), {**env, **extra}, supervisor)
                except BaseException:
                    supervisor.kill_all()
                    raise
                return supervisor.wait(essential=workers)
        finally:
            for f in files:
                f.close()

    def _start(self, config: LaunchConfig, label: str, position: tuple[int, int], env: dict[str, str],
               supervisor: Supervisor) -> list[IO[bytes]]:
        """Start one process; ``position``: (its index, the job's process count), for --output-filename."""
        argv = list(config.command)
        if config.verbose:
            _say(f"{label}: {env[DMLC_ROLE]} {shlex.join(argv)}")
        return start_local(config, label, argv, env, position, supervisor)
