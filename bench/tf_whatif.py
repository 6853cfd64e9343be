"""What-if accuracy for Keras under MultiWorkerMirroredStrategy: predict other ``bytes_per_pack`` settings from one
recording, then run them for real.

An unmodified Keras script (bench/scripts/keras_train.py, or ``--script``) runs with 2 workers, one per host of an
emulated cluster (``dpro.testbed``: network namespaces, 1 Gbit/s links by default), recorded by dpro's auto-attach
(what ``dpro-launch --profile`` sets up). The first recording uses MWMS's default (one pack); dpro predicts each
target ``tf.mwms.bytes_per_pack``; each target is then run with a config that sets it (``DPRO_CONFIG``, as
``dpro-launch --apply`` does), recorded, and its measured step compared with the prediction. ``--rounds`` repeats
the whole set (the base is recorded again each round and each round predicts from its own base), so the spread
between rounds shows.

    python bench/tf_whatif.py [--network 1gbit] [--packs 16384,262144] [--rounds 2] [--width 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from dpro import testbed
from dpro.io.load import interrupted_calls, load_run
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
           config: Path | None = None, attempts: int = 3) -> Path:
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
    header = f"{'round':>5} {'bytes_per_pack':>14} {'packs':>5} {'predicted ms':>12} {'measured ms':>11} {'error %':>8}"
    print(header + "\n" + "-" * len(header), flush=True)
    errors: dict[int, list[float]] = {t: [] for t in targets}
    predicted_ms: dict[int, list[float]] = {t: [] for t in targets}
    measured_ms: dict[int, list[float]] = {t: [] for t in targets}
    with tempfile.TemporaryDirectory() as tmp, \
            testbed.emulated_cluster(2, testbed.NetworkSpec(rate=args.network)) as cluster:
        for rnd in range(args.rounds):
            ports = (23400 + rnd * 10, 23401 + rnd * 10)
            base = record(cluster, script, Path(tmp) / f"r{rnd}-base", args.window, ports)
            ctx = context(load_run(base))
            measured_base = ctx.base.measured_step_us / 1000.0
            print(f"{rnd:>5} {'0 (recorded)':>14} {1:>5} {predict(ctx, {}).predicted_step_ms:>12.2f} "
                  f"{measured_base:>11.2f} {'':>8}", flush=True)
            for i, size in enumerate(targets):
                predicted = predict(ctx, {BYTES_PER_PACK: size})
                config = config_for(base, size, Path(tmp) / f"r{rnd}-{size}.json")
                run = record(cluster, script, Path(tmp) / f"r{rnd}-{size}", args.window,
                             (23402 + rnd * 10 + 2 * i, 23403 + rnd * 10 + 2 * i), config)
                got = load_run(run)
                assert got.meta["knobs"][BYTES_PER_PACK] == size, "the config was not applied"
                measured = context(got).base.measured_step_us / 1000.0
                packs = len({e["name"] for e in got.ranks[0].events if e["name"].startswith("COMM.pack")})
                err = 100.0 * (predicted.predicted_step_ms - measured) / measured
                errors[size].append(err)
                predicted_ms[size].append(predicted.predicted_step_ms)
                measured_ms[size].append(measured)
                print(f"{rnd:>5} {size:>14} {packs:>5} {predicted.predicted_step_ms:>12.2f} {measured:>11.2f} "
                      f"{err:>+8.2f}", flush=True)
    every = [abs(e) for errs in errors.values() for e in errs]
    if every:
        print(f"\nper round: |error| median {statistics.median(every):.2f} %, worst {max(every):.2f} % over "
              f"{len(every)} predictions ({args.network}, {args.rounds} rounds)")
        # one job's step time swings by several % between jobs on these machines: the medians over the rounds (the
        # configurations alternate) tell the prediction from a slow spell of one job
        print(f"\n{'bytes_per_pack':>14} {'median predicted ms':>19} {'median measured ms':>18} {'error %':>8}")
        for size in targets:
            p, m = statistics.median(predicted_ms[size]), statistics.median(measured_ms[size])
            print(f"{size:>14} {p:>19.2f} {m:>18.2f} {100.0 * (p - m) / m:>+8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
