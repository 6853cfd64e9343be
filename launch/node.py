"""The per-host agent of the torch engine: ``python -m dpro.launch.node [options] -- COMMAND...``.

``dpro-launch`` runs one agent per host (locally, or over ssh). The agent starts ``--nproc`` copies of the
command with the torch.distributed environment that ``torchrun`` gives its workers (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, ...), watches them and stops them:

- The agent of node 0 hosts the rendezvous store (a c10d ``TCPStore``) on a port it binds itself
  (``--master-port 0``: any free port), prints ``DPRO_MASTER_PORT=<port>`` on stdout and hands
  ``TORCHELASTIC_USE_AGENT_STORE=True`` to its workers, as torchrun's agent does. No port can be taken
  between choosing and binding it. Other nodes' agents get that port from the launcher.
- A worker that exits non-zero stops the others at once (SIGTERM to each worker's process group, SIGKILL
  after the grace period); the agent exits with that worker's code (128+N for a signal N).
- SIGINT or SIGTERM to the agent, or a line ``INT`` / ``TERM`` on its stdin, is forwarded to every
  worker's process group; end of stdin (the launcher or its ssh connection went away) means TERM.
  Workers still running after the grace period are killed. Exit status 130 / 143.
- Workers die with the agent (Linux parent-death signal), so no rank outlives a killed launcher.

Each worker runs in its own session (process group), so a Ctrl-C at the terminal reaches the launcher
only, which forwards it once, and a rank's own child processes are signalled with it.

This module is internal to the launcher; its options may change between versions.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

__all__ = ["DEFAULT_GRACE_S", "EXIT_PORT_TAKEN", "PORT_LINE", "Workers", "build_parser", "exit_status",
           "rank_output_dir", "start_worker", "worker_env"]

PORT_LINE = "DPRO_MASTER_PORT="
EXIT_PORT_TAKEN = 98
DEFAULT_GRACE_S = 10.0


def _parent_death_signal() -> None:
    """In the worker, before exec: die (SIGKILL) when the agent dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def start_worker(command: list[str], env: dict[str, str], output_dir: Path | None = None,
                 cwd: Path | None = None) -> tuple[subprocess.Popen, list[IO[bytes]]]:
    """Start one worker in its own session (process group), killed when its parent dies (Linux); its
    stdout/stderr appended to ``output_dir``/stdout, stderr when given. Returns the process and the files
    opened for it (the caller closes them once it has exited)."""
    files: list[IO[bytes]] = []
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        files = [open(output_dir / "stdout", "ab"), open(output_dir / "stderr", "ab")]  # noqa: SIM115
    out, err = files if files else (None, None)
    try:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd,
                                start_new_session=True,
                                preexec_fn=_parent_death_signal if sys.platform.startswith("linux") else None)
    except BaseException:
        for f in files:
            f.close()
        raise
    return proc, files


def rank_output_dir(base: str | Path | None, rank: int, world_size: int) -> Path | None:
    """``--output-filename DIR``: rank r's output goes to DIR/rank.<r>/ (r zero-padded to the widest rank)."""
    if not base:
        return None
    width = len(str(world_size - 1))
    return Path(base) / f"rank.{rank:0{width}d}"


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell would report it: -N (killed by signal N) -> 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def _serve_store(port: int, timeout_s: float):  # noqa: ANN202 - torch is imported lazily
    from torch.distributed import TCPStore

    try:
        return TCPStore("0.0.0.0", port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                        wait_for_workers=False)
    except RuntimeError as err:  # DistNetworkError is a RuntimeError
        if "EADDRINUSE" in str(err) or "in use" in str(err):
            print(f"dpro-launch: error: master port {port} is already in use on this host; choose another "
                  "port, or let dpro-launch pick one", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_PORT_TAKEN) from None
        raise


