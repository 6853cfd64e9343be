"""The ``torch`` launcher: dpro starts the processes itself, one agent per host (``dpro.launch.node``), locally or
over ssh; the agents give each process the torch.distributed environment (as torchrun does), host the rendezvous
store on a port they bind themselves, and stop every rank when one fails."""

from __future__ import annotations

import os
import queue
import shlex
import subprocess
import sys
import time
from pathlib import Path

from dpro.errors import UsageError
from dpro.launch.env import job_env
from dpro.launch.node import DEFAULT_GRACE_S
from dpro.launch.process import (
    PORT_PLACEHOLDER,
    Agent,
    PortReader,
    Signals,
    Supervisor,
    _say,
    job_run_id,
    master_addr,
    remote_env,
    ssh_argv,
)
from dpro.launch.settings import LaunchConfig


class TorchLauncher:
    """torch.distributed jobs (DDP, Lightning, plain collectives): one ``dpro.launch.node`` agent per host."""

    name = "torch"

    def __init__(self, *, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.grace_s = grace_s

    def agent_argv(self, config: LaunchConfig, node: int, master_port: int | str, run_id: str = "dpro") -> list[str]:
        placement = config.placement()
        offset = sum(n for _, n in placement[:node])
        argv = [sys.executable, "-m", "dpro.launch.node", "--node-rank", str(node), "--nnodes", str(len(placement)),
                "--nproc", str(placement[node][1]), "--rank-offset", str(offset), "--world-size", str(config.np),
                "--master-addr", master_addr(config), "--master-port", str(master_port if node else 0),
                "--run-id", run_id, "--watch-stdin", "--grace", str(self.grace_s),
                "--start-timeout", str(max(config.start_timeout, 60.0))]
        if config.output_filename:
            out = Path(config.output_filename)
            argv += ["--output-filename", str(out if out.is_absolute() else config.cwd / out)]
        return [*argv, "--", *config.command]

    def command(self, config: LaunchConfig, master_port: int | str = PORT_PLACEHOLDER) -> list[list[str]]:
        """One argv per host: the local agent as is, a remote one wrapped in ssh (with its environment)."""
        added = job_env(config)
        out = []
        for node, (host, _) in enumerate(config.placement()):
            argv = self.agent_argv(config, node, master_port, job_run_id(config))
            out.append(argv if host.local else ssh_argv(config, host, argv, remote_env(added)))
        return out

    def launch(self, config: LaunchConfig) -> int:
        """Start every host's agent (node 0 first: it binds the store's port), supervise, return the status."""
        added = job_env(config)
        local_env = {**os.environ, **added}
        placement = config.placement()
        supervisor = Supervisor(self.grace_s)
        run_id = job_run_id(config)
        with Signals(supervisor):
            try:
                port = self._start(config, 0, "", local_env, added, supervisor, run_id)
                if port is None:
                    return supervisor.wait() or 1
                for node in range(1, len(placement)):
                    self._start(config, node, port, local_env, added, supervisor, run_id)
            except BaseException:
                supervisor.kill_all()
                raise
            return supervisor.wait()

    def _start(self, config: LaunchConfig, node: int, port: int | str, local_env: dict[str, str],
               added: dict[str, str], supervisor: Supervisor, run_id: str) -> int | None:
        host, nproc = config.placement()[node]
        argv = self.agent_argv(config, node, port, run_id)
        if not host.local:
            argv = ssh_argv(config, host, argv, remote_env(added))
        if config.verbose:
            _say(f"host {host.name} ({nproc} ranks): {shlex.join(argv)}")
        first = node == 0
        try:
            proc = subprocess.Popen(argv, env=local_env if host.local else None, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE if first else None, start_new_session=True,
                                    cwd=config.cwd)
        except FileNotFoundError as err:
            raise UsageError(f"cannot start {argv[0]!r}: {err.strerror}" + (
                "; the torch engine needs ssh to reach other hosts" if not host.local else "")) from err
        supervisor.add(Agent(f"host {host.name}", proc, remote=not host.local))
        if not first:
            return None
        reader = PortReader(proc.stdout)
        deadline = time.monotonic() + config.start_timeout
        while time.monotonic() < deadline:
            if supervisor.interrupted:
                return None  # supervisor.wait() handles the signal
            try:
                return reader.port.get(timeout=0.2)
            except queue.Empty:
                continue
        _say(f"host {host.name} did not start within --start-timeout {config.start_timeout:g} s; stopping")
        supervisor.kill_all()
        return None
