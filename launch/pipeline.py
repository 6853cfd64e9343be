"""What ``dpro-launch`` does around the engine: claim the run directory, run, collect, optimize, re-run.

- ``run(config)`` is the whole command: one job, then ``--optimize`` or the ``--auto`` loop.
- ``run_job(config)`` claims the run directory, starts the engine, writes ``RUN/launch.json`` and says
  where the recording is.
- ``collect_remote(config, run_dir)`` copies the run files of the other hosts here (tar over ssh).
- ``optimize_run(run_dir, ...)`` is ``dpro optimize``: context -> optimize -> ``RUN/analysis/config.json``.
- ``measured_step_ms(run_dir)`` is dpro's measured step (median STEP of the slowest rank).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import IO, Any

from dpro.config import CONFIG_FILE, Config, read_config
from dpro.errors import DproError, UsageError
from dpro.io.load import interrupted_calls
from dpro.launch.env import applied_env, flag_env
from dpro.launch.launchers import LAUNCHERS
from dpro.launch.process import ssh_options
from dpro.launch.settings import LaunchConfig
from dpro.logs import get_logger
from dpro.progress import Progress
from dpro.record.protocol import Window, claim_run_dir
from dpro.record.trace import RUN_FILE, analysis_file, write_json_atomic

__all__ = ["collect_remote", "find_recorded_run", "measured_step_ms", "optimize_run", "run", "run_job"]

LAUNCH_FILE = "launch.json"
ELSEWHERE_FILE = "recorded-elsewhere.json"  # written by dpro.plugins.torch.autoattach
APPLIED_SUFFIX = "-applied"
NOT_KEPT_FILE = "config.not-kept.json"  # an --auto config that did not measure faster: --apply auto passes it by


logger = get_logger("dpro.launch")
_say = logger.info  # what the launcher tells its user


def find_recorded_run(run_dir: Path) -> Path | None:
    """Where the job's recording is: ``run_dir`` itself, a run the script made inside it (its own
    ``Profiler(run_dir=None)`` under ``$DPRO_RUN_DIR``), or one named by ``recorded-elsewhere.json``."""
    if (run_dir / RUN_FILE).is_file() or any(run_dir.glob("rank-*.json*")):
        return run_dir
    nested = sorted((p.parent for p in run_dir.glob(f"*/{RUN_FILE}")), key=lambda p: p.stat().st_mtime)
    if nested:
        return nested[-1]
    note = run_dir / ELSEWHERE_FILE
    if note.is_file():
        runs = [Path(p) for p in json.loads(note.read_text(encoding="utf-8")).get("runs", [])]
        runs = [p for p in runs if (p / RUN_FILE).is_file()]
        if runs:
            return runs[-1]
    return None


def collect_remote(config: LaunchConfig, run_dir: Path) -> None:
    """Copy the files each remote host wrote into its own ``run_dir`` here: ``ssh HOST tar -C RUN -cf - .``.

    The archive is read as a stream and unpacked with tarfile's ``data`` filter (no absolute paths, no links
    leading out, no devices); no shell glob is involved. A file already here is kept (a host that shares this
    filesystem wrote it here already). A host that cannot be copied from is reported and skipped.
    """
    for host, _ in config.placement():
        if host.local:
            continue
        with tempfile.TemporaryDirectory(prefix="dpro-collect-") as tmp:
            problem = fetch_remote_dir(config, host.name, run_dir, Path(tmp))
            if problem:
                _say(f"could not copy the run files of host {host.name}: {problem}")
                continue
            for item in Path(tmp).iterdir():
                target = run_dir / item.name
                if not target.exists():
                    shutil.move(str(item), str(target))


def fetch_remote_dir(config: LaunchConfig, host: str, remote_dir: Path, into: Path) -> str | None:
    """Unpack ``remote_dir`` of ``host`` into ``into`` (a tar stream over ssh); None, or what went wrong."""
    port = ["-p", str(config.ssh_port)] if config.ssh_port else []
    remote = shlex.join(["tar", "-C", str(remote_dir), "-cf", "-", "."])
    argv = ["ssh", *port, *ssh_options(config), "--", host, remote]
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
        problem = None
        try:
            unpack_tar_stream(proc.stdout, into)
        except (tarfile.TarError, OSError) as err:
            problem = f"the archive it sent is not readable ({err})"
        finally:
            proc.stdout.close()
            status = proc.wait()
        errors.seek(0)
        said = " ".join(errors.read().decode("utf-8", "replace").split())[-400:]
    if status != 0:
        return said or f"ssh exited with status {status}"
    return problem


def unpack_tar_stream(stream: IO[bytes], into: Path) -> None:
    """Unpack a tar stream into ``into`` with tarfile's ``data`` filter: leading slashes are dropped, members
    that lead out of ``into`` (``..``, links pointing out) and devices raise ``tarfile.TarError``."""
    with tarfile.open(fileobj=stream, mode="r|") as archive:
        archive.extractall(into, filter="data")


def measured_step_ms(run_dir: Path) -> float:
    """dpro's measured step time of a run: the median STEP of the slowest rank, in ms."""
    from dpro.dag.align import align
    from dpro.dag.step_model import step_model
    from dpro.engines import load_prepared

    run = load_prepared(run_dir)
    return step_model(run, align(run)).measured_step_us / 1000.0


