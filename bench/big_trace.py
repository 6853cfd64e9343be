"""Big traces: how long ``dpro analyze`` takes, and how much memory, on rank files of hundreds of MB.

Records a 2-rank gloo DDP run of a bundled model (10 profiled steps), then writes copies of it whose rank files
hold those steps repeated (shifted in time, renumbered) up to each target size, and analyzes each copy in its own
process, ``--repeat`` times, alternating the sizes. Prints per size: the rank file's MB and events, wall and CPU
seconds and peak RSS (median and range), and the prediction error (which must not move with the size).

    python bench/big_trace.py [--sizes-mb 25,100,200] [--model transformer] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measured import measured_argv, median_range, read_measurement  # noqa: E402


def record(run_dir: Path, model: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "dpro.plugins.torch.example",
                    "--model", model, "--steps", "24", "--profile", "10:20", "--run-dir", str(run_dir)],
                   env=env, check=True, capture_output=True, timeout=600)


def inflate(src: Path, dst: Path, target_mb: float) -> tuple[float, int]:
    """A copy of ``src`` whose rank files repeat the profiled steps until each is ``target_mb``; (MB, events)."""
    dst.mkdir(parents=True)
    for name in ("run.json", "model.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    sizes, counts, all_steps = [], [], []
    for rank_file in sorted(src.glob("rank-*.json")):
        doc = json.loads(rank_file.read_text())
        steps = sorted(doc["steps"])
        timed = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
        meta = [e for e in doc["traceEvents"] if e.get("ph") != "X"]
        span = max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed)
        one_copy = len(json.dumps(timed))
        copies = max(1, int(target_mb * 1e6 / one_copy))
        events = list(meta)
        for k in range(copies):
            shift, renumber = k * (span + 1000.0), k * len(steps)
            for e in timed:
                events.append({**e, "ts": e["ts"] + shift, "args": {**e["args"], "step": e["args"]["step"] + renumber}})
        all_steps = [s + k * len(steps) for k in range(copies) for s in steps]
        doc.update(steps=all_steps, traceEvents=events)
        out = dst / rank_file.name
        out.write_text(json.dumps(doc))
        sizes.append(out.stat().st_size / 1e6)
        counts.append(len(events))
    meta_doc = json.loads((dst / "run.json").read_text())
    meta_doc["profiled_steps"] = all_steps
    (dst / "run.json").write_text(json.dumps(meta_doc))
    return max(sizes), max(counts)


def analyze(run_dir: Path, scratch: Path) -> dict:
    out = scratch / "measured.json"
    argv = measured_argv(sys.executable, out, [sys.executable, "-m", "dpro", "-q", "analyze", str(run_dir), "--json"])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    measured = read_measurement(out)
    if measured is None or measured["status"] != 0:
        raise SystemExit(f"dpro analyze {run_dir} failed: {proc.stderr[-2000:]}")
    measured["error_pct"] = json.loads(proc.stdout)["error_pct"]
    return measured



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="25,100,200", help="rank-file sizes to analyze (MB)")
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each analyzes every size once)")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    with tempfile.TemporaryDirectory(prefix="dpro-big-") as tmp:
        work = Path(tmp)
        print(f"# recording a 2-rank {args.model} run ...", file=sys.stderr)
        record(work / "recorded", args.model)
        made = {}
        for size in sizes:
            made[size] = (work / f"run-{size:g}MB", *inflate(work / "recorded", work / f"run-{size:g}MB", size))
        results: dict[float, list[dict]] = {s: [] for s in sizes}
        for round_ in range(args.repeat):
            for size in sizes if round_ % 2 == 0 else reversed(sizes):
                t0 = time.perf_counter()
                results[size].append(analyze(made[size][0], work))
                print(f"# round {round_ + 1}: {size:g} MB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(f"dpro analyze, 2 ranks of {args.model}, {args.repeat} rounds (median [min..max])")
    print(f"{'rank file MB':>12} {'events/rank':>12} {'wall s':>18} {'CPU s':>18} {'peak RSS MB':>20} {'error %':>8}")
    for size in sizes:
        _, mb, events = made[size]
        rows = results[size]
        wall, cpu, rss = (median_range(rows, k, f) for k, f in (("wall_s", ".1f"), ("cpu_s", ".1f"), ("rss_mb", ".0f")))
        print(f"{mb:12.0f} {events:12,} {wall:>18} {cpu:>18} {rss:>20} "
              f"{statistics.median(r['error_pct'] for r in rows):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
