"""What every launcher shares: ssh (options, host keys, a remote command), a supervisor that stops every
process of a job when one fails, signal forwarding, free ports and local process start."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from dpro.errors import UsageError
from dpro.launch.node import PORT_LINE, exit_status, rank_output_dir, start_worker
from dpro.logs import get_logger

if TYPE_CHECKING:
    from dpro.launch.settings import Host, LaunchConfig

PORT_PLACEHOLDER = "{master_port}"


logger = get_logger("dpro.launch")
_say = logger.info  # what the launcher tells its user


# ---- ssh --------------------------------------------------------------------------------------------


def ssh_options(config: LaunchConfig) -> list[str]:
    """Options of every ssh dpro starts: no prompts (BatchMode), -i from the command line, and host keys checked.

    A host seen for the first time has its key added to the known-hosts file (``accept-new``, ssh's own
    ``~/.ssh/known_hosts`` unless ``--ssh-known-hosts``); a host whose key changed is refused by ssh.
    ``--ssh-no-host-key-check`` turns checking off (what horovodrun always does).
    """
    opts = ["-o", "BatchMode=yes", "-o", "PasswordAuthentication=no", "-o", "LogLevel=ERROR"]
    if config.ssh_host_key_check:
        opts += ["-o", "StrictHostKeyChecking=accept-new"]
        if config.ssh_known_hosts:
            # ssh reads the value as a config line: %-tokens expand and blanks split, hence %% and the quotes
            opts += ["-o", f'UserKnownHostsFile="{config.ssh_known_hosts.replace("%", "%%")}"']
    else:
        opts += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    if config.ssh_identity_file:
        opts += ["-i", config.ssh_identity_file]
    return opts


def check_host_keys(config: LaunchConfig, *, timeout_s: float = 60.0) -> None:
    """Log in to every remote host once with dpro's checked options (``ssh HOST true``).

    horovodrun turns host-key checking off in its own ssh commands; this check runs first, so a host whose key
    changed stops the job before horovodrun connects to it.

    Raises:
        UsageError: a host that refuses, whose key does not match, or that cannot be reached; ssh's own words.
    """
    if not config.ssh_host_key_check:
        return
    port = ["-p", str(config.ssh_port)] if config.ssh_port else []
    for host in config.hosts:
        if host.local:
            continue
        argv = ["ssh", *port, *ssh_options(config), "--", host.name, "true"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise UsageError(f"host {host.name}: ssh did not answer in {timeout_s:.0f} s") from None
        if proc.returncode != 0:
            words = " ".join(proc.stderr.split())[-400:] or f"ssh exited with status {proc.returncode}"
            raise UsageError(f"host {host.name}: ssh refused ({words}); if its host key changed on purpose, remove "
                             f"the old key (ssh-keygen -R {host.name}), or pass --ssh-no-host-key-check")


def ssh_argv(config: LaunchConfig, host: Host, argv: list[str], env: Mapping[str, str]) -> list[str]:
    """``ssh [options] -- HOST 'cd CWD && exec env K=V ... ARGV'``: every word of the remote command quoted."""
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    remote = f"cd {shlex.quote(str(config.cwd))} && exec env {assignments} {shlex.join(argv)}"
    port = ["-p", str(config.ssh_port)] if config.ssh_port else []
    return ["ssh", *port, *ssh_options(config), "--", host.name, remote]


# ---- processes --------------------------------------------------------------------------------------


@dataclass
class Agent:
    label: str
    proc: subprocess.Popen
    remote: bool

    def tell(self, word: str, *, close: bool = False) -> None:
        """A line for the agent's stdin (INT, TERM); ``close`` ends its stdin, which stops it."""
        stdin = self.proc.stdin
        if stdin is None or stdin.closed:
            return
        try:
            if word:
                stdin.write(word.encode() + b"\n")
                stdin.flush()
            if close:
                stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def signal(self, signum: int) -> None:
        if self.proc.poll() is not None:
            return
        if self.remote:  # ssh does not forward signals; the agent reads them from stdin
            self.tell(signal.Signals(signum).name[3:], close=signum != signal.SIGINT)
            return
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self.tell("", close=True)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class PortReader:
    """Reads node 0's agent's stdout: the announced port first, then relays everything to our stdout."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.port: queue.Queue[int | None] = queue.Queue()
        threading.Thread(target=self._run, args=(stream,), daemon=True).start()

    def _run(self, stream: IO[bytes]) -> None:
        out = sys.stdout.buffer
        announced = False
        for line in iter(stream.readline, b""):
            text = line.decode(errors="replace").strip()
            if not announced and text.startswith(PORT_LINE):
                announced = True
                self.port.put(int(text[len(PORT_LINE):]))
                break
            out.write(line)
            out.flush()
        if not announced:
            self.port.put(None)
            return
        fd = stream.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            out.write(chunk)
            out.flush()


class Supervisor:
    """Watches the agents: the first non-zero exit stops the rest; SIGINT/SIGTERM is forwarded once, then kills."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.agents: list[Agent] = []
        self.events: queue.Queue[tuple[str, int, int]] = queue.Queue()
        self.interrupted = 0  # the signal that arrived, if any

    def add(self, agent: Agent) -> None:
        self.agents.append(agent)
        index = len(self.agents) - 1
        threading.Thread(target=lambda: self.events.put(("exit", index, exit_status(agent.proc.wait()))),
                         daemon=True).start()

    def stop_all(self, signum: int, *, but: int | None = None) -> None:
        for i, agent in enumerate(self.agents):
            if i != but:
                agent.signal(signum)

    def kill_all(self) -> None:
        for agent in self.agents:
            agent.kill()

    def wait(self, essential: set[int] | None = None) -> int:
        """Until every agent has exited; returns the first failure's status (0 if none). With ``essential``
        (indices), the job is done once those have exited: the others (servers) get the grace period, then are
        killed."""
        status: int | None = None
        deadline: float | None = None
        exited: set[int] = set()
        signals = 0
        finished_at: float | None = None  # when the last essential agent exited
        while len(exited) < len(self.agents):
            if essential and essential <= exited and finished_at is None:
                finished_at = time.monotonic()
            if finished_at is not None and time.monotonic() > finished_at + self.grace_s:
                _say(f"{', '.join(a.label for i, a in enumerate(self.agents) if i not in exited)} still running "
                     f"{self.grace_s:g} s after the last worker ended; stopping them")
                self.kill_all()
                finished_at = float("inf")
            try:
                kind, who, code = self.events.get(timeout=0.2)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    _say("ranks still running after the grace period; killing them")
                    self.kill_all()
                    deadline = None
                continue
            if kind == "signal":
                signals += 1
                if signals > 1:
                    _say("second signal: killing every rank now")
                    self.kill_all()
                    continue
                name = signal.Signals(who).name
                _say(f"{name}: stopping every rank (again to kill at once)")
                status = 128 + who if status is None else status
                self.stop_all(who)
                deadline = time.monotonic() + self.grace_s + 5
                continue
            exited.add(who)
            if finished_at is not None:
                continue  # a server ending (or killed) after the workers are done does not fail the job
            if code != 0 and status is None:
                status = code
                if len(exited) < len(self.agents):
                    _say(f"{self.agents[who].label} exited with status {code}; stopping the others")
                    self.stop_all(signal.SIGTERM, but=who)
                    deadline = time.monotonic() + self.grace_s + 5
        for agent in self.agents:
            agent.tell("", close=True)
        return status or 0


