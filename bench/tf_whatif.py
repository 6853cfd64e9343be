"""What-if accuracy for Keras under MultiWorkerMirroredStrategy: predict other ``bytes_per_pack`` settings from one
recording, then run them for real.

An unmodified Keras script (bench/scripts/keras_train.py, or ``--script``) runs with 2 workers, one per host of an
emulated cluster (``dpro.testbed``: network namespaces, 1 Gbit/s links by default), recorded by dpro's auto-attach
(what ``dpro-launch --profile`` sets up). The first recording uses MWMS's default (one pack); dpro predicts each
target ``tf.mwms.bytes_per_pack``; each target is then run with a config that sets it (``DPRO_CONFIG``, as
``dpro-launch --apply`` does), recorded, and its measured step compared with the prediction. One job's step
differs from another's of the same setting by up to ~10% on these machines, so each setting (the default
included) runs ``--jobs`` times per round, interleaved (default, target 1, target 2, default, ...), and a target's
measured step is the median of its jobs; the "ratio" column compares the predicted ratio to the recorded default
with the measured ratio to the median default job, which leaves out how fast the one recorded job happened to
be. ``--rounds`` repeats the whole set (each round predicts from its own recording).

    python bench/tf_whatif.py [--network 1gbit] [--packs 16384,262144] [--rounds 2] [--jobs 3] [--width 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from dpro import testbed
from dpro.engines import load_prepared
from dpro.io.load import interrupted_calls
from dpro.launch.env import AUTOATTACH_DIR
from dpro.sim.whatif import context, predict

SCRIPT = Path(__file__).resolve().parent / "scripts" / "keras_train.py"
BYTES_PER_PACK = "tf.mwms.bytes_per_pack"


def worker_env(cluster: testbed.Cluster, index: int, run_dir: Path, window: str, ports: tuple[int, int],
               config: Path | None) -> dict[str, str]:
    """TF_CONFIG naming both hosts, dpro's auto-attach recording ``window`` into ``run_dir``, one thread."""
    workers = [f"{h.address}:{ports[0]}" for h in cluster.hosts]
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}),
           "DPRO_TF_PORT": str(ports[1]), "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join(p for p in (str(AUTOATTACH_DIR), os.environ.get("PYTHONPATH")) if p),
           "DPRO_AUTO_RECORD": "1", "DPRO_PROFILE": window, "DPRO_RUN_DIR": str(run_dir), "DPRO_CONFIG": ""}
    if config is not None:
        env["DPRO_CONFIG"] = str(config)
    return env


def record(cluster: testbed.Cluster, script: list[str], run_dir: Path, window: str, ports: tuple[int, int],
           config: Path | None = None, attempts: int = 5) -> Path:
    """Run the job recorded into ``run_dir``; the run directory. A job that TensorFlow's profiler killed while it
    stopped (``rank-<r>.busy.txt`` says so) is recorded again into a new directory, up to ``attempts`` times."""
    for attempt in range(attempts):
        target = run_dir if attempt == 0 else run_dir.with_name(f"{run_dir.name}-again{attempt}")
        results = testbed.run_ranks(
            cluster, lambda rank: [sys.executable, *script], timeout=600,
            env_for_rank=lambda rank, d=target: worker_env(cluster, rank, d, window, ports, config))
        failed = [(rank, res) for rank, res in enumerate(results) if res.returncode != 0]
        if not failed:
            return target
        if attempt + 1 == attempts or not interrupted_calls(target):
            rank, res = failed[0]
            raise RuntimeError(f"worker {rank} failed:\n{res.stderr[-3000:]}")
        print(f"  ({target.name}: a worker died in {next(iter(interrupted_calls(target).values()))}; "
              "recording again)", flush=True)
    raise AssertionError("unreachable")