def optimize_run(run_dir: Path, *, memory_budget_bytes: int | None = None, allow_compression: bool = False,
                 out: Path | None = None) -> tuple[Config, float]:
    """``dpro optimize RUN``: search, confirm by replay, write ``RUN/analysis/config.json`` (or ``out``).

    Returns:
        The config as written, and the replayed step time of the run as recorded (ms), which the
        config's predicted step time is to be compared with.
    """
    from dpro.engines import load_prepared
    from dpro.optimize import config_document, optimize, write_config_files
    from dpro.sim.whatif import context

    ctx = context(load_prepared(run_dir))
    result = optimize(ctx, memory_budget_bytes=memory_budget_bytes, allow_compression=allow_compression,
                      progress=Progress(None, "optimize"))
    path = out or analysis_file(run_dir, CONFIG_FILE)
    write_config_files(path, config_document(result, ctx))  # and the engine's launcher files beside it
    config = read_config(path)
    _print_optimize(result, path)
    return config, result.baseline.predicted_step_ms


def _print_optimize(result: Any, path: Path) -> None:
    base, pred = result.baseline.predicted_step_ms, result.predicted.predicted_step_ms
    print(f"measured step      {result.measured_step_ms:9.2f} ms")
    print(f"replayed baseline  {base:9.2f} ms")
    print(f"predicted          {pred:9.2f} ms  ({100 * (pred / base - 1) if base else 0.0:+.1f}%)")
    for item in result.explain:
        gain = item.get("predicted_gain_ms")
        print(f"  {item['knob']:<26} {'' if gain is None else f'{gain:+8.2f} ms'}  {item['why']}")
    shown = {k: v for k, v in result.knobs.items() if k != "tensor_groups"}
    print(f"knobs: {json.dumps(shown)}" + (" (+ tensor_groups)" if "tensor_groups" in result.knobs else ""))
    print(f"config written to {path}", flush=True)


def _claim(config: LaunchConfig) -> LaunchConfig:
    if config.profile is None:
        return config
    try:
        run_dir = claim_run_dir(config.run_dir)
    except UsageError as err:
        raise UsageError(f"--run-dir: {err}") from None
    return dataclasses.replace(config, run_dir=run_dir.resolve())


def _note_overrides(config: LaunchConfig) -> None:
    flags = flag_env(config)
    for name, value in applied_env(config).items():
        if name in flags and flags[name] != value:
            _say(f"{config.apply} sets {name}={value}; it overrides the command line's {flags[name]}")


def run_job(config: LaunchConfig) -> tuple[int, LaunchConfig, Path | None]:
    """One job: claim the run directory, launch, collect remote files, find the recording.

    Returns:
        (exit status, the config as launched (run_dir claimed), the recorded run directory or None).
    """
    config = _claim(config)
    _note_overrides(config)
    launcher = LAUNCHERS[config.engine]()
    if config.run_dir is not None:
        _say(f"{config.engine} engine, {config.np} processes on "
             f"{', '.join(f'{h.name}:{n}' for h, n in config.placement())}; recording steps "
             f"{_window_text(config.profile)} into {config.run_dir}")
    status = launcher.launch(config)
    if config.run_dir is None:
        return status, config, None
    if any(not h.local for h, _ in config.placement()):
        collect_remote(config, config.run_dir)
    _write_launch_file(config, status)
    for rank, what in interrupted_calls(config.run_dir).items():
        _say(f"rank {rank} died while {what}")
    recorded = find_recorded_run(config.run_dir)
    if recorded is None:
        what = launcher.why_nothing_recorded(config)
        _say(f"nothing was recorded in {config.run_dir}: {what} (--profile {config.profile})")
    elif recorded != config.run_dir:
        _say(f"the script recorded itself into {recorded}")
    return status, config, recorded


