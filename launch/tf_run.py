"""The ``tf`` launcher: one process per slot (this machine only) with ``TF_CONFIG`` naming every worker, as
tf.distribute's ``MultiWorkerMirroredStrategy`` expects, and dpro's environment; every worker is stopped when one
fails."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from dpro.errors import UsageError
from dpro.launch.env import job_env
from dpro.launch.launcher import Launcher, LauncherOptions
from dpro.launch.node import DEFAULT_GRACE_S
from dpro.launch.process import (
    Signals,
    Supervisor,
    _say,
    address,
    free_ports,
    start_local,
)
from dpro.launch.torch_run import socket_ifname_env

if TYPE_CHECKING:
    from dpro.launch.settings import LaunchConfig

# ---- the tf engine -----------------------------------------------------------------------------------


TF_CONFIG = "TF_CONFIG"
TF_SIDE_PORT = "DPRO_TF_PORT"  # the TF plugin's side channel (run directory, clocks) between the workers


def tf_cluster(config: LaunchConfig, ports: list[int]) -> list[str]:
    """The workers' ``host:port`` in rank order: each host's slots are filled before the next (as for torch)."""
    hosts = [host for host, n in config.placement() for _ in range(n)]
    if len(ports) != len(hosts):
        raise UsageError(f"--engine tf: {len(hosts)} workers need {len(hosts)} ports, got {len(ports)}")
    return [address(host, port) for host, port in zip(hosts, ports, strict=True)]


def tf_config(cluster: list[str], index: int) -> str:
    """The ``TF_CONFIG`` of worker ``index``: the whole cluster and this worker's task."""
    return json.dumps({"cluster": {"worker": cluster}, "task": {"type": "worker", "index": index}})


@dataclass
class TFOptions(LauncherOptions):
    """The tf launcher has no flags of its own; running the job, it gives ``--network-interfaces`` to the
    collectives' libraries (TF's collectives go over gloo/NCCL as torch's do)."""

    def engine_env(self, config: LaunchConfig) -> dict[str, str]:
        return socket_ifname_env(config)


class TFLauncher(Launcher):
    """TensorFlow jobs (``tf.distribute.MultiWorkerMirroredStrategy``): one process per slot, each with its
    ``TF_CONFIG``; local hosts only (``LaunchConfig`` refuses others)."""

    name = "tf"
    options_type = TFOptions
    local_only = True
    nothing_recorded = "the TensorFlow job got no dpro recorder"

    def __init__(self, *, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.grace_s = grace_s

    def command(self, config: LaunchConfig, ports: list[int] | None = None) -> list[list[str]]:
        """One argv per worker, in rank order: ``env TF_CONFIG=<json> COMMAND...``, which ``launch`` runs as is.

        ``ports`` (one per worker) default to free ports of this machine.
        """
        ports = free_ports(config.np + 1) if ports is None else list(ports)
        cluster = tf_cluster(config, ports[:config.np])
        side = [f"{TF_SIDE_PORT}={ports[config.np]}"] if len(ports) > config.np else []  # dpro's side channel
        return [["env", f"{TF_CONFIG}={tf_config(cluster, i)}", *side, *config.command] for i in range(config.np)]

    def launch(self, config: LaunchConfig) -> int:
        """Start every worker, stop them all when one fails (or on Ctrl-C), return the first failure's status."""
        env = self._env(config)
        supervisor = Supervisor(self.grace_s)
        files: list[IO[bytes]] = []
        try:
            with Signals(supervisor):
                try:
                    for index, argv in enumerate(self.command(config)):
                        files += self._start(config, index, argv, env, supervisor)
                except BaseException:
                    supervisor.kill_all()
                    raise
                return supervisor.wait()
        finally:
            for f in files:
                f.close()

    @staticmethod
    def _env(config: LaunchConfig) -> dict[str, str]:
        env = {**os.environ, **job_env(config)}
        if env.pop(TF_CONFIG, None) is not None:
            _say("TF_CONFIG is set in this environment; --engine tf replaces it with this job's cluster")
        return env

    def _start(self, config: LaunchConfig, index: int, argv: list[str], env: dict[str, str],
               supervisor: Supervisor) -> list[IO[bytes]]:
        if config.verbose:
            _say(f"worker {index}: {shlex.join(argv)}")
        return start_local(config, f"worker {index}", argv, env, (index, config.np), supervisor)
