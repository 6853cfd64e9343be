"""The ``horovod`` launcher: the job goes to the real ``horovodrun`` with the same flags and dpro's environment.

Everything Horovod-specific of ``dpro-launch`` is here: horovodrun's tunable flags (``HorovodSettings``), its YAML
``--config-file``, ``HOROVOD_KNOBS`` (the one table from those settings to Horovod's environment variables and back
to horovodrun's flags: the names and conversions of horovod 0.28.1's ``runner/common/util/config_parser.py``), the
controller (``--gloo``/``--mpi``), ``--horovod-timeline`` and ``--engine auto``'s test for a Horovod script. Horovod's
knobs reach every job as environment variables, whichever launcher runs it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpro.errors import UsageError
from dpro.io.limits import is_finite_number
from dpro.launch.env import applied_env, job_env
from dpro.launch.launcher import Launcher, LauncherOptions
from dpro.launch.node import DEFAULT_GRACE_S
from dpro.launch.process import (
    Agent,
    Signals,
    Supervisor,
    _say,
    check_host_keys,
)
from dpro.launch.torch_run import TORCH_NOTHING, TORCH_SEEN, TORCH_SEEN_NONE
from dpro.record.protocol import Window

if TYPE_CHECKING:
    from dpro.launch.settings import LaunchConfig

__all__ = ["HOROVOD_KNOBS", "LOG_LEVELS", "EnvKnob", "HorovodLauncher", "HorovodOptions", "HorovodSettings",
           "find_horovodrun", "horovod_env", "horovodrun_flags", "options_of", "read_horovod_config_file",
           "settings_of"]

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")  # horovod's config_parser.LOG_LEVELS
HOROVOD_WINDOW = Window(10, 40, 5)  # 10..14, 20..24, 30..34 recorded; the gaps between them measure the overhead
CONTROLLERS = ("gloo", "mpi")
TIMELINE_ENV = "HOROVOD_TIMELINE"
_HOROVOD_MARKS = ("import horovod", "from horovod", "horovod.torch")


# ---- horovodrun's tunable settings -------------------------------------------------------------------------


@dataclass
class HorovodSettings:
    """horovodrun's tunable parameters (``--fusion-threshold-mb`` ...); None means "not given".

    ``HOROVOD_KNOBS`` maps each field to its environment variable and its horovodrun flag.
    """

    fusion_threshold_mb: float | None = None
    cycle_time_ms: float | None = None
    cache_capacity: int | None = None
    hierarchical_allreduce: bool | None = None
    hierarchical_allgather: bool | None = None
    autotune: bool | None = None
    autotune_log_file: str | None = None
    autotune_warmup_samples: int | None = None
    autotune_steps_per_sample: int | None = None
    autotune_bayes_opt_max_samples: int | None = None
    autotune_gaussian_process_noise: float | None = None
    timeline_filename: str | None = None
    timeline_mark_cycles: bool | None = None
    no_stall_check: bool | None = None
    stall_check_warning_time_seconds: int | None = None
    stall_check_shutdown_time_seconds: int | None = None
    log_level: str | None = None

    def __post_init__(self) -> None:
        for name in ("fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "autotune_warmup_samples",
                     "autotune_steps_per_sample", "autotune_bayes_opt_max_samples",
                     "stall_check_warning_time_seconds", "stall_check_shutdown_time_seconds"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UsageError(f"--{name.replace('_', '-')} {value}: must be >= 0")
        noise = self.autotune_gaussian_process_noise
        if noise is not None and not 0 <= noise <= 1:
            raise UsageError(f"--autotune-gaussian-process-noise {noise}: must be in [0, 1], e.g. 0.8")
        if self.log_level is not None:
            level = str(self.log_level).upper()
            if level not in LOG_LEVELS:
                raise UsageError(f"--log-level {self.log_level!r}: expected one of {', '.join(LOG_LEVELS)}")
            self.log_level = level

    def given(self) -> dict[str, Any]:
        """The settings that were given (not None), by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


