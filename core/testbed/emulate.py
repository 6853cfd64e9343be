"""An emulated cluster network on one machine: hosts in Linux network namespaces, links limited by tc.

Each "host" is a network namespace with one interface (``eth0``) plugged into a Linux bridge that
lives in a namespace of its own (the "switch"), so nothing is added to the root namespace. Every
host link is limited in both directions like a full-duplex NIC on a switch port:

- host -> switch: a ``tbf`` qdisc (rate, burst) on the host's ``eth0``, with a ``netem`` child
  adding the one-way ``delay`` (so a round trip between two hosts takes ``2 * delay``);
- switch -> host: a ``tbf`` qdisc (rate, burst) on the switch-side end of the host's veth pair.

Processes started in a host talk real TCP to the other hosts, so real collectives (gloo, ps-lite,
...) see the limits; ranks on the same host talk over that host's unlimited loopback.
Requirements: Linux, root, iproute2 (``ip``, ``tc``) and the kernel's ``tbf`` qdisc; a ``delay``
above zero also needs ``netem`` (``CONFIG_NET_SCH_NETEM``), which some kernels lack
(``netem_available()`` tells). The module is stdlib only and imports no ML framework.

Example::

    import sys
    from dpro import testbed as tb

    ok, why = tb.testbed_available()          # (False, reason) where namespaces are refused
    spec = tb.NetworkSpec(rate="1gbit")
    with tb.emulated_cluster(2, spec) as cluster:
        print(tb.measure_bandwidth(cluster) / 1e9, "Gbit/s")
        results = tb.run_ranks(
            cluster,
            lambda rank: [sys.executable, "train.py"],
            ranks_per_host=1,
            env_for_rank=lambda rank: tb.torch_rank_env(cluster, rank, world_size=2, ranks_per_host=1),
            timeout=120,
        )
    # namespaces, bridge and veths are gone here, also after an exception or Ctrl-C

Names: the namespaces of one cluster are ``<prefix>-sw`` (the switch) and ``<prefix>-h0`` ..
``<prefix>-h<n-1>``. Without ``name_prefix`` the prefix is ``dtb<pid>x<counter>``, unique per use.
A process killed before its ``with`` block ends leaves its namespaces behind:
``cleanup_stale()`` removes those of dead owner processes (``cleanup_stale(prefix)`` those of one
prefix), also from the shell: ``python -m dpro.testbed cleanup [PREFIX]``.

Lower-level pieces: ``Host.wrap(argv)`` gives the argv that runs ``argv`` inside a host
(``ip netns exec <ns> ...``, never a shell string), ``Cluster.popen`` / ``Cluster.run`` start it,
``measure_rtt`` times TCP round trips. In pytest files import the module (``from dpro import
testbed``), not the function ``testbed_available`` itself: pytest would collect it as a test.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import itertools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "AUTO_PREFIX",
    "BRIDGE_IFNAME",
    "Cluster",
    "EmulationError",
    "HELPER_PORT",
    "HOST_IFNAME",
    "Host",
    "NETEM_LIMIT",
    "NetworkSpec",
    "TBF_QUEUE_LATENCY",
    "cleanup_stale",
    "emulated_cluster",
    "main",
    "measure_bandwidth",
    "measure_rtt",
    "netem_available",
    "run_ranks",
    "testbed_available",
    "torch_rank_env",
]


AUTO_PREFIX = "dtb"
HOST_IFNAME = "eth0"
BRIDGE_IFNAME = "br0"
TBF_QUEUE_LATENCY = "50ms"  # the most a packet may wait in a tbf queue before it is dropped
NETEM_LIMIT = 100_000  # packets netem may hold (delay x rate must fit)
HELPER_PORT = 5201

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3,
               "kbit": 1024 / 8, "mbit": 1024**2 / 8, "gbit": 1024**3 / 8}
_NUMBER = r"(\d+(?:\.\d+)?)"
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")
_AUTO_RE = re.compile(rf"{AUTO_PREFIX}(\d+)x\d+")
_counter = itertools.count()


class EmulationError(RuntimeError):
    """Setting up, using or tearing down the emulated network failed (the message names the command)."""


def _parse(value: str, units: Mapping[str, float], what: str, example: str) -> float:
    match = re.fullmatch(_NUMBER + r"\s*([a-z]*)", str(value).strip().lower())
    if not match or match.group(2) not in units:
        raise ValueError(f"NetworkSpec.{what}={value!r} is not understood; write e.g. {example!r} "
                         f"(units: {', '.join(u for u in units if u)})")
    return float(match.group(1)) * units[match.group(2)]


@dataclass(frozen=True)
class NetworkSpec:
    """The limits of every host link, in tc's notation.

    Attributes:
        rate: bandwidth of each host link, each direction ("1gbit", "10gbit", "200mbit"; "bps" = bytes/s).
        delay: one-way host-to-host latency added on each host's egress ("0ms", "0.1ms", "5ms");
            anything above zero needs the kernel's netem qdisc.
        burst: tbf bucket size ("256kb"); at least one full-size frame (2kb).
        subnet: IPv4 network of the hosts; host i gets the (i+1)-th address.
    """

    rate: str = "1gbit"
    delay: str = "0ms"
    burst: str = "256kb"
    subnet: str = "10.77.0.0/24"

    def __post_init__(self) -> None:
        if self.rate_bits <= 0:
            raise ValueError(f"NetworkSpec.rate={self.rate!r} must be above zero")
        self.delay_seconds  # noqa: B018 - validates
        if self.burst_bytes < 2048:
            raise ValueError(f"NetworkSpec.burst={self.burst!r} must hold at least one frame (>= 2kb)")
        try:
            net = ipaddress.ip_network(self.subnet, strict=True)
        except ValueError as exc:
            raise ValueError(f"NetworkSpec.subnet={self.subnet!r} is not a network such as '10.77.0.0/24': "
                             f"{exc}") from None
        if net.version != 4 or net.prefixlen > 30:
            raise ValueError(f"NetworkSpec.subnet={self.subnet!r} must be an IPv4 network of /30 or larger")

    @property
    def rate_bits(self) -> float:
        """The rate in bits per second."""
        return _parse(self.rate, _RATE_UNITS, "rate", "1gbit")

    @property
    def delay_seconds(self) -> float:
        """The one-way delay in seconds."""
        return _parse(self.delay, _TIME_UNITS, "delay", "0.1ms")

    @property
    def burst_bytes(self) -> int:
        """The tbf burst in bytes."""
        return int(_parse(self.burst, _SIZE_UNITS, "burst", "256kb"))

    def addresses(self, n_hosts: int) -> list[str]:
        """The addresses of hosts 0..n_hosts-1."""
        net = ipaddress.ip_network(self.subnet)
        if n_hosts > net.num_addresses - 2:
            raise ValueError(f"NetworkSpec.subnet={self.subnet!r} has room for {net.num_addresses - 2} hosts, "
                             f"not {n_hosts}")
        return [str(net.network_address + i + 1) for i in range(n_hosts)]


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, address and interface (pass ``ifname`` as GLOO_SOCKET_IFNAME)."""

    index: int
    name: str
    netns: str
    address: str
    ifname: str = HOST_IFNAME

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` inside this host: ``["ip", "netns", "exec", netns, *argv]``."""
        if isinstance(argv, str | bytes) or not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError(f"argv must be a non-empty list of str, not {argv!r}")
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class Cluster:
    """A running emulated cluster (valid inside ``emulated_cluster``'s ``with`` block only)."""

    prefix: str
    spec: NetworkSpec
    hosts: list[Host]
    switch_netns: str
    netns_names: list[str] = field(default_factory=list)

    def popen(self, host_index: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kw) -> subprocess.Popen:
        """Start ``argv`` inside host ``host_index``; ``env`` (whole environment) and ``kw`` go to Popen."""
        wrapped = self.hosts[host_index].wrap(argv)
        return subprocess.Popen([_ip(), *wrapped[1:]], env=None if env is None else dict(env), **kw)

    def run(self, host_index: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
            **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``host_index`` to completion (``kw`` goes to subprocess.run)."""
        wrapped = self.hosts[host_index].wrap(argv)
        return subprocess.run([_ip(), *wrapped[1:]], env=None if env is None else dict(env), **kw)


# ---------------------------------------------------------------------------------------------------- commands

def _ip() -> str:
    return _which("ip")


def _which(name: str) -> str:
    for folder in (*os.get_exec_path(), "/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK):
            return path
    raise EmulationError(f"{name!r} not found: install iproute2")


def _cmd(*argv: str) -> str:
    """Run an ip/tc command; raise EmulationError with its stderr when it fails."""
    full = [_which(argv[0]), *argv[1:]]
    proc = subprocess.run(full, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise EmulationError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _list_netns() -> list[str]:
    out = _cmd("ip", "netns", "list")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_netns_processes(netns: str) -> None:
    """SIGKILL every process still inside ``netns`` (processes this testbed started there)."""
    for _ in range(50):
        try:
            pids = [int(p) for p in _cmd("ip", "netns", "pids", netns).split()]
        except EmulationError:
            return
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _delete_netns(names: Sequence[str]) -> list[str]:
    """Kill the processes in and delete each existing namespace of ``names``; return the problems."""
    existing = set(_list_netns())
    problems = []
    for name in names:
        if name not in existing:
            continue
        try:
            _kill_netns_processes(name)
            _cmd("ip", "netns", "del", name)
        except EmulationError as exc:
            problems.append(str(exc))
    return problems


def _cluster_netns(prefix: str, existing: Sequence[str]) -> list[str]:
    pattern = re.compile(rf"{re.escape(prefix)}-(sw|h\d+)")
    return [n for n in existing if pattern.fullmatch(n)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str | None = None) -> list[str]:
    """Remove namespaces a crashed run left behind; return the names removed.

    With ``prefix``: every namespace of that cluster (``<prefix>-sw``, ``<prefix>-h<i>``), so do not
    pass the prefix of a cluster that is still running. Without: the namespaces of automatically
    named clusters whose owner process no longer exists (safe while other runs are live).
    """
    existing = _list_netns()
    if prefix is not None:
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"prefix {prefix!r}: use letters, digits, '_', '.', '-' (at most 40)")
        stale = _cluster_netns(prefix, existing)
    else:
        stale = []
        for name in existing:
            match = re.fullmatch(rf"({_AUTO_RE.pattern})-(sw|h\d+|probe)", name)
            if match and not _pid_alive(int(match.group(2))):
                stale.append(name)
    problems = _delete_netns(stale)
    if problems:
        raise EmulationError("cleanup failed: " + "; ".join(problems))
    return stale


# ---------------------------------------------------------------------------------------------------- probes

def _probe(with_netem: bool) -> tuple[bool, str]:
    name = f"{AUTO_PREFIX}{os.getpid()}x{next(_counter)}-probe"
    try:
        _which("ip"), _which("tc")
        if os.geteuid() != 0:
            return False, "the emulated cluster needs root (network namespaces, tc)"
        _cmd("ip", "netns", "add", name)
        try:
            _cmd("ip", "-n", name, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb")
            _cmd("tc", "-n", name, "qdisc", "add", "dev", "pa", "root", "handle", "1:", "tbf", "rate", "1gbit",
                 "burst", "256kb", "latency", TBF_QUEUE_LATENCY)
            if with_netem:
                _cmd("tc", "-n", name, "qdisc", "add", "dev", "pa", "parent", "1:1", "handle", "10:", "netem",
                     "delay", "1ms")
        finally:
            _delete_netns([name])
    except (EmulationError, OSError, subprocess.SubprocessError) as exc:
        what = "the netem qdisc (NetworkSpec.delay > 0)" if with_netem else "network namespaces with veth + tbf"
        return False, f"{what} unavailable here: {exc}"
    return True, ""


def testbed_available() -> tuple[bool, str]:
    """``(True, "")`` if namespaces, veth pairs and tbf work here, else ``(False, reason)`` for pytest.skip."""
    return _probe(with_netem=False)


def netem_available() -> tuple[bool, str]:
    """``(True, "")`` if a NetworkSpec.delay above zero can be applied (the kernel has netem), else why not."""
    ok, why = _probe(with_netem=False)
    return _probe(with_netem=True) if ok else (ok, why)


# ---------------------------------------------------------------------------------------------------- cluster

def _setup(prefix: str, n_hosts: int, spec: NetworkSpec, created: list[str]) -> Cluster:
    switch = f"{prefix}-sw"
    addresses = spec.addresses(n_hosts)
    plen = str(ipaddress.ip_network(spec.subnet).prefixlen)
    tbf = ["tbf", "rate", spec.rate, "burst", spec.burst, "latency", TBF_QUEUE_LATENCY]
    _cmd("ip", "netns", "add", switch)
    created.append(switch)
    _cmd("ip", "-n", switch, "link", "set", "lo", "up")
    _cmd("ip", "-n", switch, "link", "add", "name", BRIDGE_IFNAME, "type", "bridge")
    _cmd("ip", "-n", switch, "link", "set", BRIDGE_IFNAME, "up")
    hosts = []
    for i, address in enumerate(addresses):
        netns, port = f"{prefix}-h{i}", f"p{i}"
        _cmd("ip", "netns", "add", netns)
        created.append(netns)
        _cmd("ip", "-n", netns, "link", "set", "lo", "up")
        _cmd("ip", "-n", switch, "link", "add", "name", port, "type", "veth", "peer", "name", HOST_IFNAME,
             "netns", netns)
        _cmd("ip", "-n", switch, "link", "set", port, "master", BRIDGE_IFNAME)
        _cmd("ip", "-n", switch, "link", "set", port, "up")
        _cmd("ip", "-n", netns, "addr", "add", f"{address}/{plen}", "dev", HOST_IFNAME)
        _cmd("ip", "-n", netns, "link", "set", HOST_IFNAME, "up")
        # host -> switch: rate, then the one-way delay; switch -> host: rate
        _cmd("tc", "-n", netns, "qdisc", "add", "dev", HOST_IFNAME, "root", "handle", "1:", *tbf)
        if spec.delay_seconds > 0:
            try:
                _cmd("tc", "-n", netns, "qdisc", "add", "dev", HOST_IFNAME, "parent", "1:1", "handle", "10:",
                     "netem", "delay", spec.delay, "limit", str(NETEM_LIMIT))
            except EmulationError as exc:
                raise EmulationError(f"NetworkSpec.delay={spec.delay!r} needs the kernel's netem qdisc "
                                     f"(CONFIG_NET_SCH_NETEM), which this kernel lacks; use delay='0ms'. "
                                     f"{exc}") from None
        _cmd("tc", "-n", switch, "qdisc", "add", "dev", port, "root", *tbf)
        hosts.append(Host(index=i, name=f"h{i}", netns=netns, address=address))
    return Cluster(prefix=prefix, spec=spec, hosts=hosts, switch_netns=switch, netns_names=list(created))


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C back while cleaning up (it is delivered right after)."""
    blocked = threading.current_thread() is threading.main_thread()
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def emulated_cluster(n_hosts: int, spec: NetworkSpec | None = None,
                     name_prefix: str | None = None) -> Iterator[Cluster]:
    """Create ``n_hosts`` hosts joined by limited links; always remove them again on exit.

    Raises:
        ValueError: bad ``n_hosts`` or ``name_prefix``, or a subnet too small.
        EmulationError: a command failed (e.g. no root, no netem for a delay) or ``name_prefix``
            is in use (``cleanup_stale(prefix)`` removes leftovers of a crashed run).
    """
    spec = spec or NetworkSpec()
    if not isinstance(n_hosts, int) or n_hosts < 1:
        raise ValueError(f"n_hosts={n_hosts!r} must be an int >= 1")
    spec.addresses(n_hosts)
    prefix = name_prefix or f"{AUTO_PREFIX}{os.getpid()}x{next(_counter)}"
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"name_prefix={prefix!r}: use letters, digits, '_', '.', '-' (at most 40)")
    in_use = _cluster_netns(prefix, _list_netns())
    if in_use:
        raise EmulationError(f"namespaces {in_use} exist already; another run uses prefix {prefix!r}, "
                             f"or a crashed one left them (dpro.testbed.cleanup_stale({prefix!r}))")
    created: list[str] = []
    try:
        yield _setup(prefix, n_hosts, spec, created)
    finally:
        with _sigint_deferred():
            problems = _delete_netns(created)
        if problems:
            warnings.warn(f"dpro.testbed: cleanup of {prefix!r} incomplete: {'; '.join(problems)}", stacklevel=3)


# ---------------------------------------------------------------------------------------------------- ranks

def torch_rank_env(cluster: Cluster, rank: int, world_size: int, ranks_per_host: int = 1,
                   master_port: int = 29500) -> dict[str, str]:
    """The torch.distributed environment of ``rank`` (rank r runs on host r // ranks_per_host)."""
    if ranks_per_host < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size}); ranks_per_host={ranks_per_host}")
    host = cluster.hosts[_host_of(cluster, rank, ranks_per_host)]
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % ranks_per_host),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(ranks_per_host),
        "GROUP_RANK": str(host.index),
        "MASTER_ADDR": cluster.hosts[0].address,
        "MASTER_PORT": str(master_port),
        "GLOO_SOCKET_IFNAME": host.ifname,
        "TP_SOCKET_IFNAME": host.ifname,
        "OMP_NUM_THREADS": "1",
    }


def _host_of(cluster: Cluster, rank: int, ranks_per_host: int) -> int:
    index = rank // ranks_per_host
    if index >= len(cluster.hosts):
        raise ValueError(f"rank {rank} with {ranks_per_host} ranks per host needs host {index}, "
                         f"but the cluster has {len(cluster.hosts)}")
    return index


def run_ranks(cluster: Cluster, argv_for_rank: Callable[[int], list[str]], ranks_per_host: int = 1,
              env_for_rank: Callable[[int], Mapping[str, str]] | None = None, timeout: float = 120.0,
              cwd: str | os.PathLike | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``ranks_per_host`` ranks on every host (rank r on host r // ranks_per_host) and wait.

    ``env_for_rank(r)`` is laid over ``os.environ``. When a rank exits non-zero or ``timeout``
    seconds pass, every rank still running is killed (returncode -9) and a line saying why is
    appended to its stderr. Returns one CompletedProcess per rank (text stdout/stderr); it never
    raises for a failed rank, so check the return codes.
    """
    n_ranks = ranks_per_host * len(cluster.hosts)
    procs: list[subprocess.Popen] = []
    files = []
    reason = ""
    try:
        for rank in range(n_ranks):
            env = dict(os.environ)
            env.update(env_for_rank(rank) if env_for_rank else {})
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            files.append((out, err))
            procs.append(cluster.popen(_host_of(cluster, rank, ranks_per_host), argv_for_rank(rank), env=env,
                                       stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd,
                                       start_new_session=True))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                reason = f"rank {failed[0]} exited {codes[failed[0]]}"
                break
            if all(c is not None for c in codes):
                break
            if time.monotonic() > deadline:
                reason = f"timeout after {timeout:g} s"
                break
            time.sleep(0.02)
    finally:
        killed = set()
        for rank, proc in enumerate(procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                killed.add(rank)
        for proc in procs:
            proc.wait()
    results = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, files, strict=True)):
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
        out.close()
        err.close()
        if rank in killed:
            stderr += f"\n[dpro.testbed] rank {rank} killed: {reason}\n"
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


# ---------------------------------------------------------------------------------------------------- measuring

def _helper(*args: str) -> list[str]:
    return [sys.executable, "-m", "dpro.testbed", *args]


def _client_server(cluster: Cluster, a: int, b: int, server: list[str], client: list[str],
                   timeout: float) -> tuple[dict, dict]:
    """Start ``server`` in host b, wait for its "ready" line, run ``client`` in host a; both print JSON."""
    srv = cluster.popen(b, server, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        stdin=subprocess.DEVNULL)
    try:
        ready = srv.stdout.readline().strip()
        if ready != "ready":
            raise EmulationError(f"helper {' '.join(server[1:])} did not start: {ready} {srv.stderr.read()}")
        cli = cluster.run(a, client, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if cli.returncode != 0:
            raise EmulationError(f"helper {' '.join(client[1:])} failed ({cli.returncode}): {cli.stderr}")
        srv_out, srv_err = srv.communicate(timeout=timeout)
        if srv.returncode != 0:
            raise EmulationError(f"helper {' '.join(server[1:])} failed ({srv.returncode}): {srv_err}")
        return json.loads(cli.stdout), json.loads(srv_out)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def measure_bandwidth(cluster: Cluster, a: int = 0, b: int = 1, seconds: float = 1.0) -> float:
    """TCP goodput from host ``a`` to host ``b`` in bits/s (one stream for ``seconds``, as seen by ``b``)."""
    if a == b:
        raise ValueError(f"hosts a={a} and b={b} must differ (within one host traffic skips the link)")
    addr = cluster.hosts[b].address
    _, received = _client_server(
        cluster, a, b,
        _helper("recv", "--bind", addr, "--port", str(HELPER_PORT)),
        _helper("send", "--host", addr, "--port", str(HELPER_PORT), "--seconds", str(seconds)),
        timeout=seconds + 30)
    return received["bytes"] * 8 / received["seconds"]


def measure_rtt(cluster: Cluster, a: int = 0, b: int = 1, count: int = 10) -> float:
    """Median round trip (seconds) of a 1-byte TCP echo from host ``a`` to host ``b``."""
    if a == b:
        raise ValueError(f"hosts a={a} and b={b} must differ (within one host traffic skips the link)")
    addr = cluster.hosts[b].address
    sent, _ = _client_server(
        cluster, a, b,
        _helper("echo", "--bind", addr, "--port", str(HELPER_PORT)),
        _helper("ping", "--host", addr, "--port", str(HELPER_PORT), "--count", str(count)),
        timeout=30)
    return statistics.median(sent["rtts"])


def _listen(bind: str, port: int) -> socket.socket:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind, port))
    srv.listen(1)
    srv.settimeout(30)
    print("ready", flush=True)
    return srv


def _connect(host: str, port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _cmd_recv(args: argparse.Namespace) -> None:
    with _listen(args.bind, args.port) as srv:
        conn, _ = srv.accept()
        with conn:
            first = conn.recv(1 << 20)
            start = time.perf_counter()
            total = 0
            buf = bytearray(1 << 20)
            while n := conn.recv_into(buf):
                total += n
            elapsed = time.perf_counter() - start
    print(json.dumps({"bytes": total, "seconds": elapsed, "first_chunk": len(first)}))


def _cmd_send(args: argparse.Namespace) -> None:
    chunk = b"\0" * (1 << 20)
    total = 0
    with _connect(args.host, args.port) as sock:
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            sock.sendall(chunk)
            total += len(chunk)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # the receiver closes once it has read everything
    print(json.dumps({"bytes": total}))


def _cmd_echo(args: argparse.Namespace) -> None:
    with _listen(args.bind, args.port) as srv:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(64):
                conn.sendall(data)
    print(json.dumps({}))


def _cmd_ping(args: argparse.Namespace) -> None:
    rtts = []
    with _connect(args.host, args.port) as sock:
        for _ in range(args.count + 1):  # the first round trip warms up
            t0 = time.perf_counter()
            sock.sendall(b"x")
            if not sock.recv(1):
                raise ConnectionError("echo server closed")
            rtts.append(time.perf_counter() - t0)
    print(json.dumps({"rtts": rtts[1:]}))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dpro.testbed {check,cleanup,recv,send,echo,ping}`` (the last four run inside hosts)."""
    parser = argparse.ArgumentParser(prog="python -m dpro.testbed", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="say whether namespaces and netem work here")
    clean = sub.add_parser("cleanup", help="remove namespaces left by crashed runs")
    clean.add_argument("prefix", nargs="?", help="remove this cluster's namespaces (default: dead owners')")
    for name in ("recv", "echo"):
        p = sub.add_parser(name)
        p.add_argument("--bind", required=True)
        p.add_argument("--port", type=int, default=HELPER_PORT)
    for name in ("send", "ping"):
        p = sub.add_parser(name)
        p.add_argument("--host", required=True)
        p.add_argument("--port", type=int, default=HELPER_PORT)
        p.add_argument("--seconds", type=float, default=1.0)
        p.add_argument("--count", type=int, default=10)
    args = parser.parse_args(argv)
    if args.command == "check":
        for what, (ok, why) in (("namespaces + tbf", testbed_available()), ("netem delay", netem_available())):
            print(f"{what}: {'ok' if ok else why}")
        return 0
    if args.command == "cleanup":
        removed = cleanup_stale(args.prefix)
        print("removed: " + (" ".join(removed) or "nothing"))
        return 0
    {"recv": _cmd_recv, "send": _cmd_send, "echo": _cmd_echo, "ping": _cmd_ping}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
