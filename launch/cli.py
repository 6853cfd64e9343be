"""``dpro-launch``: run a distributed training job like ``horovodrun`` does, and record, optimize and tune it.

Usage::

    dpro-launch [horovodrun options] [dpro options] COMMAND [ARGS...]

    dpro-launch -np 2 python train.py                        # 2 processes here; steps 10..19 recorded
    dpro-launch -np 8 -H node1:4,node2:4 python train.py     # 4 per host; node2 over ssh
    dpro-launch -np 2 --optimize python train.py             # ... then write RUN/analysis/config.json
    dpro-launch -np 2 --apply dpro-runs/X/analysis/config.json python train.py
    dpro-launch -np 2 --auto python train.py                 # profile, optimize, re-run, compare
    dpro-launch --engine tf -np 2 -H localhost:2 python train.py   # Keras MultiWorkerMirroredStrategy
    dpro-launch --engine mxnet -np 2 --num-servers 2 python train.py   # MXNet kvstore dist_sync (ps-lite)
    dpro-launch --nproc-per-node 2 train.py --lr 0.1         # torchrun's flags: the script, run by this python

The script needs no change. dpro-launch puts a ``sitecustomize`` on the job's ``PYTHONPATH`` that, once
the script builds its ``DistributedDataParallel`` model, attaches dpro's recorder to it and to the
optimizer that steps it (one optimizer step is one iteration), and adds dpro's ``DproCallback`` to a
Lightning ``Trainer``. In a Horovod script, the optimizer ``hvd.DistributedOptimizer`` returns gets dpro's
Horovod recorder (``record_horovod``) for the model that holds its parameters (found among the live
``nn.Module`` objects: the one whose ``named_parameters()`` were passed as ``named_parameters=``, else
the outermost module all of whose trainable parameters the optimizer updates); one ``step()`` of it is one
iteration. A script that records itself (dpro's ``Profiler``, ``DproCallback`` or ``record_horovod``) is
recorded once, by itself. Iteration 0 ends before the recorder attaches, so the window starts at 1 or later.

Engines (``--engine``)
    torch      dpro starts one process per slot with the torch.distributed environment that torchrun gives
               (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT;
               OMP_NUM_THREADS=1 unless set). The rendezvous store is hosted by dpro's agent on host 0 on
               a port it binds itself, so a taken port never stops a job. Other hosts are reached with
               ``ssh`` (``-p``, ``-i``; no prompts; host keys checked, see below): each runs the agent
               with this interpreter (its absolute path) in this directory, with dpro's environment and the
               local DPRO_*, HOROVOD_*, NCCL_*, GLOO_*, TORCH_*, OMP_*, MKL_*, CUDA_*, PYTHON*, PATH,
               LD_LIBRARY_PATH and VIRTUAL_ENV variables. localhost, 127.0.0.1, ::1 and this machine's
               hostname run here without ssh; any other name (even 127.0.0.2) goes through ssh.
    horovod    the job goes to ``horovodrun`` (installed with Horovod) with the same options and dpro's
               environment (horovodrun hands its whole environment to every rank, over ssh too). A
               fractional --fusion-threshold-mb, which horovodrun's option refuses, is passed by
               HOROVOD_FUSION_THRESHOLD alone.
    tf         TensorFlow (``tf.distribute.MultiWorkerMirroredStrategy``): dpro starts one process per slot
               with ``TF_CONFIG={"cluster": {"worker": ["HOST:PORT", ...]}, "task": {"type": "worker",
               "index": I}}`` (worker I is rank I: each host's slots filled in order, as for torch; the ports
               are free ports picked on this machine) and the environment the torch engine gives (DPRO_*
               for --profile/--apply/--auto, PYTHONPATH with the auto-attach directory, OMP_NUM_THREADS=1
               unless set). Only local hosts (localhost, 127.0.0.1, ::1, this machine's hostname) for now;
               another host is refused.
               A TF_CONFIG already in the environment is replaced, with a note. --verbose prints each
               worker's ``env TF_CONFIG=... COMMAND``. TF workers take SIGTERM as a preemption notice
               (a script with PreemptionCheckpointHandler checkpoints and exits); one that keeps running is
               killed after the grace period. Not chosen by auto: give --engine tf.
    mxnet      MXNet's parameter server (``mx.kv.create("dist_sync")`` or ``dist_async``, ps-lite): dpro starts a
               scheduler, --num-servers servers (default: one per worker, as MXNet's tools/launch.py) and one
               worker per slot, each running the command with DMLC_ROLE (scheduler, server, worker),
               DMLC_PS_ROOT_URI=127.0.0.1, DMLC_PS_ROOT_PORT (a free port), DMLC_NUM_SERVER and
               DMLC_NUM_WORKER; ``import mxnet`` in the scheduler and the servers serves the job and exits.
               The job ends with its workers: servers still running after the grace period are killed; a
               process that fails stops the others. Local hosts only; --profile records the workers' Gluon
               loop; an applied config's DMLC_NUM_SERVER sets the servers started. Not chosen by auto.
    auto       (default) horovod if the script (the first ``*.py`` argument) contains ``import horovod``,
               ``from horovod`` or ``horovod.torch``; torch otherwise.

Faults. A rank that exits non-zero stops every other rank at once (SIGTERM, SIGKILL after 10 s) and
dpro-launch exits with that rank's status (128+N for a signal N). Ctrl-C (or SIGTERM) is forwarded
to every rank; ranks still running 10 s later are killed; a second Ctrl-C kills at once. Exit status
130 (143). Each recorded step is journaled as it ends, so the steps a rank finished stay readable
(``dpro info RUN``) however the job ends.

horovodrun options (same names and meaning; Horovod's knobs reach the job as environment variables):
    -np, --num-proc N              total number of processes (required)
    -H, --hosts HOST:SLOTS,...     hosts and their slots, e.g. node1:4,node2:4 (default localhost:N); slots
                                   are filled in order. A host without :SLOTS has one slot.
    --hostfile FILE                one "HOST slots=N" per line (instead of -H)
    -p, --ssh-port PORT            ssh port on every host
    -i, --ssh-identity-file KEY    ssh private key
    --gloo | --mpi                 Horovod controller (--mpi needs --engine horovod)
    --start-timeout S              seconds for the hosts to start (default 30, or $HOROVOD_START_TIMEOUT)
    --network-interfaces NICS      torch, tf: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME; horovod: passed on
    --output-filename DIR          each rank's stdout/stderr go to DIR/rank.<r>/stdout, stderr
    --verbose                      print the commands started on each host
    --disable-cache                passed to horovodrun (the torch engine has no cache)
    --config-file FILE             horovodrun's YAML file (params, autotune, timeline, stall_check,
                                   logging, controller; dpro optimize writes RUN/analysis/horovodrun.yaml);
                                   the command line wins over it
    --fusion-threshold-mb MB       HOROVOD_FUSION_THRESHOLD (bytes: MB * 1048576)
    --cycle-time-ms MS             HOROVOD_CYCLE_TIME
    --cache-capacity N             HOROVOD_CACHE_CAPACITY
    --[no-]hierarchical-allreduce  HOROVOD_HIERARCHICAL_ALLREDUCE (1/0); likewise --[no-]hierarchical-allgather
    --autotune                     HOROVOD_AUTOTUNE=1, with --autotune-log-file (HOROVOD_AUTOTUNE_LOG),
                                   --autotune-warmup-samples, --autotune-steps-per-sample,
                                   --autotune-bayes-opt-max-samples, --autotune-gaussian-process-noise
                                   (HOROVOD_AUTOTUNE_<NAME>)
    --timeline-filename FILE       HOROVOD_TIMELINE (and --timeline-mark-cycles: HOROVOD_TIMELINE_MARK_CYCLES)
    --no-stall-check               HOROVOD_STALL_CHECK_DISABLE=1; --stall-check-warning-time-seconds,
                                   --stall-check-shutdown-time-seconds
    --log-level LEVEL              HOROVOD_LOG_LEVEL (TRACE, DEBUG, INFO, WARNING, ERROR, FATAL)
The table is ``dpro.launch.horovod_run.HOROVOD_KNOBS``. Any other option is an error (exit status 2).

torchrun options (for users coming from torchrun; one dpro-launch starts every node, so there is no node rank):
    --nproc-per-node N             processes per node, in place of -np (an integer)
    --nnodes N                     nodes (N or N:N); more than one needs -H naming one host per node
    -m, --module                   the command is a module: run as python -m MODULE ARGS
    --no-python                    the command runs as it is; otherwise a script runs with this python
    --standalone, --master-addr, --master-port, --rdzv-backend, --rdzv-endpoint, --rdzv-id, --rdzv-conf
                                   accepted: dpro-launch hosts the rendezvous store itself
    --node-rank 0, --max-restarts 0   the only values taken (a failed rank stops the job)

dpro options:
    --engine {auto,torch,horovod,tf,mxnet}  see above (default auto)
    --ssh-known-hosts FILE         the known-hosts file for every ssh dpro starts (default ssh's own,
                                   ~/.ssh/known_hosts). Host keys are checked: a host seen for the first time
                                   is added (StrictHostKeyChecking=accept-new), a changed key stops the job.
                                   With --engine horovod, dpro logs in to each remote host this way before
                                   horovodrun starts, since horovodrun's own ssh does not check keys.
    --ssh-no-host-key-check        do not check host keys (what horovodrun does); a trusted network only
    --profile START:STOP[:BLOCK]   iterations to record (default 10:20, i.e. 10..19; START >= 1); with BLOCK,
                                   blocks of BLOCK recorded iterations alternate with BLOCK unrecorded ones, and
                                   `dpro info` measures the recording's cost against those gaps (default for
                                   Horovod: 10:40:5)
    --no-profile                   record nothing (e.g. to run with --apply only)
    --run-dir DIR                  the run directory (default a new ./dpro-runs/<timestamp>, or under
                                   $DPRO_RUN_DIR); a directory that holds a run is refused
    --optimize                     after a successful run: replay it, search bucket sizes, tensor groups and
                                   recomputation, write RUN/analysis/config.json and print the summary
                                   (files of other hosts are copied here first, as a tar stream over ssh)
    --memory-budget SIZE           peak memory per rank for --optimize, e.g. 2GiB (enables recomputation)
    --allow-compression            --optimize may choose fp16 gradient compression (changes numerics)
    --apply FILE|auto              apply a dpro config: its "env" knobs are set for every process and
                                   DPRO_CONFIG=FILE makes the ranks apply the rest (DDP bucket sizes and
                                   recomputation before DDP wraps the model). "auto": each rank applies the
                                   newest config under the run root made for its job (framework, engine,
                                   world size and model); none found, the job runs as is. A config made for
                                   another job is refused with the reason. Horovod jobs: the "env" knobs
                                   (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME) win over the flags;
                                   "tensor_groups" become hvd.DistributedOptimizer(groups=) unless the script
                                   passes groups; "recompute" is applied to the model found for the optimizer.
    --force                        apply a config made for another job anyway
    --backward-marks gradients|tensors
                                   how the torch recorder times BW: from the gradients' ready marks (default)
                                   or with a tensor hook per module (exact per module, costlier)
    --auto                         profile -> optimize -> run again with the config, recorded into
                                   RUN-applied -> print measured step before and after, the predicted step
                                   and the knobs applied
    --horovod-timeline             Horovod: run Horovod's timeline (HOROVOD_TIMELINE=DYNAMIC) in the window's
                                   last block, for the fused buffers and the background loop's timing that
                                   price the fusion knobs. Off by default: once started, Horovod's timeline
                                   slows every later step (8-21% measured, docs/benchmarks/horovod_overhead.md),
                                   stopped or not; without it allreduces are timed from launch to completion

What a job gets in its environment: DPRO_LAUNCH=1, DPRO_AUTO_RECORD (1 or 0), DPRO_PROFILE=START:STOP,
DPRO_RUN_DIR=RUN, DPRO_CONFIG (with --apply FILE), DPRO_APPLY_SEARCH (with --apply auto), DPRO_FORCE,
DPRO_BACKWARD_MARKS (with --backward-marks tensors),
the Horovod variables above (with --horovod-timeline, HOROVOD_TIMELINE=DYNAMIC when recording and no
timeline is named, so that dpro's Horovod recorder can run the timeline in the window's last block), and
PYTHONPATH with dpro's auto-attach directory first (a sitecustomize.py that also runs the one it hides,
if any). After the job, RUN/launch.json records the command, hosts,
settings and exit status.

Python API: ``config_from_args(build_parser().parse_args(argv))`` or ``LaunchConfig(...)`` directly, then
``dpro.launch.pipeline.run(config)``; launchers are ``dpro.launch.launchers.LAUNCHERS``, each a
``dpro.launch.launcher.Launcher`` that brings its own flags, options and environment.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from dpro import __version__
from dpro.errors import DproError, UsageError
from dpro.launch.launchers import LAUNCHERS
from dpro.launch.settings import (
    BACKWARD_MARKS,
    ENGINE_NAMES,
    Host,
    LaunchConfig,
    default_window,
    detect_engine,
    parse_hostfile,
    parse_hosts,
    parse_window,
)

__all__ = ["build_parser", "config_from_args", "main"]

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The ``dpro-launch`` argument parser: horovodrun's options, dpro's options, then the command."""
    parser = argparse.ArgumentParser(
        prog="dpro-launch", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a distributed training job (horovodrun's command line) and record, optimize and tune it.",
        epilog="The full manual: python -c 'import dpro.launch.cli as m; print(m.__doc__)'",
    )
    parser.add_argument("--version", action="version", version=f"dpro-launch {__version__}")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, e.g. python train.py")

    procs = parser.add_argument_group("processes and hosts (horovodrun)")
    procs.add_argument("-np", "--num-proc", dest="np", type=int, metavar="N",
                       help="total number of processes (or torchrun's --nproc-per-node)")
    hosts = procs.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="hosts and slots, e.g. node1:4,node2:4")
    hosts.add_argument("--hostfile", metavar="FILE", help="one 'HOST slots=N' per line")
    procs.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="ssh port on every host")
    procs.add_argument("-i", "--ssh-identity-file", metavar="KEY", help="ssh private key")
    procs.add_argument("--ssh-known-hosts", metavar="FILE",
                       help="known-hosts file that host keys are checked against (default ssh's ~/.ssh/known_hosts)")
    procs.add_argument("--ssh-no-host-key-check", dest="ssh_host_key_check", action="store_false",
                       help="do not check host keys (what horovodrun does); only on a network you trust")
    procs.add_argument("--start-timeout", type=float, metavar="S", help="seconds for the hosts to start (default 30)")
    procs.add_argument("--network-interfaces", "--network-interface", dest="network_interfaces", metavar="NICS",
                       help="network interfaces for communication, comma-separated")
    procs.add_argument("--output-filename", metavar="DIR", help="write each rank's output to DIR/rank.<r>/")
    procs.add_argument("--verbose", action="store_true", help="print the commands started")

    for launcher in LAUNCHERS.values():  # each launcher's own flags and groups
        launcher.add_arguments(parser, procs)

    dpro = parser.add_argument_group("dpro")
    dpro.add_argument("--engine", choices=("auto", *ENGINE_NAMES), default="auto",
                      help="torch: dpro starts the processes; horovod: horovodrun; tf: dpro starts the processes "
                           "with TF_CONFIG for MultiWorkerMirroredStrategy (local hosts only; a TF_CONFIG in the "
                           "environment is replaced, with a note); mxnet: a ps-lite scheduler, --num-servers "
                           "servers and the workers with DMLC_* (local hosts only); auto (default): horovod if the "
                           "script imports horovod, else torch")
    dpro.add_argument("--profile", default=None, metavar="START:STOP[:BLOCK]",
                      help="iterations to record (default 10:20; for Horovod 10:40:5, blocks of 5 recorded "
                           "iterations with gaps of 5; START >= 1)")
    dpro.add_argument("--no-profile", action="store_true", help="record nothing")
    dpro.add_argument("--run-dir", metavar="DIR", help="the run directory (default ./dpro-runs/<timestamp>)")
    dpro.add_argument("--optimize", action="store_true", help="after the run: write RUN/analysis/config.json")
    dpro.add_argument("--memory-budget", metavar="SIZE", help="peak memory per rank for --optimize, e.g. 2GiB")
    dpro.add_argument("--allow-compression", action="store_true", help="--optimize may choose fp16 compression")
    dpro.add_argument("--apply", metavar="FILE|auto", help="apply a dpro config (auto: the newest made for this job)")
    dpro.add_argument("--force", action="store_true", help="apply a config made for another job anyway")
    dpro.add_argument("--backward-marks", choices=BACKWARD_MARKS, default="gradients",
                      help="how the torch recorder times BW (default: from the gradients' ready marks)")
    dpro.add_argument("--auto", action="store_true",
                      help="profile, optimize, re-run with the config, print before/after")
    for launcher in LAUNCHERS.values():  # each launcher's own flags among dpro's
        launcher.add_dpro_arguments(dpro)
    return parser


