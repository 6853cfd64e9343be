"""What-ifs against real runs on unmodified scripts dpro was not tuned on, and whether the change dpro recommends
is really faster.

For each case (an unmodified training script, the knob its engine exposes, a few values of it) and each network
(loopback, or the emulated cluster of ``dpro.testbed``: two hosts in network namespaces joined by a tbf-limited
link, one rank per host):

1. record the script at its own setting, the way ``dpro-launch --profile`` does (auto-attach, ``DPRO_*``
   environment), and build the what-if context from it;
2. predict each value of the knob (``dpro whatif``) and ask ``dpro optimize`` for its recommendation;
3. run the script at its own setting, at each value and (when dpro recommends a change) with the recommended
   config, ``--rounds`` times, the settings alternated round by round (a different one first each round); each
   job records the same window with the setting applied (``dpro-launch --apply``), and its step is the recorded
   step (median over steps and ranks): what the prediction is a prediction of.

The table gives each prediction against the median of its jobs (and their range), the error, the error of the
predicted change (the prediction's ratio to the script as written, against the measured ratio: without the level
of the recording, which drifts job to job), the same against the change paired round by round (the median of each
round's ratio of the setting's job to the script's own: a neighbour's load that drifts from round to round
cancels), and for the
recommendation its measured gain over the script's own setting, and whether it was faster beyond the jobs'
spread (``dpro-launch --auto`` keeps a config only when its re-run measured faster beyond the steps' spread). Every
measured job is a recording as well: in the cross-check (``bench/whatif_crosscheck.py``, which also compares variants
of the model on kept jobs) each of them predicts the change to every other setting, against the change the jobs
measured, so the model is judged on many recordings, not only the one it was fitted on.
The last lines give the median and worst |error| per engine.

    python bench/whatif_matrix.py [--cases trainer,trainer-unused,accelerate,hvd-fusion,hvd-cycle,gluon-servers,
                                   trainer-micro,accelerate-micro,trainer-amp,trainer-compile,
                                   accelerate-compile]
        [--networks loopback,300mbit] [--rounds 3]
        [--doc docs/benchmarks/whatif_matrix.md]

The micro-batch, amp and compile cases price from the recorder's probe passes (``dpro.sim.probes``); in the
Accelerate case the script splits its batch itself (``--micro-batches``), since a plain loop cannot be split from
outside.
The Trainer and Accelerate scripts need ``pip install transformers accelerate`` in the torch venv (a case whose
script cannot import its framework is skipped with the reason); the Horovod cases need ``make horovod``, the MXNet
case ``make mxnet``, and both run on loopback only. Needs root for the emulated networks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench_doc import write_bench_doc
from whatif_crosscheck import cross_errors, paired_ratios

from dpro import testbed
from dpro.engines import load_prepared
from dpro.launch.env import job_env
from dpro.launch.settings import LaunchConfig
from dpro.optimize import config_document, optimize
from dpro.record.protocol import parse_window
from dpro.sim.whatif import context, predict

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "bench" / "scripts"
MXNET_PYTHON = ROOT / ".venv-mxnet" / "bin" / "python"


@dataclass(frozen=True)
class Case:
    """An unmodified script and the knob whose what-ifs are checked."""

    engine: str
    script: Path
    args: tuple[str, ...]
    imports: str             # the module the script needs (a case without it is skipped)
    knob: str
    values: tuple[float | bool | str, ...]
    own: float | bool | str | None  # the knob's value when the script runs as written
    launcher: str = "torch"  # torch (torchrun's way), horovod (horovodrun --gloo) or mxnet (ps-lite, 2 servers)
    env: str | None = None   # the environment variable a config sets the knob through (else the knob itself)
    whole: bool = False      # the knob takes whole numbers (micro-batches)
    # a setting runs the script with this option and the value instead of a config: a plain loop dpro cannot split
    # into micro-batches from outside (held out: the script changes its own code path, the prediction does not)
    script_option: str | None = None

    def label(self, value: float | bool | str | None) -> str:
        if value is None:
            return "as written"
        if isinstance(value, bool):
            return f"{self.knob.rsplit('.', 1)[-1]}={str(value).lower()}"
        if isinstance(value, str):
            return f"{self.knob}={value}"
        return f"{self.knob.rsplit('.', 1)[-1]}={int(value) if float(value).is_integer() else f'{value:g}'}"

    def knob_value(self, value: float | bool | str) -> float | int | bool | str | list[str]:
        """``value`` as the knob takes it (what-if and config)."""
        if self.knob == "compile":
            return str(value).split(",")  # module paths
        if isinstance(value, (str, bool)):
            return value
        return int(value) if (self.env or self.whole) and float(value).is_integer() else value

    def config_knobs(self, value: float | int | bool | str | list[str]) -> dict:
        """The config's knobs that run the script at ``value`` (none where the script's own option does)."""
        if self.script_option is not None:
            return {}
        if self.knob == "compile":
            return {self.knob: value if isinstance(value, list) else str(value).split(",")}  # module paths
        if self.env is None or isinstance(value, str):
            return {self.knob: value}
        value = float(value)
        return {"env": {self.env: str(int(value)) if value.is_integer() else f"{value:g}"}}

    def script_args(self, value: float | int | str) -> tuple[str, ...]:
        return () if self.script_option is None else (self.script_option, str(value))

    @property
    def python(self) -> Path:
        """MXNet runs in its own venv (numpy < 1.24); every other case in this one."""
        return MXNET_PYTHON if self.launcher == "mxnet" else Path(sys.executable)


CASES = {
    "trainer": Case("torch-ddp", SCRIPTS / "hf_trainer.py", ("--hidden", "128", "--layers", "2"), "transformers",
                    "torch.ddp.bucket_cap_mb", (1.0, 5.0, 100.0), 25.0),
    "trainer-unused": Case("torch-ddp", SCRIPTS / "hf_trainer.py", ("--hidden", "128", "--layers", "2"),
                           "transformers", "torch.ddp.find_unused_parameters", (False,), True),
    "accelerate": Case("torch-ddp", SCRIPTS / "accelerate_train.py", ("--width", "512", "--depth", "4"),
                       "accelerate", "torch.ddp.bucket_cap_mb", (1.0, 5.0, 100.0), 25.0),
    "lightning": Case("torch-ddp", SCRIPTS / "lit_train.py", (), "lightning", "torch.ddp.bucket_cap_mb",
                      (1.0, 5.0, 100.0), 25.0),
    # the knobs the recorder's probe passes price: micro-batches applied by dpro (the Trainer's own accumulation,
    # set by the auto-attach), in a plain Accelerate loop by the script's own option (held out), and bf16 autocast
    # applied by dpro around the model's forward
    "trainer-micro": Case("torch-ddp", SCRIPTS / "hf_trainer.py", ("--hidden", "128", "--layers", "2"),
                          "transformers", "micro_batches", (2.0, 4.0), 1.0, whole=True),
    "accelerate-micro": Case("torch-ddp", SCRIPTS / "accelerate_train.py", ("--width", "512", "--depth", "4"),
                             "accelerate", "micro_batches", (2.0, 4.0), 1.0, whole=True,
                             script_option="--micro-batches"),
    "trainer-amp": Case("torch-ddp", SCRIPTS / "hf_trainer.py", ("--hidden", "128", "--layers", "2"), "transformers",
                        "amp", ("bf16",), None),
    # the whole model under torch.compile, priced by the recorder's compile probe and applied by dpro in place
    "trainer-compile": Case("torch-ddp", SCRIPTS / "hf_trainer.py", ("--hidden", "128", "--layers", "2"),
                            "transformers", "compile", ("<root>",), None),
    "accelerate-compile": Case("torch-ddp", SCRIPTS / "accelerate_train.py", ("--width", "512", "--depth", "4"),
                               "accelerate", "compile", ("<root>",), None),
    "hvd-fusion": Case("horovod", SCRIPTS / "hvd_synthetic.py", (), "horovod.torch", "HOROVOD_FUSION_THRESHOLD",
                       (0.0, 2.0**20), 2.0**27, launcher="horovod", env="HOROVOD_FUSION_THRESHOLD"),
    "hvd-cycle": Case("horovod", SCRIPTS / "hvd_synthetic.py", (), "horovod.torch", "HOROVOD_CYCLE_TIME",
                      (5.0, 20.0), 1.0, launcher="horovod", env="HOROVOD_CYCLE_TIME"),
    "gluon-servers": Case("mxnet-ps", SCRIPTS / "gluon_train.py", ("--model", "resnet18", "--batch", "16",
                                                                  "--hybridize"),
                          "mxnet", "num_servers", (1.0,), 2.0, launcher="mxnet", env="DMLC_NUM_SERVER"),
}


def missing_module(name: str, python: Path) -> str | None:
    if not python.exists():
        return f"{python} is missing (make mxnet)"
    probe = subprocess.run([str(python), "-c", f"import {name}"], capture_output=True, text=True)
    return None if probe.returncode == 0 else probe.stderr.strip().splitlines()[-1]


ATTEMPTS = 3  # torch 2.13's gloo aborts a rank at exit now and then ("terminate called without an active
#               exception"), with or without dpro: such a job is run again, into a new directory


def run_job(case: Case, cluster: testbed.Cluster | None, run_dir: Path, steps: int, window: str,
            config: Path | None, port: int, extra: tuple[str, ...] = ()) -> float:
    """One recorded job of ``case`` (with ``config`` applied, ``extra`` script arguments); its recorded step (ms)."""
    for attempt in range(ATTEMPTS):
        target = run_dir if attempt == 0 else run_dir.with_name(f"{run_dir.name}-again{attempt}")
        try:
            return _run_once(case, cluster, target, steps, window, config, port, extra)
        except RuntimeError as err:
            if attempt + 1 == ATTEMPTS:
                raise
            print(f"  ({target.name} failed, run again: {str(err).strip().splitlines()[-1]})", file=sys.stderr)
    raise AssertionError("unreachable")


def _run_once(case: Case, cluster: testbed.Cluster | None, run_dir: Path, steps: int, window: str,
              config: Path | None, port: int, extra: tuple[str, ...]) -> float:
    argv = [str(case.python), str(case.script), *case.args, "--steps", str(steps), *extra]
    launch = LaunchConfig(command=argv, np=2, profile=parse_window(window), run_dir=run_dir, apply=config)
    env = job_env(launch, base={})
    env["PATH"] = f"{case.python.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if cluster is None:
        engine = {"torch": [], "horovod": ["-H", "localhost:2", "--gloo"],
                  "mxnet": ["--engine", "mxnet", "-H", "localhost:2", "--num-servers", "2"]}[case.launcher]
        cmd = [str(case.python), "-m", "dpro.launch", "-np", "2", *engine, "--profile", window, "--run-dir",
               str(run_dir), *(["--apply", str(config)] if config else []), *argv]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PATH": env["PATH"]},
                              capture_output=True, text=True, timeout=900, cwd=run_dir.parent)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    else:
        results = testbed.run_ranks(cluster, lambda rank: argv, ranks_per_host=1, timeout=900, cwd=run_dir.parent,
                                    env_for_rank=lambda rank: {**env, **testbed.torch_rank_env(cluster, rank, 2, 1,
                                                                                               port)})
        for rank, res in enumerate(results):
            if res.returncode != 0:
                raise RuntimeError(f"rank {rank} of {case.script.name} failed:\n{res.stderr[-3000:]}")
    return context(load_prepared(run_dir)).base.measured_step_us / 1000.0


def write_config(base: dict, knobs: dict, path: Path) -> Path:
    """``base`` (the config ``dpro optimize`` wrote for the recording: its fingerprint) with ``knobs``."""
    path.write_text(json.dumps({**base, "knobs": knobs, "explain": []}), encoding="utf-8")
    return path


def spread(values: list[float]) -> str:
    return f"{min(values):.1f}..{max(values):.1f}"


def check_case(name: str, network: str, cluster: testbed.Cluster | None, work: Path, args: argparse.Namespace,
               port: int, say: Callable[[str], None], errors: dict[str, list[float]],
               relative_errors: dict[str, list[float]], crossed: dict[str, list[float]]) -> None:
    """Record case ``name``, predict its knob's values and dpro's recommendation, run them all; say the rows."""
    case = CASES[name]
    if args.values and case.knob == "torch.ddp.bucket_cap_mb":
        case = dataclasses.replace(case, values=tuple(float(v) for v in args.values.split(",")))
    work.mkdir()

    def job(tag: str, config: Path | None, extra: tuple[str, ...] = ()) -> float:
        return run_job(case, cluster, work / tag, args.steps, args.profile, config, port, extra)

    job("recorded", None)
    run = load_prepared(work / "recorded")
    ctx = context(run)
    say(f"  {network} {name}: {ctx.interference.describe()}")
    result = optimize(ctx)
    base = config_document(result, ctx)
    settings: dict[str, tuple[dict, float]] = {case.label(None): ({}, result.baseline.predicted_step_ms)}
    for value in case.values:
        knobs = {case.knob: case.knob_value(value)}
        settings[case.label(value)] = (knobs, predict(ctx, knobs).predicted_step_ms)
    # a config that restates the setting in force (Horovod's search writes its env either way) is no change
    recommended = dict(result.knobs) if result.predicted.predicted_step_ms < result.baseline.predicted_step_ms else {}
    if recommended:
        settings["dpro's config"] = (recommended, result.predicted.predicted_step_ms)
    applied = {label: (case.config_knobs(knobs[case.knob]) if set(knobs) == {case.knob} else knobs)
               for label, (knobs, _) in settings.items()}
    extras = {label: (case.script_args(knobs[case.knob]) if set(knobs) == {case.knob} else ())
              for label, (knobs, _) in settings.items()}
    configs = {label: (write_config(base, applied[label], work / f"config-{i}.json") if applied[label] else None)
               for i, label in enumerate(settings)}
    measured: dict[str, list[float]] = {label: [] for label in settings}
    labels = list(settings)
    for r in range(args.rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            measured[label].append(job(f"r{r}-{labels.index(label)}", configs[label], extras[label]))
    predicted0, measured0 = settings[case.label(None)][1], statistics.median(measured[case.label(None)])
    # each round's jobs, named as run: r<round>-<setting>
    paired = paired_ratios(work, {f"r{r}-{i}": ms for i, label in enumerate(labels)
                                  for r, ms in enumerate(measured[label])})
    for label, (_, predicted) in settings.items():
        got = statistics.median(measured[label])
        err = 100.0 * (predicted - got) / got
        # the change the model predicts against the change measured: leaves out the recorded job's own level
        relative = 100.0 * ((predicted / predicted0) / (got / measured0) - 1.0)
        # against each round's own pair (a round runs every setting back to back): a neighbour's load that drifts
        # from round to round cancels in the ratio, which medians over all jobs leave in
        relative_paired = 100.0 * ((predicted / predicted0) / paired.get((0, labels.index(label)), 1.0) - 1.0)
        if label != case.label(None):
            errors.setdefault(case.engine, []).append(abs(err))
            relative_errors.setdefault(case.engine, []).append(abs(relative))
        say(f"{network:<9} {name:<11} {label:<22} {predicted:>12.1f} {got:>12.1f} "
            f"{spread(measured[label]):<13} {err:>+8.1f} {relative:>+11.1f} {relative_paired:>+10.1f}")
    cross = cross_errors(work)
    if cross:
        crossed.setdefault(case.engine, []).extend(cross)
        say(f"  cross-check: each measured job, recorded at its setting, predicts the others: |change error| median "
            f"{statistics.median(cross):.1f} %, worst {max(cross):.1f} % over {len(cross)} what-ifs")
    own = measured[case.label(None)]
    if not recommended:
        say(f"  dpro recommends no change (the script as written is kept): "
            f"{'; '.join(e['why'] for e in base.get('explain', [])[:1])}")
        return
    mine = measured["dpro's config"]
    gain = 100.0 * (1.0 - statistics.median(mine) / statistics.median(own))
    verdict = ("faster beyond the jobs' spread" if max(mine) < min(own) else
               "slower beyond the jobs' spread" if min(mine) > max(own) else "within the jobs' spread")
    say(f"  recommended {recommended}: measured {gain:+.1f}% against as written ({spread(mine)} against "
        f"{spread(own)} ms): {verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="trainer,accelerate")
    parser.add_argument("--networks", default="loopback,300mbit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--profile", default="10:25")
    parser.add_argument("--values", default=None, help="the DDP cases' bucket caps to predict and run, e.g. "
                                                        "1,100 (default: each case's own)")
    parser.add_argument("--doc", default=None, help="also write the table to this markdown file")
    parser.add_argument("--keep", default=None, help="keep every job's run directory under this new directory "
                                                      "(to model the recordings again later)")
    args = parser.parse_args()
    if args.keep:
        Path(args.keep).mkdir(parents=True)
    header = (f"{'network':<9} {'case':<11} {'setting':<22} {'predicted ms':>12} {'measured ms':>12} "
              f"{'jobs ms':<13} {'error %':>8} {'change err %':>11} {'paired %':>10}")
    lines = [f"2 ranks; each job records steps {args.profile} of {args.steps}; measured = median of "
             f"{args.rounds} jobs, settings alternated", header, "-" * len(header)]
    print("\n".join(lines), flush=True)
    errors: dict[str, list[float]] = {}
    relative_errors: dict[str, list[float]] = {}
    crossed: dict[str, list[float]] = {}

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    port = 29800
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="dpro-matrix-"))
        for network in args.networks.split(","):
            if network != "loopback":
                ok, why = testbed.testbed_available()
                if not ok:
                    say(f"{network}: skipped: {why}")
                    continue
            for name in args.cases.split(","):
                case = CASES[name]
                why = missing_module(case.imports, case.python)
                if not why and network != "loopback" and case.launcher != "torch":
                    why = "run on loopback only (the emulated cluster runs torch jobs)"
                if why:
                    say(f"{network:<9} {name:<11} skipped: {why}")
                    continue
                cluster_cm = testbed.emulated_cluster(2, testbed.NetworkSpec(rate=network)) \
                    if network != "loopback" else None
                cluster = cluster_cm.__enter__() if cluster_cm is not None else None
                try:
                    port += 10
                    check_case(name, network, cluster, Path(tmp) / f"{network}-{name}", args, port, say, errors,
                               relative_errors, crossed)
                finally:
                    if cluster_cm is not None:
                        cluster_cm.__exit__(None, None, None)
    for engine, errs in errors.items():
        changes = relative_errors[engine]
        say(f"{engine}: |error| median {statistics.median(errs):.1f} %, worst {max(errs):.1f} % over {len(errs)} "
            f"what-ifs; of the change (against the script as written, measured and predicted): median "
            f"{statistics.median(changes):.1f} %, worst {max(changes):.1f} %")
    for engine, errs in crossed.items():
        say(f"{engine} cross-check (every measured job predicting the other settings): |change error| median "
            f"{statistics.median(errs):.1f} %, worst {max(errs):.1f} % over {len(errs)} what-ifs")
    if args.doc:
        write_bench_doc(args.doc, "What-ifs on unseen scripts against real runs", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
