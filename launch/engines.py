"""The engines that start a job: ``ENGINES`` maps a name to a class with ``command(config)`` and ``launch(config)``.

- ``torch``: dpro starts the processes itself, one agent per host (``dpro.launch.node``), locally or over
  ssh; the agents give each process the torch.distributed environment (as torchrun does), host the
  rendezvous store on a port they bind themselves, and stop every rank when one fails.
- ``horovod``: the job goes to the real ``horovodrun`` with the same flags and dpro's environment.
- ``tf``: dpro starts one process per slot (this machine only) with ``TF_CONFIG`` naming every worker, as
  tf.distribute's ``MultiWorkerMirroredStrategy`` expects, and dpro's environment; it stops every worker
  when one fails.

An engine is a small class: ``command(config)`` returns the argv lists it will run (one per host for
torch, one per worker for tf; ``--verbose`` prints them), ``launch(config)`` runs the job and returns its
exit status. A new engine registers itself in ``ENGINES``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from dpro.engines.mxnet_ps import NUM_SERVERS_ENV, SERVER_HOSTS_ENV
from dpro.errors import UsageError
from dpro.launch.env import applied_env, horovodrun_flags, job_env
from dpro.launch.node import DEFAULT_GRACE_S, PORT_LINE, exit_status, rank_output_dir, start_worker
from dpro.launch.settings import Host, LaunchConfig
from dpro.logs import get_logger

__all__ = ["ENGINES", "HorovodEngine", "TFEngine", "TorchEngine", "check_host_keys", "free_ports", "ssh_argv",
           "ssh_options", "remote_env", "tf_cluster", "tf_config"]

PORT_PLACEHOLDER = "{master_port}"
_FORWARDED_PREFIXES = ("DPRO_", "HOROVOD_", "NCCL_", "GLOO_", "TORCH_", "OMP_", "MKL_", "CUDA_", "PYTHON")
_FORWARDED_NAMES = ("PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")


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


def remote_env(added: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a remote host's agent gets: dpro's additions plus the local variables a job depends on
    (DPRO_*, HOROVOD_*, NCCL_*, GLOO_*, TORCH_*, OMP_*, MKL_*, CUDA_*, PYTHON*, PATH, LD_LIBRARY_PATH, VIRTUAL_ENV)."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if k.startswith(_FORWARDED_PREFIXES) or k in _FORWARDED_NAMES}
    env.update(added)
    return env


def ssh_argv(config: LaunchConfig, host: Host, argv: list[str], env: Mapping[str, str]) -> list[str]:
    """``ssh [options] -- HOST 'cd CWD && exec env K=V ... ARGV'``: every word of the remote command quoted."""
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    remote = f"cd {shlex.quote(str(config.cwd))} && exec env {assignments} {shlex.join(argv)}"
    port = ["-p", str(config.ssh_port)] if config.ssh_port else []
    return ["ssh", *port, *ssh_options(config), "--", host.name, remote]


# ---- processes --------------------------------------------------------------------------------------


@dataclass
class _Agent:
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


class _PortReader:
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


class _Supervisor:
    """Watches the agents: the first non-zero exit stops the rest; SIGINT/SIGTERM is forwarded once, then kills."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.agents: list[_Agent] = []
        self.events: queue.Queue[tuple[str, int, int]] = queue.Queue()
        self.interrupted = 0  # the signal that arrived, if any

    def add(self, agent: _Agent) -> None:
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


class _Signals:
    """Route SIGINT/SIGTERM to the supervisor while a job runs (handlers restored afterwards)."""

    def __init__(self, supervisor: _Supervisor) -> None:
        self.supervisor = supervisor
        self.saved: dict[int, object] = {}

    def __enter__(self) -> _Signals:
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


# ---- the torch engine --------------------------------------------------------------------------------


def _master_addr(config: LaunchConfig) -> str:
    placement = config.placement()
    first = placement[0][0]
    if len(placement) == 1 and first.local:
        return "127.0.0.1"
    if first.local and first.name in ("localhost", "127.0.0.1", "::1"):
        return socket.getfqdn() or socket.gethostname()  # a name the other hosts can reach
    return first.name


def _run_id(config: LaunchConfig) -> str:
    """TORCHELASTIC_RUN_ID of the job: the run directory's name, or a timestamp."""
    return f"dpro-{config.run_dir.name}" if config.run_dir is not None else f"dpro-{dt.datetime.now():%Y%m%d-%H%M%S}"


