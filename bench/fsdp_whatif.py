"""FSDP2 under dpro-launch: replay accuracy of the recorded runs, and the what-if of
``torch.fsdp.reshard_after_forward=false`` against real runs of that setting.

Each round runs an unmodified FSDP2 script (``bench/scripts/fsdp_train.py`` by default) twice through
``dpro-launch --profile``: as written (FSDP2's default: every unit but the root reshards after forward) and with a
config setting ``reshard_after_forward=false`` (``--apply``), the order alternating round by round. Every job is
recorded the same way (the profiler on), so their measured steps compare; the prediction from each as-written
recording is set against the median of the other setting's jobs.

    python bench/fsdp_whatif.py [--script bench/scripts/fsdp_train.py] [--rounds 3]
        [--doc docs/benchmarks/fsdp_whatif.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_doc import write_bench_doc

from dpro.analyze.traces import analyze_kineto, whatif_traces
from dpro.io.kineto import load_traces, run_trace_files

ROOT = Path(__file__).resolve().parent.parent
RESHARD = "torch.fsdp.reshard_after_forward"
ATTEMPTS = 3  # torch 2.13's gloo aborts a rank at exit now and then, with or without dpro: such a job runs again


def record(script: Path, args: list[str], run_dir: Path, config: Path | None, steps: int, window: str) -> Path:
    """One recorded job; its run directory."""
    for attempt in range(ATTEMPTS):
        target = run_dir if attempt == 0 else run_dir.with_name(f"{run_dir.name}-again{attempt}")
        cmd = [sys.executable, "-m", "dpro.launch", "-np", "2", "--profile", window, "--run-dir", str(target),
               *(["--apply", str(config)] if config else []), sys.executable, str(script), *args, "--steps",
               str(steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode == 0:
            return target
        print(f"  ({target.name} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else '?'})",
              file=sys.stderr)
    raise RuntimeError(f"{' '.join(cmd)} failed {ATTEMPTS} times")


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}..{max(values):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--script", default=str(ROOT / "bench" / "scripts" / "fsdp_train.py"))
    parser.add_argument("--script-arg", action="append", default=[], help="an argument for the script (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", default="5:15")
    parser.add_argument("--doc", default=None)
    args = parser.parse_args()
    script = Path(args.script)
    header = f"{'round':>5} {'setting':<16} {'measured ms':>11} {'replayed ms':>11} {'replay err %':>12} " \
             f"{'predicted no-reshard ms':>23}"
    lines = [f"{script.name} {' '.join(args.script_arg)}; 2 ranks, gloo, one CPU thread each; steps {args.profile} "
             f"of {args.steps} recorded by dpro-launch (the profiler)", header, "-" * len(header)]
    print("\n".join(lines), flush=True)
    measured: dict[str, list[float]] = {"as written": [], "no reshard": []}
    predicted: list[float] = []
    replay_errors: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dpro-fsdp-") as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps({
            "schema": "dpro.config/1",
            "fingerprint": {"framework": "torch", "engine": "torch-fsdp", "world_size": 2, "model": "bench"},
            "knobs": {RESHARD: False}, "explain": []}))
        for r in range(args.rounds):
            order = [("as written", None), ("no reshard", config)]
            for label, applied in (order if r % 2 == 0 else order[::-1]):
                run = record(script, args.script_arg, Path(tmp) / f"r{r}-{label.replace(' ', '-')}", applied,
                             args.steps, args.profile)
                files = run_trace_files(run)
                analysis = analyze_kineto(files)
                measured[label].append(analysis.measured_step_ms)
                replay_errors.append(analysis.error_pct)
                guess = ""
                if applied is None:
                    value = whatif_traces(load_traces(files), {RESHARD: False})["predicted_step_ms"]
                    predicted.append(value)
                    guess = f"{value:.2f}"
                line = (f"{r:>5} {label:<16} {analysis.measured_step_ms:>11.2f} {analysis.predicted_step_ms:>11.2f} "
                        f"{analysis.error_pct:>+12.2f} {guess:>23}")
                lines.append(line)
                print(line, flush=True)
    target = statistics.median(measured["no reshard"])
    errors = [100.0 * (p - target) / target for p in predicted]
    change = 100.0 * (target / statistics.median(measured["as written"]) - 1.0)
    summary = [
        f"replay of the recorded runs: |error| median {statistics.median(abs(e) for e in replay_errors):.2f} %, "
        f"worst {max(abs(e) for e in replay_errors):.2f} %",
        f"no reshard measured {target:.2f} ms (jobs {spread(measured['no reshard'])}), {change:+.1f} % against as "
        f"written ({spread(measured['as written'])})",
        "what-if reshard_after_forward=false from each as-written recording: "
        + ", ".join(f"{e:+.1f} %" for e in errors)
        + f" (|error| median {statistics.median(abs(e) for e in errors):.1f} %)"]
    for line in summary:
        lines.append(line)
        print(line, flush=True)
    if args.doc:
        write_bench_doc(args.doc, "FSDP2: replay and the resharding what-if against real runs", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