def _window_text(window: Window) -> str:
    """``10..19``, or ``10..14, 20..24, 30..34 (...)`` for a window in blocks."""
    if not window.block:
        return f"{window.start}..{window.stop - 1}"
    starts = range(window.start, window.stop, 2 * window.block)
    blocks = ", ".join(f"{s}..{min(s + window.block, window.stop) - 1}" for s in starts)
    return f"{blocks} (the gaps between them: the recording overhead's baseline)"


def _write_launch_file(config: LaunchConfig, status: int) -> None:
    doc = {
        "command": config.command, "engine": config.engine, "np": config.np,
        "hosts": [{"name": h.name, "processes": n} for h, n in config.placement()],
        "profile": str(config.profile) if config.profile else None,
        "apply": str(config.apply) if config.apply is not None else None,
    }
    for options in config.options.values():  # each launcher's own entries (what its flags gave)
        doc.update(options.record())
    doc.update({"exit_status": status, "cwd": str(config.cwd)})
    try:
        write_json_atomic(config.run_dir / LAUNCH_FILE, doc)
    except OSError as err:
        _say(f"could not write {config.run_dir / LAUNCH_FILE}: {err}")


def run(config: LaunchConfig) -> int:
    """The whole ``dpro-launch`` command for ``config``; returns the exit status."""
    stages = None
    if config.optimize:  # profile -> optimize (-> re-run -> compare): one line per stage
        stages = Progress(4 if config.auto else 2, "dpro-launch", lines=True)
        stages.advance(0, note="stage 1: the profiled run")
    status, launched, recorded = run_job(config)
    if status != 0 or not config.optimize:
        return status
    if recorded is None:
        _say("--optimize: there is no recorded run to optimize")
        return 1
    stages.advance(note="stage 2: optimize")
    try:
        tuned, replayed_ms = optimize_run(recorded, memory_budget_bytes=config.memory_budget_bytes,
                             allow_compression=config.allow_compression)
    except DproError as err:
        _say(f"--optimize failed: {err}")
        return 1
    if not config.auto:
        stages.advance()
        stages.close()
        return 0
    return _auto_rerun(launched, recorded, tuned, replayed_ms, stages)


def _auto_rerun(first: LaunchConfig, recorded: Path, tuned: Config, replayed_ms: float, stages: Progress) -> int:
    """``--auto``: run again with the config, profiled into RUN-applied, and compare (also as
    ``RUN-applied/analysis/compare.html``)."""
    again = dataclasses.replace(first, run_dir=Path(f"{first.run_dir}{APPLIED_SUFFIX}"), apply=tuned.path,
                                auto=False, optimize=False)
    stages.advance(note="stage 3: the re-run with the config")
    _say(f"--auto: re-running with {tuned.path}")
    status, _, recorded_after = run_job(again)
    if status != 0:
        return status
    if recorded_after is None:
        _say("--auto: the re-run recorded nothing; no comparison")
        return 1
    stages.advance(note="stage 4: compare")
    print(format_comparison(recorded, recorded_after, tuned, replayed_ms), flush=True)
    _write_compare_page(recorded, recorded_after)
    _keep_the_faster(recorded, recorded_after, tuned)
    stages.advance()
    stages.close()
    return 0


def _changes(config: Config, in_force: dict[str, Any]) -> dict[str, Any]:
    """The knobs ``config`` sets to something other than what the recorded run had in force (an engine's ``env``
    knobs one by one: a Horovod config always names its fusion threshold and cycle time)."""
    def same(a: Any, b: Any) -> bool:
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return str(a) == str(b)

    out = {k: v for k, v in config.knobs.items() if k != "env"}
    env = config.knobs.get("env") or {}
    out.update({k: v for k, v in env.items() if k not in in_force or not same(v, in_force[k])})
    return out