class TorchEngine:
    """torch.distributed jobs (DDP, Lightning, plain collectives): one ``dpro.launch.node`` agent per host."""

    name = "torch"

    def __init__(self, *, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.grace_s = grace_s

    def agent_argv(self, config: LaunchConfig, node: int, master_port: int | str, run_id: str = "dpro") -> list[str]:
        placement = config.placement()
        offset = sum(n for _, n in placement[:node])
        argv = [sys.executable, "-m", "dpro.launch.node", "--node-rank", str(node), "--nnodes", str(len(placement)),
                "--nproc", str(placement[node][1]), "--rank-offset", str(offset), "--world-size", str(config.np),
                "--master-addr", _master_addr(config), "--master-port", str(master_port if node else 0),
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
            argv = self.agent_argv(config, node, master_port, _run_id(config))
            out.append(argv if host.local else ssh_argv(config, host, argv, remote_env(added)))
        return out

    def launch(self, config: LaunchConfig) -> int:
        """Start every host's agent (node 0 first: it binds the store's port), supervise, return the status."""
        added = job_env(config)
        local_env = {**os.environ, **added}
        placement = config.placement()
        supervisor = _Supervisor(self.grace_s)
        run_id = _run_id(config)
        with _Signals(supervisor):
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
               added: dict[str, str], supervisor: _Supervisor, run_id: str) -> int | None:
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
        supervisor.add(_Agent(f"host {host.name}", proc, remote=not host.local))
        if not first:
            return None
        reader = _PortReader(proc.stdout)
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


# ---- the horovod engine ------------------------------------------------------------------------------


HOROVOD_INSTALL = ("horovodrun is not installed. Install Horovod with PyTorch and Gloo support, e.g. "
                   "HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 pip install 'dpro[horovod]' "
                   "(horovod 0.28.1; needs cmake and a C++ compiler; see docs/guide/horovod.md), or run the job with "
                   "--engine torch")


def find_horovodrun() -> str | None:
    """``horovodrun`` next to this Python (the same virtual environment), else on PATH."""
    beside = Path(sys.executable).parent / "horovodrun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("horovodrun")


class HorovodEngine:
    """Horovod jobs: the real ``horovodrun`` with horovodrun's flags and dpro's environment."""

    name = "horovod"

    def command(self, config: LaunchConfig) -> list[list[str]]:
        exe = find_horovodrun()
        if exe is None:
            raise UsageError(HOROVOD_INSTALL)
        argv = [exe, "-np", str(config.np)]
        default_hosts = len(config.hosts) == 1 and config.hosts[0].name == "localhost"
        if not default_hosts:
            argv += ["-H", ",".join(str(h) for h in config.hosts)]
        if config.ssh_port:
            argv += ["-p", str(config.ssh_port)]
        if config.ssh_identity_file:
            argv += ["-i", config.ssh_identity_file]
        if config.controller:
            argv.append(f"--{config.controller}")
        argv += ["--start-timeout", str(int(config.start_timeout))]
        if config.network_interfaces:
            argv += ["--network-interfaces", config.network_interfaces]
        if config.output_filename:
            argv += ["--output-filename", config.output_filename]
        if config.verbose:
            argv.append("--verbose")
        if config.disable_cache:
            argv.append("--disable-cache")
        argv += horovodrun_flags(config.horovod, skip_env=applied_env(config))  # the config's env wins
        return [argv + config.command]

    def launch(self, config: LaunchConfig) -> int:
        (argv,) = self.command(config)
        check_host_keys(config)
        if config.verbose:
            _say(shlex.join(argv))
        proc = subprocess.Popen(argv, env={**os.environ, **job_env(config)}, start_new_session=True, cwd=config.cwd)
        supervisor = _Supervisor(DEFAULT_GRACE_S)
        with _Signals(supervisor):
            supervisor.add(_Agent("horovodrun", proc, remote=False))
            return supervisor.wait()


# ---- the tf engine -----------------------------------------------------------------------------------


TF_CONFIG = "TF_CONFIG"
TF_SIDE_PORT = "DPRO_TF_PORT"  # the TF plugin's side channel (run directory, clocks) between the workers


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


def _address(host: Host, port: int) -> str:
    name = f"[{host.name}]" if ":" in host.name else host.name  # an IPv6 address such as ::1
    return f"{name}:{port}"


def tf_cluster(config: LaunchConfig, ports: list[int]) -> list[str]:
    """The workers' ``host:port`` in rank order: each host's slots are filled before the next (as for torch)."""
    hosts = [host for host, n in config.placement() for _ in range(n)]
    if len(ports) != len(hosts):
        raise UsageError(f"--engine tf: {len(hosts)} workers need {len(hosts)} ports, got {len(ports)}")
    return [_address(host, port) for host, port in zip(hosts, ports, strict=True)]


def tf_config(cluster: list[str], index: int) -> str:
    """The ``TF_CONFIG`` of worker ``index``: the whole cluster and this worker's task."""
    return json.dumps({"cluster": {"worker": cluster}, "task": {"type": "worker", "index": index}})


def start_local(config: LaunchConfig, label: str, argv: list[str], env: dict[str, str], position: tuple[int, int],
                supervisor: _Supervisor) -> list[IO[bytes]]:
    """Start one process of the job on this machine and hand it to ``supervisor``; ``position`` (its index, the
    job's process count) names its --output-filename directory. Returns the output files to close at the end."""
    out = config.output_filename
    if out and not Path(out).is_absolute():
        out = str(config.cwd / out)
    try:
        proc, files = start_worker(argv, env, rank_output_dir(out, *position), cwd=config.cwd)
    except FileNotFoundError as err:
        raise UsageError(f"cannot start {argv[0]!r}: {err.strerror}") from err
    supervisor.add(_Agent(label, proc, remote=False))
    return files


class TFEngine:
    """TensorFlow jobs (``tf.distribute.MultiWorkerMirroredStrategy``): one process per slot, each with its
    ``TF_CONFIG``; local hosts only (``LaunchConfig`` refuses others)."""

    name = "tf"

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
        supervisor = _Supervisor(self.grace_s)
        files: list[IO[bytes]] = []
        try:
            with _Signals(supervisor):
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
               supervisor: _Supervisor) -> list[IO[bytes]]:
        if config.verbose:
            _say(f"worker {index}: {shlex.join(argv)}")
        return start_local(config, f"worker {index}", argv, env, (index, config.np), supervisor)