# horovodrun --config-file sections -> HorovodSettings fields (horovod/runner/common/util/config_parser.py)
_CONFIG_FILE_KEYS = {
    ("params", "fusion_threshold_mb"): "fusion_threshold_mb",
    ("params", "cycle_time_ms"): "cycle_time_ms",
    ("params", "cache_capacity"): "cache_capacity",
    ("params", "hierarchical_allreduce"): "hierarchical_allreduce",
    ("params", "hierarchical_allgather"): "hierarchical_allgather",
    ("autotune", "enabled"): "autotune",
    ("autotune", "log_file"): "autotune_log_file",
    ("autotune", "warmup_samples"): "autotune_warmup_samples",
    ("autotune", "steps_per_sample"): "autotune_steps_per_sample",
    ("autotune", "bayes_opt_max_samples"): "autotune_bayes_opt_max_samples",
    ("autotune", "gaussian_process_noise"): "autotune_gaussian_process_noise",
    ("timeline", "filename"): "timeline_filename",
    ("timeline", "mark_cycles"): "timeline_mark_cycles",
    ("stall_check", "warning_time_seconds"): "stall_check_warning_time_seconds",
    ("stall_check", "shutdown_time_seconds"): "stall_check_shutdown_time_seconds",
    ("logging", "level"): "log_level",
}


MAX_CONFIG_FILE_BYTES = 1_000_000  # PyYAML reads about a MB a second; horovodrun's own files are a few lines
_SETTING_CHECKS: dict[str, tuple[str, Any]] = {
    "float": ("a finite number", is_finite_number),
    "int": ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**63),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("text", lambda v: isinstance(v, str)),
}


def _typed_setting(path: Path, key: str, name: str, value: Any) -> Any:
    """A config-file value of the kind its ``HorovodSettings`` field holds, else a UsageError naming the key."""
    kind = str(next(f.type for f in fields(HorovodSettings) if f.name == name)).split("|")[0].strip()
    what, ok = _SETTING_CHECKS[kind]
    if not ok(value):
        raise UsageError(f"--config-file {path}: {key} must be {what}, found {value!r:.60}")
    return value


