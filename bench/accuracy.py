"""Replay accuracy: measured vs predicted step time of real recorded runs, side by side.

For each bundled model x DDP bucket size x network, a 2-rank gloo DDP job is recorded for real,
then ``dpro analyze`` predicts its step time. Lightning (automatic and manual optimization, gradient
accumulation), Horovod, Keras (MultiWorkerMirroredStrategy) and MXNet (Gluon on the kvstore parameter server, 2
servers) jobs, unmodified scripts (bench/scripts/,
tests/jobs/plain_hvd.py) recorded by ``dpro-launch --profile 10:30``, are recorded ``--repeat`` times each on
loopback (cases alternate), each recording a row, and every case is summarised by its median and worst
|error|. Networks: loopback (both ranks on this machine) and the emulated cluster network of ``dpro.testbed``
(one rank per network namespace, 1 Gbit/s links with 0.1 ms delay where the kernel has netem; skipped with the
reason where namespaces are refused).
The PyTorch profiler traces in tests/data/kineto (real A100 / V100 runs) are reported in the same
table when present.

    python bench/accuracy.py [--models mlp,transformer,wide_mlp] [--buckets 1,25] [--networks loopback,1gbit]
                             [--frameworks ddp,lightning,horovod,keras,mxnet,torch] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_doc import printed_lines, write_bench_doc

from dpro import testbed
from dpro.analyze import analyze_path
from dpro.analyze.traces import analyze_kineto
from dpro.io.kineto import run_trace_files
from dpro.io.load import interrupted_calls

KINETO_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "kineto"
JOBS = Path(__file__).resolve().parents[1] / "tests" / "jobs"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# label -> (script, its arguments): unmodified scripts (no dpro import), each recorded by dpro-launch
LIGHTNING_CASES = {
    "lightning auto mlp": (SCRIPTS / "lit_train.py", ["--model", "mlp"]),
    "lightning auto conv": (SCRIPTS / "lit_train.py", ["--model", "conv"]),
    "lightning manual mlp": (SCRIPTS / "lit_train.py", ["--model", "mlp", "--optimization", "manual"]),
    "lightning accumulate 2": (SCRIPTS / "lit_train.py", ["--model", "conv", "--accumulate", "2"]),
}
KERAS_CASES = {
    "keras cnn (keras_train)": (SCRIPTS / "keras_train.py", []),
    "keras cnn wide": (SCRIPTS / "keras_train.py", ["--width", "32"]),
    "keras cnn, TF's threads": (SCRIPTS / "keras_train.py", ["--threads", "0"]),
}
MXNET_CASES = {  # dist_sync on ps-lite, 2 workers and 2 servers; run by .venv-mxnet's interpreter
    "mxnet-ps mlp (gluon_train)": (SCRIPTS / "gluon_train.py", ["--model", "mlp"]),
    "mxnet-ps cnn (gluon_train)": (SCRIPTS / "gluon_train.py", ["--model", "cnn"]),
    "mxnet-ps resnet18 hybridized": (SCRIPTS / "gluon_train.py", ["--model", "resnet18", "--batch", "16",
                                                                  "--hybridize"]),
}
MXNET_PYTHON = Path(__file__).resolve().parents[1] / ".venv-mxnet" / "bin" / "python"
TORCH_CASES = {  # plain PyTorch scripts dpro-launch records unmodified: FSDP2 (by the profiler), compiled DDP
    "fsdp2 encoder (fsdp_train)": (SCRIPTS / "fsdp_train.py", []),
    "compiled ddp, a block": (JOBS / "compiled_ddp.py", ["--compile", "block"]),
    "compiled ddp, whole": (JOBS / "compiled_ddp.py", ["--compile", "ddp"]),
}
HOROVOD_CASES = {
    "horovod mlp (plain_hvd)": (JOBS / "plain_hvd.py", ["--width", "512"]),
    "horovod gru (hvd_train)": (SCRIPTS / "hvd_train.py", []),
    "hvd.keras cnn (hvd_keras_train)": (SCRIPTS / "hvd_keras_train.py", []),
}


def record_with_launcher(script: Path, script_args: list[str], run_dir: Path, steps: int, window: str,
                         kind: str, attempts: int = 3) -> Path:
    """``dpro-launch -np 2 -H localhost:2 [--gloo | --engine tf] --profile A:B --run-dir RUN python SCRIPT ...``;
    the run directory. A job that TensorFlow's profiler killed while it stopped (``rank-<r>.busy.txt`` says so;
    about 1 recorded 2-worker job in 8) is recorded again, into a new directory, up to ``attempts`` times."""
    for attempt in range(attempts):
        target = run_dir if attempt == 0 else run_dir.with_name(f"{run_dir.name}-again{attempt}")
        try:
            _launch(script, script_args, target, steps, window, kind)
            return target
        except RuntimeError:
            if attempt + 1 == attempts or not interrupted_calls(target):
                raise
            print(f"  ({target.name}: a worker died in {next(iter(interrupted_calls(target).values()))}; "
                  "recording again)", flush=True)
    raise AssertionError("unreachable")


def _launch(script: Path, script_args: list[str], run_dir: Path, steps: int, window: str, kind: str) -> None:
    launcher = Path(sys.executable).with_name("dpro-launch")
    engine = {"horovod": ["--gloo"], "keras": ["--engine", "tf"],
              "mxnet": ["--engine", "mxnet", "--num-servers", "2"]}.get(kind, [])
    python = str(MXNET_PYTHON) if kind == "mxnet" else sys.executable
    cmd = [str(launcher), "-np", "2", "-H", "localhost:2", *engine, "--profile", window,
           "--run-dir", str(run_dir), python, str(script), "--steps", str(steps), *script_args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=run_dir.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def example_argv(model: str, bucket_mb: float, run_dir: Path, steps: int, window: str) -> list[str]:
    return ["-m", "dpro.plugins.torch.example", "--model", model, "--steps", str(steps), "--profile", window,
            "--bucket-cap-mb", str(bucket_mb), "--run-dir", str(run_dir)]


def record_loopback(model: str, bucket_mb: float, run_dir: Path, steps: int, window: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           *example_argv(model, bucket_mb, run_dir, steps, window)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def record_emulated(cluster: testbed.Cluster, model: str, bucket_mb: float, run_dir: Path, steps: int,
                    window: str, port: int) -> None:
    argv = [sys.executable, *example_argv(model, bucket_mb, run_dir, steps, window)]
    results = testbed.run_ranks(cluster, lambda rank: argv, ranks_per_host=1, timeout=900,
                                env_for_rank=lambda rank: testbed.torch_rank_env(cluster, rank, 2, 1, port))
    for rank, res in enumerate(results):
        if res.returncode != 0:
            raise RuntimeError(f"rank {rank} of {model} failed on the emulated network:\n{res.stderr[-3000:]}")


def kineto_rows() -> list[tuple[str, str, str, float, float, float]]:
    rows = []
    for path in sorted(KINETO_DIR.glob("*.json.gz")):
        a = analyze_kineto([path])
        rows.append(("kineto (GPU)", path.name, "-", a.measured_step_ms, a.predicted_step_ms, a.error_pct))
    return rows


def measure(args: argparse.Namespace) -> None:
    """Record and analyze every case of ``args``, printing the tables."""
    frameworks = args.frameworks.split(",")
    models, buckets = args.models.split(","), [float(b) for b in args.buckets.split(",")]
    rows: list[tuple[str, str, str, float, float, float]] = []
    print(f"{'network':<14} {'model':<24} {'bucket MB':>9} {'measured ms':>12} {'predicted ms':>13} {'error %':>8}",
          flush=True)

    def show(row: tuple[str, str, str, float, float, float]) -> None:
        rows.append(row)
        net, model, bucket, measured, predicted, err = row
        print(f"{net:<14} {model:<24} {bucket:>9} {measured:>12.2f} {predicted:>13.2f} {err:>+8.2f}", flush=True)

    by_case: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):  # cases alternate, so a slow spell of the machine hits them alike
            cases = [(c, "lightning") for c in LIGHTNING_CASES if "lightning" in frameworks]
            cases += [(c, "horovod") for c in HOROVOD_CASES if "horovod" in frameworks]
            cases += [(c, "keras") for c in KERAS_CASES if "keras" in frameworks]
            cases += [(c, "mxnet") for c in MXNET_CASES if "mxnet" in frameworks and MXNET_PYTHON.exists()]
            cases += [(c, "torch") for c in TORCH_CASES if "torch" in frameworks]
            for case, kind in cases:
                run_dir = Path(tmp) / f"{kind}-{len(by_case.get(case, []))}-{abs(hash(case))}"
                script, script_args = {"lightning": LIGHTNING_CASES, "horovod": HOROVOD_CASES,
                                       "keras": KERAS_CASES, "mxnet": MXNET_CASES, "torch": TORCH_CASES}[kind][case]
                run_dir = record_with_launcher(script, script_args, run_dir, args.lightning_steps,
                                               args.lightning_profile, kind)
                traces = run_trace_files(run_dir)  # a run recorded by the profiler (FSDP)
                a = analyze_kineto(traces) if traces else analyze_path(run_dir)
                by_case.setdefault(case, []).append(a.error_pct)
                show(("loopback", case, "-", a.measured_step_ms, a.predicted_step_ms, a.error_pct))
        for network in (args.networks.split(",") if "ddp" in frameworks else []):
            runs = []
            if network == "loopback":
                for model in models:
                    for bucket in buckets:
                        run_dir = Path(tmp) / f"lo-{model}-{bucket}"
                        record_loopback(model, bucket, run_dir, args.steps, args.profile)
                        runs.append((model, bucket, run_dir))
                        a = analyze_path(run_dir)
                        show((network, model, f"{bucket:g}", a.measured_step_ms, a.predicted_step_ms, a.error_pct))
                continue
            ok, why = testbed.testbed_available()
            if not ok:
                print(f"{network:<14} skipped: {why}", flush=True)
                continue
            has_delay, _ = testbed.netem_available()
            spec = testbed.NetworkSpec(rate=network, delay="0.1ms" if has_delay else "0ms")
            if not has_delay:
                print(f"{network:<14} (this kernel has no netem qdisc: rate limit only, no added delay)", flush=True)
            with testbed.emulated_cluster(2, spec) as cluster:
                for i, model in enumerate(models):
                    for j, bucket in enumerate(buckets):
                        run_dir = Path(tmp) / f"{network}-{model}-{bucket}"
                        record_emulated(cluster, model, bucket, run_dir, args.steps, args.profile,
                                        29600 + 10 * i + j)
                        a = analyze_path(run_dir)
                        show((network, model, f"{bucket:g}", a.measured_step_ms, a.predicted_step_ms, a.error_pct))
    errors = [abs(r[5]) for r in rows]
    for row in kineto_rows():
        show(row)
    if by_case:
        print(f"\n{'case':<24} {'recordings':>10} {'median |error| %':>17} {'worst |error| %':>16}")
        for case, errs in by_case.items():
            mags = [abs(e) for e in errs]
            print(f"{case:<24} {len(errs):>10} {statistics.median(mags):>17.2f} {max(mags):>16.2f}")
    if errors:
        print(f"\n|error| over the recorded runs: median {statistics.median(errors):.2f} %, max {max(errors):.2f} % "
              f"({len(errors)} runs). Kineto rows are left out of it: their same-config replay keeps every measured "
              f"duration and gap, so it checks the DAG's wiring rather than a prediction.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,transformer,wide_mlp")
    parser.add_argument("--buckets", default="1,25", help="DDP bucket_cap_mb values")
    parser.add_argument("--networks", default="loopback,1gbit", help="loopback and/or tc rates such as 1gbit")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--profile", default="8:20")
    parser.add_argument("--frameworks", default="ddp,lightning,horovod,keras,mxnet,torch")
    parser.add_argument("--repeat", type=int, default=3, help="recordings of each Lightning and Horovod case")
    parser.add_argument("--doc", default=None, help="also write the table to this markdown file")
    parser.add_argument("--lightning-steps", type=int, default=40, help="steps of each Lightning / Horovod job")
    parser.add_argument("--lightning-profile", default="10:30", help="the window dpro-launch records (A:B)")
    args = parser.parse_args()
    with printed_lines() as lines:
        measure(args)
    if args.doc:
        write_bench_doc(args.doc, "Replay accuracy: measured against predicted step, same configuration", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
