"""One table from launcher settings to environment variables, and the environment of a launched job.

``HOROVOD_KNOBS`` is the single table from horovodrun's tunable settings to Horovod's environment
variables (the names and conversions of horovod 0.28.1's ``runner/common/util/config_parser.py``). The
same table gives the horovodrun flag of each setting, so the horovod engine passes flags and the torch
engine sets variables from one source.

``job_env`` is everything the launcher adds to the environment of the processes it starts: dpro's own
variables (``DPRO_*``: record or not, the window, the run directory, the config to apply), the
``autoattach`` directory on ``PYTHONPATH`` (so an unmodified script is recorded), Horovod's knobs,
the applied config's ``env`` knobs and ``OMP_NUM_THREADS=1`` unless it is set.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpro.config import DPRO_CONFIG
from dpro.launch.settings import HorovodSettings, LaunchConfig
from dpro.record import job_env
from dpro.record.protocol import RUN_DIR_ENV

__all__ = [
    "AUTOATTACH_DIR",
    "DPRO_APPLY_SEARCH",
    "DPRO_AUTO_RECORD",
    "DPRO_BACKWARD_MARKS",
    "DPRO_FORCE",
    "DPRO_LAUNCH",
    "DPRO_PROFILE",
    "HOROVOD_KNOBS",
    "applied_env",
    "apply_search_root",
    "EnvKnob",
    "horovod_env",
    "horovodrun_flags",
    "job_env",
]

AUTOATTACH_DIR = Path(__file__).resolve().parent / "autoattach"
"""Holds the ``sitecustomize.py`` that attaches dpro to an unmodified script (prepended to PYTHONPATH)."""

# dpro's own variables: dpro.record.job_env names them for the launcher and the plugins alike
DPRO_LAUNCH, DPRO_AUTO_RECORD, DPRO_PROFILE = job_env.LAUNCH, job_env.AUTO_RECORD, job_env.PROFILE
DPRO_FORCE, DPRO_APPLY_SEARCH, DPRO_BACKWARD_MARKS = job_env.FORCE, job_env.APPLY_SEARCH, job_env.BACKWARD_MARKS


def _int_bytes(mb: Any) -> str:
    return str(int(float(mb) * 1024 * 1024))


def _flag(value: Any) -> str:
    return "1" if value else "0"


def _whole_mb(mb: Any) -> str | None:
    """horovodrun's --fusion-threshold-mb takes whole MB; a fraction goes by the environment only."""
    return str(int(mb)) if float(mb).is_integer() else None


@dataclass(frozen=True)
class EnvKnob:
    """One horovodrun setting: its ``HorovodSettings`` field, environment variable and conversion.

    ``only_with`` names a setting that must be on for this one to count (autotune_* need --autotune;
    the mark-cycles switch needs a timeline file), as in horovodrun. ``flag`` is the horovodrun option,
    ``to_flag`` its value (None: horovodrun cannot take it, the environment variable alone carries it).
    """

    setting: str
    env: str
    to_env: Callable[[Any], str] = str
    only_with: str | None = None
    to_flag: Callable[[Any], str | None] = str

    @property
    def flag(self) -> str:
        return "--" + self.setting.replace("_", "-")


HOROVOD_KNOBS: tuple[EnvKnob, ...] = (
    EnvKnob("fusion_threshold_mb", "HOROVOD_FUSION_THRESHOLD", _int_bytes, to_flag=_whole_mb),
    EnvKnob("cycle_time_ms", "HOROVOD_CYCLE_TIME"),
    EnvKnob("cache_capacity", "HOROVOD_CACHE_CAPACITY"),
    EnvKnob("hierarchical_allreduce", "HOROVOD_HIERARCHICAL_ALLREDUCE", _flag),
    EnvKnob("hierarchical_allgather", "HOROVOD_HIERARCHICAL_ALLGATHER", _flag),
    EnvKnob("autotune", "HOROVOD_AUTOTUNE", _flag, only_with="autotune"),
    EnvKnob("autotune_log_file", "HOROVOD_AUTOTUNE_LOG", only_with="autotune"),
    EnvKnob("autotune_warmup_samples", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", only_with="autotune"),
    EnvKnob("autotune_steps_per_sample", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", only_with="autotune"),
    EnvKnob("autotune_bayes_opt_max_samples", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", only_with="autotune"),
    EnvKnob("autotune_gaussian_process_noise", "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", only_with="autotune"),
    EnvKnob("timeline_filename", "HOROVOD_TIMELINE"),
    EnvKnob("timeline_mark_cycles", "HOROVOD_TIMELINE_MARK_CYCLES", _flag, only_with="timeline_filename"),
    EnvKnob("no_stall_check", "HOROVOD_STALL_CHECK_DISABLE", _flag),
    EnvKnob("stall_check_warning_time_seconds", "HOROVOD_STALL_CHECK_TIME_SECONDS"),
    EnvKnob("stall_check_shutdown_time_seconds", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),
    EnvKnob("log_level", "HOROVOD_LOG_LEVEL"),
)


def _in_force(settings: HorovodSettings) -> list[tuple[EnvKnob, Any]]:
    given = settings.given()
    return [(knob, given[knob.setting]) for knob in HOROVOD_KNOBS
            if knob.setting in given and (knob.only_with is None or given.get(knob.only_with))]


def horovod_env(settings: HorovodSettings) -> dict[str, str]:
    """Horovod's environment variables for the given settings, e.g. fusion_threshold_mb=32 ->
    ``{"HOROVOD_FUSION_THRESHOLD": "33554432"}``."""
    return {knob.env: knob.to_env(value) for knob, value in _in_force(settings)}


def horovodrun_flags(settings: HorovodSettings, *, skip_env: Mapping[str, str] = ()) -> list[str]:
    """The horovodrun options for the given settings; settings whose variable is in ``skip_env`` are left out
    (an applied config sets them instead), and so are values horovodrun's parser refuses (a fractional
    --fusion-threshold-mb: ``job_env`` sets its variable in bytes)."""
    argv: list[str] = []
    for knob, value in _in_force(settings):
        if knob.env in skip_env:
            continue
        if isinstance(value, bool):
            if value:
                argv.append(knob.flag)
            elif knob.setting.startswith("hierarchical_"):
                argv.append("--no-" + knob.flag[2:])
            continue
        text = knob.to_flag(value)
        if text is not None:
            argv += [knob.flag, text]
    return argv


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


def job_env(config: LaunchConfig, *, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables dpro-launch adds to (or changes in) ``base`` (default ``os.environ``) for the job's processes.

    The applied config's ``env`` knobs win over horovodrun settings given on the command line.
    ``config.run_dir`` should be set (claimed) when the job profiles.
    """
    base = os.environ if base is None else base
    env: dict[str, str] = {DPRO_LAUNCH: "1"}
    env.update(horovod_env(config.horovod))
    if config.engine in ("torch", "tf") and config.network_interfaces:
        env["GLOO_SOCKET_IFNAME"] = config.network_interfaces
        env["NCCL_SOCKET_IFNAME"] = config.network_interfaces
    env.update(applied_env(config))
    if "OMP_NUM_THREADS" not in base and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"
    if config.profile is not None:
        env[DPRO_AUTO_RECORD] = "1"
        env[DPRO_PROFILE] = str(config.profile)
        if config.engine == "horovod" and config.horovod_timeline and "HOROVOD_TIMELINE" not in env and \
                "HOROVOD_TIMELINE" not in base:
            env["HOROVOD_TIMELINE"] = "DYNAMIC"  # dpro's Horovod recorder starts it in the window's last block
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
