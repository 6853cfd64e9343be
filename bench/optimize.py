"""Optimize end to end: default configuration vs the config dpro writes, both run for real.

For each bundled model and network (loopback; the emulated 1 Gbit/s network of ``dpro.testbed``):
record the default job (25 MB DDP buckets), run ``dpro optimize`` on it, then run the job with the
config applied (``--config``). The two are run alternately (default, applied, default, applied) so
both see the same machine; the table gives the median measured step time of each, the measured and
the predicted gain, the knobs, and peak memory (process peak RSS on the CPU, allocator peak on CUDA).

    python bench/optimize.py [--models wide_mlp,transformer,mlp] [--networks loopback,1gbit] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import example_argv  # noqa: E402

from dpro import testbed  # noqa: E402
from dpro.config import Config, write_config  # noqa: E402
from dpro.engines import load_prepared  # noqa: E402
from dpro.optimize import config_document, optimize  # noqa: E402
from dpro.sim.whatif import context  # noqa: E402


def run_job(network: str, cluster: testbed.Cluster | None, argv: list[str], port: int) -> None:
    import os
    import subprocess

    if cluster is None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *argv]
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        return
    results = testbed.run_ranks(cluster, lambda rank: [sys.executable, *argv], ranks_per_host=1, timeout=900,
                                env_for_rank=lambda rank: testbed.torch_rank_env(cluster, rank, 2, 1, port))
    for rank, res in enumerate(results):
        if res.returncode != 0:
            raise RuntimeError(f"rank {rank} failed on {network}:\n{res.stderr[-3000:]}")


def record(network: str, model: str, run_dir: Path, config: Path | None, steps: int, window: str, port: int) -> None:
    """One 2-rank run of the example job (with ``config`` applied when given)."""
    argv = example_argv(model, 25.0, run_dir, steps, window) + (["--config", str(config)] if config else [])
    if network == "loopback":
        run_job(network, None, argv, port)
        return
    with testbed.emulated_cluster(2, testbed.NetworkSpec(rate=network)) as cluster:
        run_job(network, cluster, argv, port)


def measured(run_dir: Path) -> tuple[float, int]:
    run = load_prepared(run_dir)
    steps = [e["dur"] for t in run.ranks.values() for e in t.events if e["cat"] == "STEP"]
    peaks = [e["args"].get("peak_memory_bytes", 0) for t in run.ranks.values() for e in t.events if e["cat"] == "STEP"]
    return statistics.median(steps) / 1000.0, max(peaks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="wide_mlp,transformer,mlp")
    parser.add_argument("--networks", default="loopback,1gbit")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of default and applied runs")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--profile", default="8:20")
    args = parser.parse_args()
    head = (f"{'network':<9} {'model':<12} {'default ms':>10} {'applied ms':>10} {'measured gain':>13} "
            f"{'predicted gain':>14} {'peak MiB def/app':>17}  knobs")
    print(head + "\n" + "-" * len(head), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for network in args.networks.split(","):
            if network != "loopback" and not testbed.testbed_available()[0]:
                print(f"{network}: skipped: {testbed.testbed_available()[1]}")
                continue
            for m, model in enumerate(args.models.split(",")):
                port = 29800 + 10 * m

                def job(run_dir: Path, config: Path | None = None, network: str = network, model: str = model,
                        port: int = port) -> None:
                    record(network, model, run_dir, config, args.steps, args.profile, port)

                first = Path(tmp) / f"{network}-{model}-default-0"
                job(first)
                ctx = context(load_prepared(first))
                result = optimize(ctx)
                config_path = Path(tmp) / f"{network}-{model}-config.json"
                write_config(config_path, Config.from_json(config_document(result, ctx)))
                default_runs, applied_runs = [first], []
                for r in range(args.rounds):
                    applied = Path(tmp) / f"{network}-{model}-applied-{r}"
                    job(applied, config_path)
                    applied_runs.append(applied)
                    if r + 1 < args.rounds:
                        again = Path(tmp) / f"{network}-{model}-default-{r + 1}"
                        job(again)
                        default_runs.append(again)
                d = [measured(p) for p in default_runs]
                a = [measured(p) for p in applied_runs]
                d_ms, a_ms = statistics.median(x[0] for x in d), statistics.median(x[0] for x in a)
                predicted_gain = 100 * (1 - result.predicted.predicted_step_ms / result.baseline.predicted_step_ms)
                knobs = {k: v for k, v in result.knobs.items() if k != "tensor_groups"} or "(default kept)"
                peaks = f"{max(x[1] for x in d) / 2**20:.0f}/{max(x[1] for x in a) / 2**20:.0f}"
                print(f"{network:<9} {model:<12} {d_ms:>10.2f} {a_ms:>10.2f} {100 * (1 - a_ms / d_ms):>+12.1f}% "
                      f"{predicted_gain:>+13.1f}% {peaks:>17}  {knobs}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
