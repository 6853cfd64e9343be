"""Bucket what-if on PyTorch profiler traces against real runs: a 2-rank gloo DDP job profiled with torch.profiler
(CPU, ``record_shapes=True``) at one DDP bucket size predicts the step at another, and a real run at that size says
how close it came. Both ranks run on the emulated network of ``dpro.testbed`` (one rank per host, ``--rate`` links);
the bucket sizes alternate within each round.

    python bench/kineto_whatif.py [--rate 300mbit] [--caps 25,1] [--rounds 2] [--script SCRIPT.py
                                  [--script-arg=--record-shapes ...]]   (default: tests/jobs/profiled_gloo_ddp.py's cnn)

The script must take ``--out DIR`` (where each rank writes ``rank<r>.pt.trace.json``) and ``--bucket-cap-mb MB``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_doc import write_bench_doc

from dpro import testbed
from dpro.analyze import error_pct
from dpro.analyze.traces import whatif_traces
from dpro.io.kineto import load_traces
from dpro.report.tables import format_table

DEFAULT_SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "jobs" / "profiled_gloo_ddp.py"
DEFAULT_SCRIPT_ARGS = ["--model", "cnn", "--record-shapes", "--active", "6"]


def record(cluster: testbed.Cluster, script: Path, cap: float, out: Path, extra: list[str] = ()) -> list[Path]:
    """One profiled job at bucket size ``cap`` on the cluster; its traces."""
    out.mkdir(parents=True)
    procs = testbed.run_ranks(
        cluster, lambda r: [sys.executable, str(script), "--out", str(out), "--bucket-cap-mb", str(cap), *extra],
        env_for_rank=lambda r: testbed.torch_rank_env(cluster, r, 2, master_port=29611), timeout=300)
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise SystemExit(f"rank {r} of the {cap} MB job failed:\n{p.stderr[-2000:]}")
    return sorted(out.glob("rank*.pt.trace.json"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="300mbit", help="each host link's rate (tc syntax)")
    parser.add_argument("--caps", default="25,1", help="DDP bucket sizes in MB, each predicted from the others")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--script", type=Path, default=DEFAULT_SCRIPT)
    parser.add_argument("--script-arg", action="append", default=None,
                        help=f"one more argument for the script (the default's: {' '.join(DEFAULT_SCRIPT_ARGS)})")
    parser.add_argument("--keep", type=Path, help="keep the traces under this folder (else a temporary one)")
    parser.add_argument("--doc", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    ok, why = testbed.testbed_available()
    if not ok:
        print(f"skipped: the emulated network is unavailable here ({why})")
        return 0
    caps = [float(c) for c in args.caps.split(",")]
    script_args = args.script_arg if args.script_arg is not None else (
        DEFAULT_SCRIPT_ARGS if args.script == DEFAULT_SCRIPT else [])
    rows = []
    errors = []
    with tempfile.TemporaryDirectory() as scratch, \
            testbed.emulated_cluster(2, testbed.NetworkSpec(rate=args.rate)) as cluster:
        tmp = args.keep or scratch
        for k in range(args.rounds):
            traces = {cap: load_traces(record(cluster, args.script, cap, Path(tmp) / f"{k}-{cap}", script_args))
                      for cap in caps}
            measured = {cap: whatif_traces(t, {})["measured_step_ms"] for cap, t in traces.items()}
            for source in caps:
                for target in caps:
                    if source == target:
                        continue
                    result = whatif_traces(traces[source], {"torch.ddp.bucket_cap_mb": target})
                    err = error_pct(result["predicted_step_ms"], measured[target])
                    errors.append(abs(err))
                    rows.append([str(k + 1), f"{source:g} -> {target:g} MB",
                                 f"{result['recorded_buckets']} -> {result['buckets']}",
                                 f"{measured[source]:.2f}", f"{result['recorded_buckets_modelled_step_ms']:.2f}",
                                 f"{result['predicted_step_ms']:.2f}", f"{measured[target]:.2f}", f"{err:+.2f}"])
            print(f"round {k + 1} done", flush=True)
    lines = [f"{args.script.name}, 2 ranks (gloo) on emulated {args.rate} links, torch.profiler CPU traces with "
             "shapes; step = median ProfilerStep over the profiled steps and ranks",
             format_table(["round", "what-if", "buckets", "source measured ms", "source modelled ms",
                           "predicted ms", "target measured ms", "error %"], rows, align="<<>>>>>>"),
             f"|error| median {statistics.median(errors):.2f} %, worst {max(errors):.2f} % ({len(errors)} predictions)"]
    print("\n" + "\n\n".join(lines))
    if args.doc:
        write_bench_doc(args.doc, "Bucket what-ifs on profiler traces against real runs", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
