"""What one ``dpro-launch`` job is: the validated ``LaunchConfig`` and the small parsers that build it.

``config_from_args`` (in ``dpro.launch.cli``) turns the command line into a ``LaunchConfig``; the Python API
builds one directly. Every check lives in a ``__post_init__`` and raises ``UsageError`` with a message that
says how to fix the value ("--hosts 'a:x': slots must be an integer, e.g. a:4").
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from dpro.errors import UsageError
from dpro.launch.launcher import DEFAULT_WINDOW, LauncherOptions
from dpro.launch.launchers import LAUNCHERS
from dpro.record.protocol import Window
from dpro.record.protocol import parse_window as parse_protocol_window

__all__ = [
    "BACKWARD_MARKS",
    "DEFAULT_ENGINE",
    "ENGINE_NAMES",
    "Host",
    "LaunchConfig",
    "detect_engine",
    "is_local_host",
    "parse_hostfile",
    "parse_hosts",
    "default_window",
    "parse_window",
]

ENGINE_NAMES = tuple(LAUNCHERS)
DEFAULT_ENGINE = ENGINE_NAMES[0]  # the launcher --engine auto falls back to, and LaunchConfig's default
BACKWARD_MARKS = ("gradients", "tensors")  # --backward-marks: the recorder's (a launcher imports no plugin)
DEFAULT_START_TIMEOUT_S = 30.0  # a launcher's start_timeout_env overrides it, --start-timeout wins
_Options = TypeVar("_Options", bound=LauncherOptions)


# ---- hosts -----------------------------------------------------------------------------------------


def _local_names() -> frozenset[str]:
    names = {"localhost", "127.0.0.1", "::1"}
    for name in (socket.gethostname(), socket.getfqdn()):
        if name:
            names.add(name)
    return frozenset(names)


def is_local_host(name: str) -> bool:
    """True for the names that mean this machine: localhost, 127.0.0.1, ::1, this hostname (exact match).

    Any other name, even one that resolves to a loopback address such as 127.0.0.2, is reached over ssh.
    """
    return name in _local_names()


@dataclass(frozen=True)
class Host:
    """One host of the job and the number of processes (slots) it may run."""

    name: str
    slots: int

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name) or self.name.startswith("-"):
            raise UsageError(f"host name {self.name!r} is not valid; give a host name or address, e.g. node1:4")
        if not isinstance(self.slots, int) or isinstance(self.slots, bool) or self.slots < 1:
            raise UsageError(f"host {self.name!r}: slots must be a positive integer, got {self.slots!r}")

    @property
    def local(self) -> bool:
        return is_local_host(self.name)

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def _host_slots(item: str, where: str, example: str) -> Host:
    name, sep, slots = item.strip().rpartition(":")
    if not sep:  # "node1": one slot, as with mpirun
        return _host(item.strip(), 1, where)
    if not name:
        raise UsageError(f"{where} {item!r}: the host name is missing; write HOST:SLOTS, e.g. {example}")
    try:
        count = int(slots)
    except ValueError:
        raise UsageError(f"{where} {item!r}: slots must be an integer, e.g. {name}:4") from None
    if count < 1:
        raise UsageError(f"{where} {item!r}: slots must be at least 1, e.g. {name}:1")
    return _host(name, count, where)


def _host(name: str, slots: int, where: str) -> Host:
    """``Host(name, slots)`` with ``where`` (the option, or the file and line) in front of its message."""
    try:
        return Host(name, slots)
    except UsageError as err:
        raise UsageError(f"{where} {err}") from None


def parse_hosts(text: str) -> list[Host]:
    """``"a:4,b:2"`` (horovodrun's ``-H``) -> hosts in order. A host without ``:SLOTS`` has one slot.

    Raises:
        UsageError: an empty list, a missing host name, slots that are not a positive integer, a host twice.
    """
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(f"--hosts {text!r}: no hosts given; write HOST:SLOTS[,HOST:SLOTS...], e.g. node1:4,node2:4")
    hosts = [_host_slots(item, "--hosts", "node1:4") for item in items]
    _check_unique(hosts, "--hosts")
    return hosts


def parse_hostfile(path: str | Path) -> list[Host]:
    """A horovodrun/mpirun host file: one ``HOST slots=N`` (or ``HOST:N``, or ``HOST``) per line, ``#`` comments."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise UsageError(f"--hostfile {path}: cannot be read ({err.strerror or err})") from err
    hosts = []
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"--hostfile {path} line {n}:"
        parts = line.split()
        if len(parts) == 1:
            hosts.append(_host_slots(parts[0], where, "node1 slots=4"))
            continue
        if len(parts) != 2 or not parts[1].startswith("slots="):
            raise UsageError(f"{where} {line!r}: expected 'HOST slots=N', e.g. node1 slots=4")
        try:
            slots = int(parts[1][len("slots="):])
        except ValueError:
            raise UsageError(f"{where} {line!r}: slots must be an integer, e.g. {parts[0]} slots=4") from None
        hosts.append(_host(parts[0], slots, where))
    if not hosts:
        raise UsageError(f"--hostfile {path}: no hosts in the file; write one 'HOST slots=N' per line")
    _check_unique(hosts, f"--hostfile {path}")
    return hosts


def _check_unique(hosts: list[Host], where: str) -> None:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise UsageError(f"{where}: host {host.name!r} is listed twice; give its slots once, e.g. "
                             f"{host.name}:{sum(h.slots for h in hosts if h.name == host.name)}")
        seen.add(host.name)


def parse_window(text: str) -> Window:
    """``"10:20"`` -> iterations 10..19; ``"10:40:5"`` -> blocks of 5 recorded iterations with gaps of 5
    (``dpro.record.protocol.Window``). Iteration 0 cannot be recorded by dpro-launch.

    Raises:
        UsageError: not START:STOP[:BLOCK], START below 1, STOP not after START, or BLOCK below 2.
    """
    try:
        return parse_protocol_window(text, first=1)
    except UsageError as err:
        raise UsageError(f"--profile {err}") from None


def default_window(engine: str) -> Window:
    """The window ``--profile`` defaults to: the launcher's ``default_window`` (for Horovod, recorded blocks
    alternating with unrecorded ones, so that ``dpro info`` measures what recording costs against steps of the same
    job; for the other engines, ten steps from the tenth)."""
    return LAUNCHERS[engine].default_window


# ---- which engine --------------------------------------------------------------------------------


def detect_engine(command: list[str], cwd: Path | None = None) -> str:
    """``--engine auto``: the first launcher whose ``detects`` takes the command's script (Horovod's: a script that
    imports horovod), else ``DEFAULT_ENGINE``.

    The script is the first argument ending in ``.py``; its text is read, nothing is imported or run.
    """
    for word in command:
        if word.endswith(".py"):
            path = Path(word)
            if not path.is_absolute() and cwd is not None:
                path = cwd / path
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                return DEFAULT_ENGINE
            return next((name for name, launcher in LAUNCHERS.items() if launcher.detects(text)), DEFAULT_ENGINE)
    return DEFAULT_ENGINE


def default_options() -> dict[str, LauncherOptions]:
    """Every launcher's options with nothing given, by launcher name."""
    return {name: launcher.options_type() for name, launcher in LAUNCHERS.items()}


def _start_timeout_default() -> float:
    """``DEFAULT_START_TIMEOUT_S``, or the seconds of a launcher's ``start_timeout_env`` that is set."""
    for launcher in LAUNCHERS.values():
        name = launcher.start_timeout_env
        value = os.environ.get(name) if name else None
        if value:
            try:
                return float(value)
            except ValueError:
                raise UsageError(f"{name}={value!r}: expected seconds, e.g. 30") from None
    return DEFAULT_START_TIMEOUT_S


# ---- the launch config -----------------------------------------------------------------------------


@dataclass
class LaunchConfig:
    """One ``dpro-launch`` job, validated when it is made.

    Args:
        command: the training command, e.g. ``["python", "train.py", "--lr", "0.1"]``.
        np: total number of processes (``-np``).
        hosts: hosts and slots in order; processes fill each host's slots before the next (horovodrun's rule).
            Empty means ``localhost:np``.
        engine: the launcher that runs the job, a name of ``dpro.launch.launchers.LAUNCHERS`` (``--engine``).
        options: each launcher's own options (``LauncherOptions``: the values of its flags), by launcher name;
            a launcher left out gets its defaults. ``options_of(kind)`` gives one, typed.
        profile: the iterations to record (``Window``: START:STOP, optionally in blocks); None records nothing
            (``--no-profile``).
        run_dir: the run directory; None makes ``./dpro-runs/<timestamp>`` (under ``$DPRO_RUN_DIR`` if set).
        optimize: analyze the recorded run and write ``RUN/analysis/config.json`` afterwards.
        apply: a dpro config.json to apply, or "auto" (the newest config made for this job under the run root).
        auto: profile, optimize, re-run with the config, and print before/after.
        memory_budget_bytes: peak memory per rank that ``optimize`` must respect (recomputation).
        force: apply a config made for another job anyway.
        backward_marks: how the recorder times BW: "gradients" (from the gradients' ready marks, the default)
            or "tensors" (a tensor hook per module: exact per module, costlier).

    Raises:
        UsageError: any inconsistent or out-of-range value, with how to fix it.
    """

    command: list[str]
    np: int
    hosts: list[Host] = field(default_factory=list)
    engine: str = DEFAULT_ENGINE
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_known_hosts: str | None = None
    ssh_host_key_check: bool = True
    options: dict[str, LauncherOptions] = field(default_factory=default_options)
    start_timeout: float | None = None
    network_interfaces: str | None = None
    output_filename: str | None = None
    verbose: bool = False
    profile: Window | None = DEFAULT_WINDOW
    run_dir: Path | None = None
    optimize: bool = False
    apply: Path | str | None = None
    auto: bool = False
    memory_budget_bytes: int | None = None
    allow_compression: bool = False
    force: bool = False
    backward_marks: str = "gradients"
    cwd: Path = field(default_factory=Path.cwd)

    def __post_init__(self) -> None:
        self.command = list(self.command)
        if not self.command:
            raise UsageError("no command given; put the training command last, e.g. dpro-launch -np 2 python train.py")
        if self.command[0].startswith("-"):
            raise UsageError(f"unrecognized argument {self.command[0]!r} before the command; see dpro-launch --help")
        if not isinstance(self.np, int) or self.np < 1:
            raise UsageError(f"-np {self.np!r}: the number of processes must be a positive integer, e.g. -np 2")
        if not self.hosts:
            self.hosts = [Host("localhost", self.np)]
        slots = sum(h.slots for h in self.hosts)
        if slots < self.np:
            listed = ",".join(str(h) for h in self.hosts)
            raise UsageError(f"-np {self.np} asks for more processes than the hosts have slots ({listed}: {slots}); "
                             f"lower -np or add slots, e.g. -H {self.hosts[0].name}:{self.np}")
        if self.engine not in ENGINE_NAMES:
            raise UsageError(f"--engine {self.engine!r}: expected auto, {' or '.join(ENGINE_NAMES)}")
        self.options = {**default_options(), **self.options}
        runs_it = LAUNCHERS[self.engine]
        for options in self.options.values():
            options.check(self, runs_it)
        if runs_it.local_only:
            self._check_local_hosts()
        if self.ssh_port is not None and not 0 < self.ssh_port < 65536:
            raise UsageError(f"--ssh-port {self.ssh_port}: expected a port number between 1 and 65535")
        if self.ssh_identity_file is not None:
            key = Path(self.ssh_identity_file).expanduser()
            if not key.is_file():
                raise UsageError(f"--ssh-identity-file {self.ssh_identity_file}: no such file")
            self.ssh_identity_file = str(key.resolve())
        if self.ssh_known_hosts is not None:
            if not self.ssh_host_key_check:
                raise UsageError("--ssh-known-hosts names where host keys are checked, --ssh-no-host-key-check turns "
                                 "checking off; give one of them")
            known = Path(self.ssh_known_hosts).expanduser()
            if not known.parent.is_dir():
                raise UsageError(f"--ssh-known-hosts {self.ssh_known_hosts}: the folder {known.parent} does not exist")
            if '"' in str(known):  # ssh reads the option as a config line, where a double quote cannot be escaped
                raise UsageError(f"--ssh-known-hosts {self.ssh_known_hosts}: a path with a double quote in it")
            if known.is_dir():
                raise UsageError(f"--ssh-known-hosts {self.ssh_known_hosts}: a directory, not a known-hosts file")
            self.ssh_known_hosts = str(known.resolve())
        if self.start_timeout is None:
            self.start_timeout = _start_timeout_default()
        if self.start_timeout <= 0:
            raise UsageError(f"--start-timeout {self.start_timeout:g}: expected a positive number of seconds")
        if self.profile is not None and not 1 <= self.profile.start < self.profile.stop:
            raise UsageError(f"profile window {self.profile}: expected 1 <= START < STOP, e.g. 10:20")
        self.cwd = Path(self.cwd).resolve()
        if self.run_dir is not None:
            self.run_dir = Path(self.run_dir)
            if not self.run_dir.is_absolute():
                self.run_dir = self.cwd / self.run_dir
        if self.auto:
            if self.profile is None:
                raise UsageError("--auto profiles, optimizes and re-runs; it cannot be combined with --no-profile")
            if self.apply is not None:
                raise UsageError("--auto writes and applies its own config; drop --apply")
            self.optimize = True
            again = Path(f"{self.run_dir}-applied") if self.run_dir is not None else None
            if again is not None and again.is_dir() and any(again.iterdir()):
                raise UsageError(f"--auto records the re-run into {again}, which already holds a run; "
                                 "choose another --run-dir")
        if self.optimize and self.profile is None:
            raise UsageError("--optimize analyzes the recorded run; it cannot be combined with --no-profile")
        if self.backward_marks not in BACKWARD_MARKS:
            raise UsageError(f"--backward-marks {self.backward_marks!r}: expected gradients or tensors")
        if self.apply is not None and self.apply != "auto":
            path = Path(self.apply)
            path = path if path.is_absolute() else self.cwd / path
            if not path.is_file():
                raise UsageError(f"--apply {self.apply}: no such file; give the config.json that `dpro optimize` "
                                 "wrote, or --apply auto")
            self.apply = path
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise UsageError(f"--memory-budget {self.memory_budget_bytes}: expected a positive size, e.g. 2GiB")

    def _check_local_hosts(self) -> None:
        """A launcher that starts every process on this machine (``local_only``): a host that is not this machine is
        refused."""
        others = " or ".join(name for name, launcher in LAUNCHERS.items() if not launcher.local_only)
        for host, _ in self.placement():
            if not host.local:
                raise UsageError(f"--engine {self.engine}: host {host.name!r} is not this machine; only local hosts "
                                 f"({', '.join(sorted(_local_names()))}) are supported for --engine {self.engine} "
                                 f"yet. Start the job on that host, or use --engine {others} for several hosts")

    def options_of(self, kind: type[_Options]) -> _Options:
        """The options of the launcher whose options are of type ``kind``."""
        found = next((o for o in self.options.values() if type(o) is kind), None)
        if found is None:
            raise KeyError(f"no launcher has options of type {kind.__name__}")
        return found

    @property
    def world_size(self) -> int:
        return self.np

    def placement(self) -> list[tuple[Host, int]]:
        """(host, processes on it) in order: each host's slots are filled before the next; unused hosts dropped."""
        left, out = self.np, []
        for host in self.hosts:
            take = min(host.slots, left)
            if take:
                out.append((host, take))
            left -= take
        return out

    @property
    def multi_host(self) -> bool:
        return len(self.placement()) > 1 or not self.placement()[0][0].local