class Workers:
    """The agent's worker processes: start, wait for the first failure, stop."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.procs: dict[int, subprocess.Popen] = {}
        self.events: queue.Queue[tuple[str, int, int]] = queue.Queue()  # (kind, rank or signal, status)
        self._stopping = False
        self._files: list = []

    def start(self, rank: int, command: list[str], env: dict[str, str], output_dir: Path | None) -> None:
        proc, files = start_worker(command, env, output_dir)
        self._files += files
        self.procs[rank] = proc
        threading.Thread(target=self._wait, args=(rank, proc), daemon=True).start()

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        self.events.put(("exit", rank, exit_status(proc.wait())))

    def running(self) -> list[subprocess.Popen]:
        return [p for p in self.procs.values() if p.poll() is None]

    def signal_all(self, signum: int) -> None:
        for proc in self.running():
            try:
                os.killpg(proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Send ``signum`` to every running worker's group; SIGKILL what is left after the grace period."""
        self._stopping = True
        self.signal_all(signum)
        deadline = time.monotonic() + self.grace_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait()
        for f in self._files:
            f.close()

    def wait(self) -> int:
        """Until every worker has exited 0 (-> 0), one failed (-> its status), or a stop was asked (-> 128+sig)."""
        done: set[int] = set()
        while len(done) < len(self.procs):
            try:
                kind, who, status = self.events.get(timeout=0.5)  # a timeout keeps signal handlers responsive
            except queue.Empty:
                continue
            if kind == "signal":
                self.stop(who)
                return 128 + who
            done.add(who)
            if status != 0:
                print(f"dpro-launch: rank {who} exited with status {status}; stopping the other ranks",
                      file=sys.stderr, flush=True)
                self.stop(signal.SIGTERM)
                return status
        for f in self._files:
            f.close()
        return 0


def _watch_stdin(events: queue.Queue) -> None:
    """Lines INT / TERM on stdin ask for that signal; end of stdin means TERM."""
    for line in sys.stdin:
        word = line.strip().upper()
        if word in ("INT", "TERM"):
            events.put(("signal", int(getattr(signal, "SIG" + word)), 0))
    events.put(("signal", int(signal.SIGTERM), 0))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dpro.launch.node",
                                     description="dpro-launch's per-host agent (internal).")
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--nproc", type=int, required=True, help="processes on this host")
    parser.add_argument("--rank-offset", type=int, default=0, help="global rank of this host's first process")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=0, help="node 0: port to bind (0: any free port)")
    parser.add_argument("--run-id", default="dpro")
    parser.add_argument("--output-filename", default=None, help="write each rank's output to DIR/rank.<r>/")
    parser.add_argument("--watch-stdin", action="store_true", help="INT/TERM lines and end of stdin stop the job")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help="seconds between signal and kill")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="store timeout (seconds)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def worker_env(args: argparse.Namespace, local_rank: int, port: int) -> dict[str, str]:
    """The torch.distributed environment of one worker (what torchrun sets)."""
    env = dict(os.environ)
    rank = args.rank_offset + local_rank
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(args.world_size),
        "LOCAL_WORLD_SIZE": str(args.nproc), "GROUP_RANK": str(args.node_rank), "GROUP_WORLD_SIZE": str(args.nnodes),
        "ROLE_RANK": str(rank), "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(args.world_size),
        "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": args.run_id,
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    })
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("dpro.launch.node: no command given", file=sys.stderr)
        return 2
    workers = Workers(args.grace)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda s, _f: workers.events.put(("signal", int(s), 0)))
    port = args.master_port
    store = None
    if args.node_rank == 0:
        store = _serve_store(port, args.start_timeout)
        port = store.port
        print(f"{PORT_LINE}{port}", flush=True)
    if args.watch_stdin:
        threading.Thread(target=_watch_stdin, args=(workers.events,), daemon=True).start()
    for local_rank in range(args.nproc):
        rank = args.rank_offset + local_rank
        out = rank_output_dir(args.output_filename, rank, args.world_size)
        workers.start(rank, command, worker_env(args, local_rank, port), out)
    status = workers.wait()
    del store  # the store outlives every worker
    return status


if __name__ == "__main__":
    sys.exit(main())
