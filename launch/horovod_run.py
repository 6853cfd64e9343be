"""The ``horovod`` launcher: the job goes to the real ``horovodrun`` with the same flags and dpro's environment."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from dpro.errors import UsageError
from dpro.launch.env import applied_env, horovodrun_flags, job_env
from dpro.launch.node import DEFAULT_GRACE_S
from dpro.launch.process import (
    Agent,
    Signals,
    Supervisor,
    _say,
    check_host_keys,
)
from dpro.launch.settings import LaunchConfig

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


class HorovodLauncher:
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
        supervisor = Supervisor(DEFAULT_GRACE_S)
        with Signals(supervisor):
            supervisor.add(Agent("horovodrun", proc, remote=False))
            return supervisor.wait()
