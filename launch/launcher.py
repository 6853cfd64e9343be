"""The launcher protocol: what one launcher (``--engine``) brings to ``dpro-launch``, written once.

A launcher is a module (``torch_run``, ``horovod_run``, ``tf_run``, ``mxnet_run``) with a ``Launcher`` subclass and,
if it has flags of its own, a ``LauncherOptions`` subclass that holds their values. The shared plumbing (``cli``,
``settings``, ``env``, ``pipeline``) never names a launcher: it calls these hooks, each with a neutral default.

Parse time, on the ``Launcher`` class (every launcher's flags are on the one parser, whatever ``--engine`` says):

- ``add_arguments(parser, procs)``, ``add_dpro_arguments(dpro)``: its flags, in argument groups of its own or among
  the shared processes-and-hosts and dpro flags.
- ``processes_from_args(args, hosts, command)``: the process count and command when its own flags give them.
- ``options_from_args(args)``: its ``LauncherOptions`` from the parsed flags (and its config file, if it reads one).
- ``detects(script_text)``: ``--engine auto`` picks it for a script that reads like its kind of job.
- ``default_window``, ``local_only``, ``collectives``, ``start_timeout_env``, ``nothing_recorded``, ...: its
  defaults, traits and words (class attributes).

Run time, on its ``LauncherOptions`` (``LaunchConfig.options`` holds one per launcher):

- ``check(config, engine)``: refuse what its options cannot do with the launcher that runs the job.
- ``flag_env()``: the environment its flags give every job (any launcher's).
- ``engine_env(config)`` / ``recording_env(config, env, base)``: what it adds when it runs the job, before the
  applied config's ``env`` knobs / when the job records.
- ``record()``: its entries of ``RUN/launch.json``.

And on a ``Launcher`` instance: ``command(config)`` (the argv lists it will run; ``--verbose`` prints them) and
``launch(config)`` (runs the job, returns its exit status).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from dpro.record import job_env
from dpro.record.protocol import Window

if TYPE_CHECKING:
    from dpro.launch.settings import Host, LaunchConfig

__all__ = ["DEFAULT_WINDOW", "Launcher", "LauncherOptions", "seen_text"]

DEFAULT_WINDOW = Window(10, 20)


@dataclass
class LauncherOptions:
    """A launcher's own options (the values of its flags); a launcher without flags uses this class as it is."""

    def check(self, config: LaunchConfig, engine: type[Launcher]) -> None:
        """Refuse (``UsageError``) what these options cannot do when ``engine`` runs the job; fill in defaults."""

    def flag_env(self) -> dict[str, str]:
        """The environment variables these options give every job, whichever launcher runs it."""
        return {}

    def engine_env(self, config: LaunchConfig) -> dict[str, str]:
        """What this launcher adds to the job's environment when it runs the job (the applied config wins)."""
        return {}

    def recording_env(self, config: LaunchConfig, env: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
        """What this launcher adds when it runs a job that records; ``env`` is what dpro adds so far, ``base`` the
        environment it adds to."""
        return {}

    def record(self) -> dict[str, object]:
        """Its entries of ``RUN/launch.json`` (what was given, by name)."""
        return {}


class Launcher:
    """One way to start a job (``--engine NAME``); subclasses set ``name`` and implement ``command``/``launch``."""

    name: ClassVar[str]
    options_type: ClassVar[type[LauncherOptions]] = LauncherOptions
    default_window: ClassVar[Window] = DEFAULT_WINDOW
    """What ``--profile`` defaults to for this launcher's jobs."""
    local_only: ClassVar[bool] = False
    """It starts every process on this machine: a host that is not this machine is refused."""
    collectives: ClassVar[bool] = True
    """Its job communicates by collectives (a collective library's flags, such as a controller, apply to it)."""
    what: ClassVar[str] = "starts its processes itself"
    """What it does, in words, for a message that refuses a flag it has no use for."""
    start_timeout_env: ClassVar[str | None] = None
    """An environment variable whose seconds replace the default ``--start-timeout`` (any launcher's jobs)."""
    nothing_recorded: ClassVar[str] = "the job got no dpro recorder"
    """Why a job of this launcher recorded nothing, in words, when its auto-attach left no note."""
    seen_counts: ClassVar[tuple[tuple[str, str], ...]] = ()
    """What its auto-attach counts in ``seen.json`` (key, what it counts), to say what the job built."""
    seen_none: ClassVar[str] = ""
    """The words for a ``seen.json`` that counted nothing built."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, procs: argparse._ArgumentGroup) -> None:
        """Add this launcher's flags to ``parser``: in groups of its own, or among the processes-and-hosts flags
        (``procs``)."""

    @staticmethod
    def add_dpro_arguments(dpro: argparse._ArgumentGroup) -> None:
        """Add this launcher's flags among dpro's own (``--profile``, ``--apply``, ...)."""

    @staticmethod
    def processes_from_args(args: argparse.Namespace, hosts: list[Host],
                            command: list[str]) -> tuple[int, list[str]] | None:
        """(process count, command) when this launcher's flags give them; None leaves them to ``-np``."""
        return None

    @classmethod
    def options_from_args(cls, args: argparse.Namespace) -> LauncherOptions:
        """This launcher's options from the parsed flags."""
        return cls.options_type()

    @staticmethod
    def detects(script_text: str) -> bool:
        """True when ``--engine auto`` should pick this launcher for a script with this text."""
        return False

    def why_nothing_recorded(self, config: LaunchConfig) -> str:
        """Why the job recorded nothing, in words (a run directory was claimed and nothing is in it)."""
        window = config.profile if config.profile is not None else DEFAULT_WINDOW
        if self.seen_counts and config.run_dir is not None:
            seen = seen_text(config.run_dir / job_env.SEEN_FILE, window, self.seen_counts, self.seen_none)
            if seen:
                return seen
        return f"{self.nothing_recorded}, or ended before iteration {window.start}"

    def command(self, config: LaunchConfig) -> list[list[str]]:
        """The argv lists this launcher will run for ``config``."""
        raise NotImplementedError

    def launch(self, config: LaunchConfig) -> int:
        """Run the job; return its exit status."""
        raise NotImplementedError


def seen_text(path: Path, window: Window, built: tuple[tuple[str, str], ...], none_built: str) -> str:
    """What a job's auto-attach saw, in words (its ``seen.json`` at ``path``), when it recorded nothing; "" without
    one. ``built``: (key of seen.json, what it counts); ``none_built``: the words when it counted nothing."""
    try:
        seen = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    if not isinstance(seen, dict):
        return ""
    made = [f"{n} {what}" for n, what in ((seen.get(key), what) for key, what in built)
            if isinstance(n, int) and n > 0]
    steps = seen.get("optimizer_steps")
    if not made:
        return none_built
    ran = f"ran {steps} optimizer step(s)" if isinstance(steps, int) else "ran"
    return f"the job built {', '.join(made)} and {ran}, ending before iteration {window.start}"