def config_from_args(args: argparse.Namespace, *, cwd: Path | None = None) -> LaunchConfig:
    """The validated ``LaunchConfig`` for parsed arguments.

    Raises:
        UsageError: a value that cannot be used, with how to fix it.
    """
    cwd = Path.cwd() if cwd is None else cwd
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    hosts = parse_hosts(args.hosts) if args.hosts else parse_hostfile(args.hostfile) if args.hostfile else []
    np, command = _processes(args, hosts, command)
    options = {name: launcher.options_from_args(args) for name, launcher in LAUNCHERS.items()}
    engine = args.engine if args.engine != "auto" else detect_engine(command, cwd)
    budget = None
    if args.memory_budget:
        from dpro.cli import parse_size

        budget = parse_size(args.memory_budget)
    apply = None
    if args.apply:
        apply = "auto" if args.apply == "auto" else Path(args.apply)
    return LaunchConfig(
        command=command, np=np, hosts=hosts, engine=engine, ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file, ssh_known_hosts=args.ssh_known_hosts,
        ssh_host_key_check=args.ssh_host_key_check, options=options,
        start_timeout=args.start_timeout, network_interfaces=args.network_interfaces,
        output_filename=args.output_filename, verbose=args.verbose, profile=None if args.no_profile else (
            parse_window(args.profile) if args.profile else default_window(engine)),
        run_dir=Path(args.run_dir) if args.run_dir else None, optimize=args.optimize, apply=apply, auto=args.auto,
        memory_budget_bytes=budget, allow_compression=args.allow_compression, force=args.force,
        backward_marks=args.backward_marks, cwd=cwd,
    )


def _processes(args: argparse.Namespace, hosts: list[Host], command: list[str]) -> tuple[int, list[str]]:
    """The process count and command: from the first launcher whose own flags give them, else ``-np``.

    Raises:
        UsageError: no process count.
    """
    for launcher in LAUNCHERS.values():
        given = launcher.processes_from_args(args, hosts, command)
        if given is not None:
            return given
    if args.np is None:
        raise UsageError("give the number of processes: -np N")
    return args.np, command


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dpro-launch`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Wrong options exit with status 2 and argparse's message; a failed rank's status is returned.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except UsageError as err:
        parser.error(str(err))
    from dpro.launch.pipeline import run
    from dpro.logs import set_verbosity

    set_verbosity(verbose=int(args.verbose))  # horovodrun's --verbose: also dpro-launch's debug lines
    try:
        return run(config)
    except DproError as err:
        if args.verbose:
            traceback.print_exception(err, file=sys.stderr)
        print(f"dpro-launch: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
