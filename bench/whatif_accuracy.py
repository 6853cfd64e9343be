"""Cross-config accuracy of what-if: predict other configurations from one recording, then run them.

For each bundled model and network: record a 2-rank gloo DDP run at the base bucket size (25 MB),
predict bucket sizes 1, 5 and 100 MB with ``dpro whatif``, then record those configurations for
real and compare. On the emulated network, a 1 Gbit/s recording also predicts the 10 Gbit/s
network (``bandwidth_scale=10``), checked against a real 10 Gbit/s run.

    python bench/whatif_accuracy.py [--models wide_mlp,transformer] [--networks loopback,1gbit]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import record_emulated, record_loopback  # noqa: E402

from dpro import testbed  # noqa: E402
from dpro.io.load import load_run  # noqa: E402
from dpro.sim.whatif import context, predict  # noqa: E402

BASE_MB = 25.0
TARGETS_MB = (1.0, 5.0, 100.0)


def measured_ms(run_dir: Path) -> float:
    return context(load_run(run_dir)).base.measured_step_us / 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="wide_mlp,mlp,transformer")
    parser.add_argument("--networks", default="loopback,1gbit")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--profile", default="8:20")
    parser.add_argument("--keep", default=None, help="record into this new directory and keep the runs (to compare "
                                                     "dpro versions on the same recordings)")
    args = parser.parse_args()
    errors: list[float] = []
    header = (f"{'network':<9} {'model':<12} {'recorded':<14} {'predicted config':<18} {'predicted ms':>12} "
              f"{'measured ms':>12} {'error %':>8}")
    print(header + "\n" + "-" * len(header), flush=True)

    def show(network: str, model: str, recorded: str, target: str, predicted: float, measured: float) -> None:
        err = 100.0 * (predicted - measured) / measured
        errors.append(abs(err))
        print(f"{network:<9} {model:<12} {recorded:<14} {target:<18} {predicted:>12.2f} {measured:>12.2f} "
              f"{err:>+8.2f}", flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=args.keep is None)
        for network in args.networks.split(","):
            if network != "loopback":
                ok, why = testbed.testbed_available()
                if not ok:
                    print(f"{network}: skipped: {why}")
                    continue
            for model in args.models.split(","):
                runs: dict[float, Path] = {}
                for mb in (BASE_MB, *TARGETS_MB):
                    run_dir = Path(tmp) / f"{network}-{model}-{mb:g}"
                    if network == "loopback":
                        record_loopback(model, mb, run_dir, args.steps, args.profile)
                    else:
                        with testbed.emulated_cluster(2, testbed.NetworkSpec(rate=network)) as cluster:
                            record_emulated(cluster, model, mb, run_dir, args.steps, args.profile, 29700)
                    runs[mb] = run_dir
                ctx = context(load_run(runs[BASE_MB]))
                for mb in TARGETS_MB:
                    predicted = predict(ctx, {"torch.ddp.bucket_cap_mb": mb}).predicted_step_ms
                    show(network, model, f"{BASE_MB:g} MB", f"{mb:g} MB buckets", predicted, measured_ms(runs[mb]))
                if network == "1gbit":
                    fast = Path(tmp) / f"10gbit-{model}"
                    with testbed.emulated_cluster(2, testbed.NetworkSpec(rate="10gbit")) as cluster:
                        record_emulated(cluster, model, BASE_MB, fast, args.steps, args.profile, 29710)
                    predicted = predict(ctx, {"bandwidth_scale": 10.0}).predicted_step_ms
                    show("10gbit", model, "1gbit, 25 MB", "bandwidth x10", predicted, measured_ms(fast))
    if errors:
        print(f"\n|error| median {statistics.median(errors):.2f} %, max {max(errors):.2f} % over {len(errors)} "
              f"predictions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
