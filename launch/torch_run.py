"""The ``torch`` launcher: dpro starts the processes itself, one agent per host (``dpro.launch.node``), locally or
over ssh; the agents give each process the torch.distributed environment (as torchrun does), host the rendezvous
store on a port they bind themselves, and stop every rank when one fails. Its flags are torchrun's
(``--nproc-per-node``, ``--nnodes``, ``-m``, ``--no-python``, and the rendezvous flags it accepts and ignores)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import queue
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from dpro.errors import UsageError
from dpro.launch.env import job_env
from dpro.launch.launcher import Launcher, LauncherOptions
from dpro.launch.node import DEFAULT_GRACE_S
from dpro.launch.process import (
    PORT_PLACEHOLDER,
    Agent,
    PortReader,
    Signals,
    Supervisor,
    _say,
    ssh_argv,
)

if TYPE_CHECKING:
    from dpro.launch.settings import Host, LaunchConfig

FORWARDED_PREFIXES = ("DPRO_", "HOROVOD_", "NCCL_", "GLOO_", "TORCH_", "OMP_", "MKL_", "CUDA_", "PYTHON")
FORWARDED_NAMES = ("PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
TORCH_NOTHING = "the job built no DistributedDataParallel model or hvd.DistributedOptimizer"
TORCH_SEEN = (("ddp_models", "DistributedDataParallel model(s)"), ("fsdp_modules", "module(s) sharded by fully_shard"),
              ("horovod_optimizers", "hvd.DistributedOptimizer(s)"))  # what the torch plugin's seen.json counts
TORCH_SEEN_NONE = ("the job built no DistributedDataParallel model, fully_shard module or hvd.DistributedOptimizer "
                   "(dpro-launch records those)")


def remote_env(added: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a remote host's agent gets: dpro's additions plus the local variables a job depends on
    (DPRO_*, HOROVOD_*, NCCL_*, GLOO_*, TORCH_*, OMP_*, MKL_*, CUDA_*, PYTHON*, PATH, LD_LIBRARY_PATH, VIRTUAL_ENV)."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}
    env.update(added)
    return env


def socket_ifname_env(config: LaunchConfig) -> dict[str, str]:
    """``--network-interfaces`` for the collectives' libraries (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)."""
    if not config.network_interfaces:
        return {}
    return {"GLOO_SOCKET_IFNAME": config.network_interfaces, "NCCL_SOCKET_IFNAME": config.network_interfaces}


def master_addr(config: LaunchConfig) -> str:
    placement = config.placement()
    first = placement[0][0]
    if len(placement) == 1 and first.local:
        return "127.0.0.1"
    if first.local and first.name in ("localhost", "127.0.0.1", "::1"):
        return socket.getfqdn() or socket.gethostname()  # a name the other hosts can reach
    return first.name


def job_run_id(config: LaunchConfig) -> str:
    """TORCHELASTIC_RUN_ID of the job: the run directory's name, or a timestamp."""
    return f"dpro-{config.run_dir.name}" if config.run_dir is not None else f"dpro-{dt.datetime.now():%Y%m%d-%H%M%S}"


# ---- torchrun's flags ----------------------------------------------------------------------------------------


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    torchrun = parser.add_argument_group("torchrun options (for users coming from torchrun; one dpro-launch "
                                         "starts every node)")
    torchrun.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", metavar="N",
                          help="processes per node (an integer; torchrun's 'gpu'/'cpu'/'auto' are not taken)")
    torchrun.add_argument("--nnodes", metavar="N", help="nodes (N or N:N); several need -H with one host per node")
    torchrun.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, metavar="R",
                          help="0 only: dpro-launch starts the other nodes itself (give -H)")
    torchrun.add_argument("--standalone", action="store_true", help="accepted: a single node is the default")
    for flag in ("master-addr", "master-port", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf"):
        torchrun.add_argument(f"--{flag}", f"--{flag.replace('-', '_')}", dest=flag.replace("-", "_"),
                              metavar="VALUE", help="accepted; dpro-launch hosts the rendezvous itself")
    torchrun.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, metavar="N",
                          help="0 only: a failed rank stops the job")
    torchrun.add_argument("-m", "--module", dest="module", action="store_true",
                          help="the command is a module to run with python -m (torchrun's -m)")
    torchrun.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                          help="the command is run as it is, without python (torchrun's --no-python)")