# ---- the mxnet engine ----------------------------------------------------------------------------------

DMLC_ROLE = "DMLC_ROLE"


def dmlc_env(role: str, *, port: int, num_servers: int, num_workers: int) -> dict[str, str]:
    """The ps-lite environment of one process (what MXNet's tools/launch.py gives on one machine): its role
    (scheduler, server or worker), the scheduler's address and the job's shape."""
    return {DMLC_ROLE: role, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_SERVER": str(num_servers), "DMLC_NUM_WORKER": str(num_workers)}


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
        if config.num_servers and config.num_servers != count:
            _say(f"{config.apply} sets {NUM_SERVERS_ENV}={count}; it overrides --num-servers {config.num_servers}")
        return count
    return int(config.num_servers or config.np)


class MXNetEngine:
    """MXNet jobs on ps-lite (``kvstore`` ``dist_sync`` / ``dist_async``): a scheduler, ``--num-servers`` servers
    and one worker per slot, local hosts only. Every process runs the job's command with its DMLC_* environment:
    ``import mxnet`` in the scheduler or a server serves the job and exits (what MXNet's own launcher relies on).
    The job ends when its workers do: servers and scheduler left after the last worker exited get the grace
    period and are then killed; a process that fails stops all the others. (Workers are labelled in start
    order; ps-lite numbers them, ``kv.rank``, in the order they connect.)"""

    name = "mxnet"

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
        supervisor = _Supervisor(self.grace_s)
        files: list[IO[bytes]] = []
        workers: set[int] = set()
        roles = self.roles(config)
        try:
            with _Signals(supervisor):
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
               supervisor: _Supervisor) -> list[IO[bytes]]:
        """Start one process; ``position``: (its index, the job's process count), for --output-filename."""
        argv = list(config.command)
        if config.verbose:
            _say(f"{label}: {env[DMLC_ROLE]} {shlex.join(argv)}")
        return start_local(config, label, argv, env, position, supervisor)


ENGINES: dict[str, type] = {TorchEngine.name: TorchEngine, HorovodEngine.name: HorovodEngine, TFEngine.name: TFEngine,
                            MXNetEngine.name: MXNetEngine}