def _keep_the_faster(before: Path, after: Path, tuned: Config) -> dict[str, Any]:
    """``--auto``'s verdict: the config stays where ``--apply auto`` finds it only if the re-run measured faster than
    the original beyond the two runs' step-to-step spread; otherwise it is set aside as ``config.not-kept.json``
    (``--apply FILE`` still takes it) and the original settings are what the user is left with. The verdict goes
    to ``AFTER/analysis/auto.json``."""
    from dpro.engines import load_prepared
    from dpro.io.load import run_step_times_ms
    from dpro.report.compare import measured_change

    if not _changes(tuned, load_prepared(before).meta.get("knobs") or {}):
        _say("--auto: the config changes nothing; the original settings stay")
        doc = {"kept": "original", "why": "the config changes nothing", "config": str(tuned.path), "change": None}
        write_json_atomic(analysis_file(after, "auto.json"), doc)
        return doc
    try:
        change = measured_change(run_step_times_ms(load_prepared(before)), run_step_times_ms(load_prepared(after)))
    except DproError as err:
        change, why = None, f"the runs could not be compared: {err}"
    else:
        why = f"with the config the job measured {change.describe()}"
    kept = "config" if change is not None and change.verdict == "faster" else "original"
    doc: dict[str, Any] = {"kept": kept, "why": why, "config": str(tuned.path),
                           "change": dataclasses.asdict(change) if change is not None else None}
    if kept == "config":
        _say(f"--auto: kept the config: {why}")
    else:
        aside = tuned.path.with_name(NOT_KEPT_FILE)
        os.replace(tuned.path, aside)
        doc["config"] = str(aside)
        told = ("slower" if change is not None and change.verdict == "slower" else
                "not faster beyond the runs' spread")
        _say(f"--auto: kept the original settings, the config measured {told}: {why}; the config is set aside "
             f"as {aside} (dpro-launch --apply FILE still applies it)")
    write_json_atomic(analysis_file(after, "auto.json"), doc)
    return doc


def _write_compare_page(before: Path, after: Path) -> None:
    """``dpro compare BEFORE AFTER -o AFTER/analysis/compare.html``; a comparison that cannot be made is said."""
    from dpro.record.trace import write_text_atomic
    from dpro.report.compare import compare_runs, render_comparison

    try:
        page = analysis_file(after, "compare.html")
        write_text_atomic(page, render_comparison(compare_runs(before, after)))
    except (DproError, OSError) as err:
        _say(f"--auto: no comparison page: {err}")
        return
    _say(f"--auto: before and after compared in {page}")


def format_comparison(before: Path, after: Path, config: Config, replayed_ms: float) -> str:
    """The ``--auto`` table: measured step before and after, the replay's prediction, and the knobs applied.

    The predicted change is relative to the replay of the run as recorded (``replayed_ms``); the
    measured change relative to the measured step before.
    """
    from dpro.report.tables import format_table

    before_ms, after_ms = measured_step_ms(before), measured_step_ms(after)
    predicted = config.predicted.step_ms if config.predicted is not None else None

    def change(ms: float | None, base: float) -> str:
        return "" if ms is None or not base else f"{100 * (ms / base - 1):+.1f}%"

    rows = [["before (measured)", f"{before_ms:.2f}", "", str(before)],
            ["before (replayed)", f"{replayed_ms:.2f}", "", ""],
            ["predicted with the config", "" if predicted is None else f"{predicted:.2f}",
             change(predicted, replayed_ms), str(config.path)],
            ["after (measured)", f"{after_ms:.2f}", change(after_ms, before_ms), str(after)]]
    table = format_table(["", "step ms", "change", "run"], rows, align="<>><")
    knobs = {k: v for k, v in config.knobs.items() if k != "tensor_groups"}
    if "tensor_groups" in config.knobs:
        knobs["tensor_groups"] = f"{len(config.knobs['tensor_groups'])} groups"
    applied = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "none (the run was already the best found)"
    gain = "" if predicted is None else f"predicted gain {replayed_ms - predicted:+.2f} ms; "
    return f"\n{table}\n\n{gain}measured gain {before_ms - after_ms:+.2f} ms\nknobs applied: {applied}"