def read_horovod_config_file(path: str | Path) -> tuple[dict[str, Any], str | None]:
    """Read horovodrun's YAML ``--config-file``: (settings by ``HorovodSettings`` field, controller or None).

    Raises:
        UsageError: the file is missing, not YAML, or PyYAML is not installed.
    """
    path = Path(path)
    try:
        import yaml
    except ImportError:
        raise UsageError(f"--config-file {path}: reading it needs PyYAML: pip install pyyaml") from None
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as err:
        raise UsageError(f"--config-file {path}: cannot be read ({err.strerror or err})") from err
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise UsageError(f"--config-file {path}: larger than {MAX_CONFIG_FILE_BYTES // 1_000_000} MB; a horovodrun "
                         "config file is a few lines of YAML")
    try:
        doc = yaml.safe_load(raw.decode("utf-8")) or {}
    except UnicodeDecodeError as err:
        raise UsageError(f"--config-file {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.YAMLError as err:
        raise UsageError(f"--config-file {path}: not valid YAML: {err}") from err
    except RecursionError:
        raise UsageError(f"--config-file {path}: YAML nested deeper than the parser goes") from None
    if not isinstance(doc, dict):
        raise UsageError(f"--config-file {path}: expected a YAML mapping with params, autotune, timeline, ... sections")
    settings: dict[str, Any] = {}
    for (section, key), name in _CONFIG_FILE_KEYS.items():
        part = doc.get(section)
        if isinstance(part, dict) and part.get(key) is not None:
            settings[name] = _typed_setting(path, f"{section}.{key}", name, part[key])
    stall = doc.get("stall_check")
    if isinstance(stall, dict) and "enabled" in stall:
        settings["no_stall_check"] = not _typed_setting(path, "stall_check.enabled", "no_stall_check",
                                                        stall["enabled"])
    controller = doc.get("controller")
    if controller is not None and str(controller).lower() not in ("gloo", "mpi"):
        raise UsageError(f"--config-file {path}: controller {controller!r} is not gloo or mpi")
    return settings, (str(controller).lower() if controller is not None else None)


# ---- the settings -> environment table ---------------------------------------------------------------


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


# ---- the launcher's options and flags ------------------------------------------------------------------------


@dataclass
class HorovodOptions(LauncherOptions):
    """What the horovod launcher's flags hold: horovodrun's tunable settings, the controller (``--gloo``/``--mpi``),
    its ``--config-file``, ``--disable-cache`` and dpro's ``--horovod-timeline``."""

    settings: HorovodSettings = field(default_factory=HorovodSettings)
    controller: str | None = None
    config_file: str | None = None
    disable_cache: bool = False
    timeline: bool = False

    def check(self, config: LaunchConfig, engine: type[Launcher]) -> None:
        if self.controller not in (None, *CONTROLLERS):
            raise UsageError(f"controller {self.controller!r}: expected gloo or mpi")
        if engine is HorovodLauncher or self.controller is None:
            return
        if not engine.collectives:
            raise UsageError(f"--{self.controller} selects Horovod's controller; the {engine.name} engine "
                             f"{engine.what}. Drop it")
        if self.controller == "mpi":
            raise UsageError(f"--mpi selects Horovod's MPI controller; the {engine.name} engine {engine.what}. "
                             "Use --engine horovod, or drop --mpi")

    def flag_env(self) -> dict[str, str]:
        return horovod_env(self.settings)

    def recording_env(self, config: LaunchConfig, env: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
        if self.timeline and TIMELINE_ENV not in env and TIMELINE_ENV not in base:
            return {TIMELINE_ENV: "DYNAMIC"}  # dpro's Horovod recorder starts it in the window's last block
        return {}

    def record(self) -> dict[str, object]:
        return {"horovod": self.settings.given()}


def options_of(config: LaunchConfig) -> HorovodOptions:
    """The horovod launcher's options of ``config``."""
    return config.options_of(HorovodOptions)


def settings_of(config: LaunchConfig) -> HorovodSettings:
    """horovodrun's tunable settings of ``config``."""
    return options_of(config).settings


def _upper(text: str) -> str:
    return text.upper()


def _add_arguments(parser: argparse.ArgumentParser, procs: argparse._ArgumentGroup) -> None:
    """horovodrun's own flags: the controller, --disable-cache, --config-file, the tunable parameters, autotune,
    timeline, stall check and logging."""
    controller = procs.add_mutually_exclusive_group()
    controller.add_argument("--gloo", dest="controller", action="store_const", const="gloo",
                            help="Horovod's Gloo controller")
    controller.add_argument("--mpi", dest="controller", action="store_const", const="mpi",
                            help="Horovod's MPI controller (--engine horovod)")
    procs.add_argument("--disable-cache", action="store_true", help="passed to horovodrun")
    procs.add_argument("--config-file", metavar="FILE", help="horovodrun's YAML settings; the command line wins")

    params = parser.add_argument_group("tunable parameters (horovodrun; environment variables for Horovod)")
    params.add_argument("--fusion-threshold-mb", type=float, metavar="MB", help="HOROVOD_FUSION_THRESHOLD")
    params.add_argument("--cycle-time-ms", type=float, metavar="MS", help="HOROVOD_CYCLE_TIME")
    params.add_argument("--cache-capacity", type=int, metavar="N", help="HOROVOD_CACHE_CAPACITY")
    for name in ("allreduce", "allgather"):
        group = params.add_mutually_exclusive_group()
        group.add_argument(f"--hierarchical-{name}", dest=f"hierarchical_{name}", action="store_const", const=True,
                           help=f"HOROVOD_HIERARCHICAL_{name.upper()}=1")
        group.add_argument(f"--no-hierarchical-{name}", dest=f"hierarchical_{name}", action="store_const",
                           const=False, help=f"HOROVOD_HIERARCHICAL_{name.upper()}=0")
    tune = parser.add_argument_group("autotune (horovodrun)")
    tune.add_argument("--autotune", action="store_const", const=True, help="HOROVOD_AUTOTUNE=1")
    tune.add_argument("--autotune-log-file", metavar="FILE", help="HOROVOD_AUTOTUNE_LOG")
    tune.add_argument("--autotune-warmup-samples", type=int, metavar="N", help="HOROVOD_AUTOTUNE_WARMUP_SAMPLES")
    tune.add_argument("--autotune-steps-per-sample", type=int, metavar="N", help="HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE")
    tune.add_argument("--autotune-bayes-opt-max-samples", type=int, metavar="N",
                      help="HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES")
    tune.add_argument("--autotune-gaussian-process-noise", type=float, metavar="X",
                      help="HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE, in [0, 1]")
    timeline = parser.add_argument_group("timeline, stall check, logging (horovodrun)")
    timeline.add_argument("--timeline-filename", metavar="FILE", help="HOROVOD_TIMELINE")
    timeline.add_argument("--timeline-mark-cycles", action="store_const", const=True,
                          help="HOROVOD_TIMELINE_MARK_CYCLES=1")
    timeline.add_argument("--no-stall-check", action="store_const", const=True, help="HOROVOD_STALL_CHECK_DISABLE=1")
    timeline.add_argument("--stall-check-warning-time-seconds", type=int, metavar="S",
                          help="HOROVOD_STALL_CHECK_TIME_SECONDS")
    timeline.add_argument("--stall-check-shutdown-time-seconds", type=int, metavar="S",
                          help="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    timeline.add_argument("--log-level", type=_upper, choices=LOG_LEVELS, help="HOROVOD_LOG_LEVEL")


_SETTINGS = tuple(HorovodSettings.__dataclass_fields__)


def _options_from_args(args: argparse.Namespace) -> HorovodOptions:
    """The options of the parsed flags over those of ``--config-file`` (the command line wins)."""
    settings, controller = ({}, None)
    if args.config_file:
        settings, controller = read_horovod_config_file(args.config_file)
    for name in _SETTINGS:
        value = getattr(args, name, None)
        if value is not None:
            settings[name] = value
    try:
        given = HorovodSettings(**settings)
    except TypeError as err:
        raise UsageError(f"--config-file {args.config_file}: {err}") from None
    return HorovodOptions(settings=given, controller=args.controller or controller, config_file=args.config_file,
                          disable_cache=args.disable_cache, timeline=args.horovod_timeline)


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


class HorovodLauncher(Launcher):
    """Horovod jobs: the real ``horovodrun`` with horovodrun's flags and dpro's environment."""

    name = "horovod"
    options_type = HorovodOptions
    default_window = HOROVOD_WINDOW
    start_timeout_env = "HOROVOD_START_TIMEOUT"  # horovodrun's; --start-timeout wins
    nothing_recorded = TORCH_NOTHING
    seen_counts, seen_none = TORCH_SEEN, TORCH_SEEN_NONE

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, procs: argparse._ArgumentGroup) -> None:
        _add_arguments(parser, procs)

    @staticmethod
    def add_dpro_arguments(dpro: argparse._ArgumentGroup) -> None:
        dpro.add_argument("--horovod-timeline", action="store_true",
                          help="Horovod: also run Horovod's timeline in the window's last block (the fused buffers "
                               "that price the fusion knobs; it slows the job from then on)")

    @classmethod
    def options_from_args(cls, args: argparse.Namespace) -> HorovodOptions:
        return _options_from_args(args)

    @staticmethod
    def detects(script_text: str) -> bool:
        """A script that contains ``import horovod``, ``from horovod`` or ``horovod.torch``."""
        return any(mark in script_text for mark in _HOROVOD_MARKS)

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
        options = options_of(config)
        if options.controller:
            argv.append(f"--{options.controller}")
        argv += ["--start-timeout", str(int(config.start_timeout))]
        if config.network_interfaces:
            argv += ["--network-interfaces", config.network_interfaces]
        if config.output_filename:
            argv += ["--output-filename", config.output_filename]
        if config.verbose:
            argv.append("--verbose")
        if options.disable_cache:
            argv.append("--disable-cache")
        argv += horovodrun_flags(options.settings, skip_env=applied_env(config))  # the config's env wins
        return [argv + config.command]

    def launch(self, config: LaunchConfig) -> int:
        (argv,) = self.command(config)
        check_host_keys(config)
        if config.verbose:
            _say(shlex.join(argv))
        proc = subprocess.Popen(argv, env={**os.environ, **job_env(config)}, start_new_session=True, cwd=config.cwd)
        supervisor = Supervisor(DEFAULT_GRACE_S)
        with Signals(supervisor):
            supervisor.add(Agent("horovodrun", proc, remote=False))
            return supervisor.wait()