class Signals:
    """Route SIGINT/SIGTERM to the supervisor while a job runs (handlers restored afterwards)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.saved: dict[int, object] = {}

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.saved[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        self.supervisor.interrupted = signum
        self.supervisor.events.put(("signal", int(signum), 0))

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)


# ---- ports and local processes ---------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that are free on this machine now: all bound at once, then released.

    Another process may still take one before its worker binds it; that worker then fails to start.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def address(host: Host, port: int) -> str:
    name = f"[{host.name}]" if ":" in host.name else host.name  # an IPv6 address such as ::1
    return f"{name}:{port}"


def start_local(config: LaunchConfig, label: str, argv: list[str], env: dict[str, str], position: tuple[int, int],
                supervisor: Supervisor) -> list[IO[bytes]]:
    """Start one process of the job on this machine and hand it to ``supervisor``; ``position`` (its index, the
    job's process count) names its --output-filename directory. Returns the output files to close at the end."""
    out = config.output_filename
    if out and not Path(out).is_absolute():
        out = str(config.cwd / out)
    try:
        proc, files = start_worker(argv, env, rank_output_dir(out, *position), cwd=config.cwd)
    except FileNotFoundError as err:
        raise UsageError(f"cannot start {argv[0]!r}: {err.strerror}") from err
    supervisor.add(Agent(label, proc, remote=False))
    return files
