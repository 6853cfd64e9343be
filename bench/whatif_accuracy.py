"""Cross-config accuracy of what-if: predict other configurations from one recording, then run them.

For each bundled model and network: record a 2-rank gloo DDP run at the base bucket size (25 MB),
predict bucket sizes 1, 5 and 100 MB with ``dpro whatif``, then record those configurations for
real and compare. On the emulated network, a 1 Gbit/s recording also predicts the 10 Gbit/s
network (``bandwidth_scale=10``), checked against a real 10 Gbit/s run. Each prediction is made twice: with the
interference fitted from the recording (``dpro.sim.interference``: overlapped compute runs slower), and with
overlap priced as free (the model before it), side by side; the fit of each recording is printed.

    python bench/whatif_accuracy.py [--models wide_mlp,transformer] [--networks loopback,1gbit] [--doc FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import record_emulated, record_loopback  # noqa: E402
from bench_doc import write_bench_doc  # noqa: E402

from dpro import testbed  # noqa: E402
from dpro.engines import load_prepared  # noqa: E402
from dpro.sim.interference import NONE  # noqa: E402
from dpro.sim.whatif import Context, context, predict  # noqa: E402

BASE_MB = 25.0
TARGETS_MB = (1.0, 5.0, 100.0)


def measured_ms(run_dir: Path) -> float:
    return context(load_prepared(run_dir)).base.measured_step_us / 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="wide_mlp,mlp,transformer")
    parser.add_argument("--networks", default="loopback,1gbit")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--profile", default="8:20")
    parser.add_argument("--doc", default=None, help="also write the table to this markdown file")
    parser.add_argument("--keep", default=None, help="record into this new directory and keep the runs (to compare "
                                                     "dpro versions on the same recordings)")
    args = parser.parse_args()
    errors: list[float] = []
    free_errors: list[float] = []
    header = (f"{'network':<9} {'model':<12} {'recorded':<14} {'predicted config':<18} {'predicted ms':>12} "
              f"{'measured ms':>12} {'error %':>8} {'free overlap ms':>16} {'error %':>8}")
    lines = [header, "-" * len(header)]
    print("\n".join(lines), flush=True)

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    def show(network: str, model: str, recorded: str, target: str, ctx: Context, knobs: dict,
             measured: float) -> None:
        predicted = predict(ctx, knobs).predicted_step_ms
        fitted, ctx.interference = ctx.interference, NONE
        free = predict(ctx, knobs).predicted_step_ms
        ctx.interference = fitted
        err, free_err = (100.0 * (p - measured) / measured for p in (predicted, free))
        errors.append(abs(err))
        free_errors.append(abs(free_err))
        say(f"{network:<9} {model:<12} {recorded:<14} {target:<18} {predicted:>12.2f} {measured:>12.2f} "
            f"{err:>+8.2f} {free:>16.2f} {free_err:>+8.2f}")

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
                ctx = context(load_prepared(runs[BASE_MB]))
                say(f"  {network} {model}: {ctx.interference.describe()}")
                for mb in TARGETS_MB:
                    show(network, model, f"{BASE_MB:g} MB", f"{mb:g} MB buckets", ctx,
                         {"torch.ddp.bucket_cap_mb": mb}, measured_ms(runs[mb]))
                if network == "1gbit":
                    fast = Path(tmp) / f"10gbit-{model}"
                    with testbed.emulated_cluster(2, testbed.NetworkSpec(rate="10gbit")) as cluster:
                        record_emulated(cluster, model, BASE_MB, fast, args.steps, args.profile, 29710)
                    show("10gbit", model, "1gbit, 25 MB", "bandwidth x10", ctx, {"bandwidth_scale": 10.0},
                         measured_ms(fast))
    if errors:
        say(f"\n|error| median {statistics.median(errors):.2f} %, max {max(errors):.2f} % over {len(errors)} "
            f"predictions; overlap priced as free: median {statistics.median(free_errors):.2f} %, max "
            f"{max(free_errors):.2f} %")
    if args.doc:
        write_bench_doc(args.doc, "What-if accuracy: DDP bucket sizes, with and without interference", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