def config_for(run_dir: Path, size: int, path: Path) -> Path:
    made = json.loads((run_dir / "run.json").read_text())
    fingerprint = {"framework": made["framework"], "engine": made["engine"], "world_size": made["world_size"],
                   "model": made["model_fingerprint"]}
    path.write_text(json.dumps({"schema": "dpro.config/1", "fingerprint": fingerprint,
                                "knobs": {BYTES_PER_PACK: size}}))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--network", default="1gbit", help="the links' rate (tc), e.g. 1gbit")
    parser.add_argument("--packs", default="16384,262144", help="target bytes_per_pack values")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=3, help="jobs per setting and round (median)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", default="10:30")
    parser.add_argument("--width", type=int, default=32, help="keras_train.py --width")
    parser.add_argument("--script", default=None, help="another Keras script (its own arguments after --)")
    args, extra = parser.parse_known_args()
    script = [args.script, *[a for a in extra if a != "--"]] if args.script else \
        [str(SCRIPT), "--steps", str(args.steps), "--width", str(args.width)]
    ok, why = testbed.testbed_available()
    if not ok:
        print(f"skipped: {why}")
        return 0
    targets = [int(p) for p in args.packs.split(",")]
    header = (f"{'round':>5} {'bytes_per_pack':>14} {'packs':>5} {'predicted ms':>12} {'measured ms (jobs)':>26} "
              f"{'error %':>8} {'ratio err %':>11}")
    print(header + "\n" + "-" * len(header), flush=True)
    errors: dict[int, list[float]] = {t: [] for t in targets}
    ratio_errors: dict[int, list[float]] = {t: [] for t in targets}
    with tempfile.TemporaryDirectory() as tmp, \
            testbed.emulated_cluster(2, testbed.NetworkSpec(rate=args.network)) as cluster:
        job = 0

        def run(rnd: int, label: str, config: Path | None) -> Any:
            nonlocal job
            job += 1
            ports = (23400 + 2 * (job % 500), 23401 + 2 * (job % 500))
            run_dir = record(cluster, script, Path(tmp) / f"r{rnd}-{label}-{job}", args.window, ports, config)
            return load_prepared(run_dir)

        for rnd in range(args.rounds):
            base = run(rnd, "base", None)
            ctx = context(base)
            replayed = predict(ctx, {}).predicted_step_ms
            predicted = {size: predict(ctx, {BYTES_PER_PACK: size}).predicted_step_ms for size in targets}
            configs = {size: config_for(base.path, size, Path(tmp) / f"r{rnd}-{size}.json") for size in targets}
            measured: dict[int, list[float]] = {0: []}
            packs: dict[int, int] = {0: 1}
            for _ in range(args.jobs):  # interleaved, so a slow spell of the machine hits every setting
                measured[0].append(context(run(rnd, "base", None)).base.measured_step_us / 1000.0)
                for size in targets:
                    got = run(rnd, str(size), configs[size])
                    assert got.meta["knobs"][BYTES_PER_PACK] == size, "the config was not applied"
                    measured.setdefault(size, []).append(context(got).base.measured_step_us / 1000.0)
                    packs[size] = len({e["name"] for e in got.ranks[0].events if e["name"].startswith("COMM.pack")})
            base_ms = statistics.median(measured[0])

            def jobs(values: list[float]) -> str:
                return f"{statistics.median(values):.2f} ({', '.join(f'{v:.1f}' for v in values)})"

            print(f"{rnd:>5} {'0 (recorded)':>14} {1:>5} {replayed:>12.2f} "
                  f"{ctx.base.measured_step_us / 1000.0:>26.2f} {'':>8} {'':>11}", flush=True)
            print(f"{rnd:>5} {'0':>14} {1:>5} {'':>12} {jobs(measured[0]):>26} {'':>8} {'':>11}", flush=True)
            for size in targets:
                m = statistics.median(measured[size])
                err = 100.0 * (predicted[size] - m) / m
                ratio = 100.0 * ((predicted[size] / replayed) / (m / base_ms) - 1.0)
                errors[size].append(err)
                ratio_errors[size].append(ratio)
                print(f"{rnd:>5} {size:>14} {packs[size]:>5} {predicted[size]:>12.2f} {jobs(measured[size]):>26} "
                      f"{err:>+8.2f} {ratio:>+11.2f}", flush=True)
    every = [abs(e) for errs in errors.values() for e in errs]
    ratios = [abs(e) for errs in ratio_errors.values() for e in errs]
    if every:
        print(f"\n|error| median {statistics.median(every):.2f} %, worst {max(every):.2f} %; ratio |error| median "
              f"{statistics.median(ratios):.2f} %, worst {max(ratios):.2f} % over {len(every)} predictions "
              f"({args.network}, {args.rounds} rounds x {args.jobs} jobs per setting)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