def _count(text: str | None, flag: str) -> int | None:
    """torchrun's N, or N:N (a fixed count; an elastic range is not taken)."""
    if text is None:
        return None
    low, _, high = str(text).partition(":")
    if not low.isdigit() or (high and high != low) or int(low) < 1:
        raise UsageError(f"{flag} {text!r}: give a positive integer (or N:N); elastic ranges and torchrun's "
                         f"'gpu'/'cpu'/'auto' are not taken, e.g. {flag} 2")
    return int(low)


def _torchrun_style(args: argparse.Namespace, hosts: list[Host], command: list[str]) -> tuple[int, list[str]]:
    """The process count and command from horovodrun's ``-np`` or torchrun's ``--nproc-per-node``/``--nnodes``
    (with torchrun's flags the command is a script or, with ``-m``, a module, run by this interpreter).

    Raises:
        UsageError: no process count, both styles at once, or what one dpro-launch cannot do (a node rank other
            than 0, restarts, several nodes without their hosts).
    """
    per_node, nodes = _count(args.nproc_per_node, "--nproc-per-node"), _count(args.nnodes, "--nnodes")
    if args.node_rank not in (None, 0):
        raise UsageError(f"--node-rank {args.node_rank}: dpro-launch starts every node itself; run it once, on "
                         "node 0, with the nodes' hosts (-H node1:4,node2:4)")
    if args.max_restarts:
        raise UsageError(f"--max-restarts {args.max_restarts}: not supported; a failed rank stops the job")
    if per_node is None:
        if args.np is None:
            raise UsageError("give the number of processes: -np N (horovodrun) or --nproc-per-node N (torchrun)")
        if args.module or args.no_python:
            raise UsageError("-m and --no-python go with --nproc-per-node (torchrun's style)")
        return args.np, command
    if args.np is not None:
        raise UsageError("give either -np (horovodrun) or --nproc-per-node (torchrun), not both")
    nodes = nodes or 1
    if nodes > 1 and len(hosts) != nodes:
        raise UsageError(f"--nnodes {nodes}: name the nodes with -H, one host each (e.g. -H node1:{per_node},"
                         f"node2:{per_node}); dpro-launch starts every node itself")
    if hosts:
        hosts[:] = [dataclasses.replace(h, slots=per_node) for h in hosts]
    if args.no_python or not command:
        return per_node * nodes, command
    return per_node * nodes, [sys.executable, *(["-m"] if args.module else []), *command]


@dataclasses.dataclass
class TorchOptions(LauncherOptions):
    """The torch launcher's options: running the job, it gives ``--network-interfaces`` to gloo and NCCL (torchrun's
    flags are read at parse time: they give the process count and the command)."""

    def engine_env(self, config: LaunchConfig) -> dict[str, str]:
        return socket_ifname_env(config)




class TorchLauncher(Launcher):
    """torch.distributed jobs (DDP, Lightning, plain collectives): one ``dpro.launch.node`` agent per host."""

    name = "torch"
    options_type = TorchOptions
    nothing_recorded = TORCH_NOTHING
    seen_counts, seen_none = TORCH_SEEN, TORCH_SEEN_NONE

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, procs: argparse._ArgumentGroup) -> None:
        _add_arguments(parser)

    @staticmethod
    def processes_from_args(args: argparse.Namespace, hosts: list[Host],
                            command: list[str]) -> tuple[int, list[str]] | None:
        return _torchrun_style(args, hosts, command)

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
