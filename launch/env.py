"""The environment of a launched job.

``job_env`` is everything dpro-launch adds to the environment of the processes it starts: dpro's own
variables (``DPRO_*``: record or not, the window, the run directory, the config to apply), the
``autoattach`` directory on ``PYTHONPATH`` (so an unmodified script is recorded), what each launcher's flags
give every job (``LauncherOptions.flag_env``), what the launcher running the job adds (``engine_env``,
``recording_env``), the applied config's ``env`` knobs and ``OMP_NUM_THREADS=1`` unless it is set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from dpro.config import DPRO_CONFIG
from dpro.record import job_env
from dpro.record.protocol import RUN_DIR_ENV

if TYPE_CHECKING:
    from dpro.launch.settings import LaunchConfig

__all__ = [
    "AUTOATTACH_DIR",
    "DPRO_APPLY_SEARCH",
    "DPRO_AUTO_RECORD",
    "DPRO_BACKWARD_MARKS",
    "DPRO_FORCE",
    "DPRO_LAUNCH",
    "DPRO_PROFILE",
    "applied_env",
    "apply_search_root",
    "flag_env",
    "job_env",
]

AUTOATTACH_DIR = Path(__file__).resolve().parent / "autoattach"
"""Holds the ``sitecustomize.py`` that attaches dpro to an unmodified script (prepended to PYTHONPATH)."""

# dpro's own variables: dpro.record.job_env names them for the launcher and the plugins alike
DPRO_LAUNCH, DPRO_AUTO_RECORD, DPRO_PROFILE = job_env.LAUNCH, job_env.AUTO_RECORD, job_env.PROFILE
DPRO_FORCE, DPRO_APPLY_SEARCH, DPRO_BACKWARD_MARKS = job_env.FORCE, job_env.APPLY_SEARCH, job_env.BACKWARD_MARKS


def _prepend_path(entry: str, current: str | None) -> str:
    parts = [p for p in (current or "").split(os.pathsep) if p and p != entry]
    return os.pathsep.join([entry, *parts])


def applied_env(config: LaunchConfig) -> dict[str, str]:
    """The ``env`` knobs of the config given with ``--apply FILE`` (empty without one).

    Raises:
        ConfigError: the file is not a valid dpro config.
    """
    if not isinstance(config.apply, Path):
        return {}
    from dpro.config import read_config

    return dict(read_config(config.apply).knobs.get("env", {}))


def flag_env(config: LaunchConfig) -> dict[str, str]:
    """What the launchers' flags give every job (each launcher's ``flag_env``, in the launchers' order)."""
    env: dict[str, str] = {}
    for options in config.options.values():
        env.update(options.flag_env())
    return env


def job_env(config: LaunchConfig, *, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables dpro-launch adds to (or changes in) ``base`` (default ``os.environ``) for the job's processes.

    The applied config's ``env`` knobs win over the settings given on the command line.
    ``config.run_dir`` should be set (claimed) when the job profiles.
    """
    base = os.environ if base is None else base
    runs_it = config.options[config.engine]  # the options of the launcher that runs the job
    env: dict[str, str] = {DPRO_LAUNCH: "1"}
    env.update(flag_env(config))
    env.update(runs_it.engine_env(config))
    env.update(applied_env(config))
    if "OMP_NUM_THREADS" not in base and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"
    if config.profile is not None:
        env[DPRO_AUTO_RECORD] = "1"
        env[DPRO_PROFILE] = str(config.profile)
        env.update(runs_it.recording_env(config, env, base))
    else:
        env[DPRO_AUTO_RECORD] = "0"
    if config.run_dir is not None:
        env[RUN_DIR_ENV] = str(config.run_dir)
    if isinstance(config.apply, Path):
        env[DPRO_CONFIG] = str(config.apply)
    elif config.apply == "auto":
        env[DPRO_APPLY_SEARCH] = str(apply_search_root(config))
    if config.force:
        env[DPRO_FORCE] = "1"
    if config.backward_marks != "gradients":
        env[DPRO_BACKWARD_MARKS] = config.backward_marks
    env["PYTHONPATH"] = _prepend_path(str(AUTOATTACH_DIR), base.get("PYTHONPATH"))
    return env


def apply_search_root(config: LaunchConfig) -> Path:
    """Where ``--apply auto`` looks for configs: the run root (the parent of the run directory)."""
    from dpro.record.protocol import DEFAULT_RUN_ROOT

    if config.run_dir is not None:
        return config.run_dir.parent
    return Path(os.environ.get(RUN_DIR_ENV) or (config.cwd / DEFAULT_RUN_ROOT)).resolve()
