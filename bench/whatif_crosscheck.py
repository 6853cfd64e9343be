"""Every job ``bench/whatif_matrix.py --keep DIR`` kept is a recording at its own setting: each predicts the change to
every other setting of its case, against the change the jobs measured (medians of their recorded steps; and paired
round by round, where a neighbour's load that drifts between rounds cancels). The model
is judged on many recordings, not the one it was fitted on, and variants of it on the same recordings side by side:

- ``as built``: the model as it is;
- ``transfers free of compute``: the recorder's transfer probe left out (what-ifs price a transfer beside compute
  as if alone);
- ``overlap free``: both interference probes left out (overlap costs neither compute nor transfers).

    python bench/whatif_crosscheck.py KEPT_DIR [KEPT_DIR ...] [--doc docs/benchmarks/whatif_crosscheck.md]

``KEPT_DIR``: a ``--keep`` directory (its case directories are found inside) or one case directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_doc import write_bench_doc

from dpro.config import knob_table
from dpro.engines import get_engine, load_prepared
from dpro.engines.mxnet_ps import ENV_KNOBS
from dpro.errors import DproError
from dpro.io.load import Run
from dpro.sim.whatif import context, predict

Variant = Callable[[Run], None]


def _without(*keys: str) -> Variant:
    def drop(run: Run) -> None:
        for key in keys:
            (run.meta or {}).pop(key, None)

    return drop


VARIANTS: dict[str, Variant | None] = {
    "as built": None,
    "transfers free of compute": _without("transfer_probe"),
    "overlap free": _without("transfer_probe", "interference_probe"),
}


def case_settings(case_dir: Path) -> dict[int, dict[str, Any]]:
    """Setting index -> the knobs that set it: ``config-<i>.json``'s, and for index 0 (the script as written) the
    recording's own values of those knobs, of the environment variables the configs set (run.json's knobs) and of
    the engine's communication knobs (DDP's default buckets are a cap and a first bucket of their own)."""
    settings = {int(p.stem.split("-")[1]): json.loads(p.read_text())["knobs"]
                for p in sorted(case_dir.glob("config-*.json"))}
    recorded = context(load_prepared(case_dir / "recorded"))
    keys = {k for knobs in settings.values() for k in knobs} | set(get_engine(recorded.engine).comm_knobs)
    table = knob_table()
    own = {k: recorded.knobs[k] for k in keys if recorded.knobs.get(k) is not None}
    # a knob the recording leaves unset at its default (amp None: the recorded precision) is set so explicitly: a
    # job recorded under bf16 must price going back to fp32, not its own setting
    own.update({k: table[k].default for k in keys if k not in own and k in table})
    variables = {v for knobs in settings.values() for v in knobs.get("env") or {}}
    # run.json names MXNet's variables by their knobs (Horovod's knobs are named as their variables)
    own["env"] = {v: str(recorded.knobs[ENV_KNOBS.get(v, v)]) for v in variables
                  if recorded.knobs.get(ENV_KNOBS.get(v, v)) is not None}
    settings[0] = own
    return settings


def case_jobs(case_dir: Path) -> dict[int, list[Path]]:
    """Setting index -> the kept jobs run at it (``r<round>-<index>``, or the re-run that replaced a failed one)."""
    jobs: dict[int, list[Path]] = {}
    for run_dir in sorted(case_dir.glob("r*-*")):
        index = int(run_dir.name.split("-")[1])
        if (run_dir / "run.json").exists():
            jobs.setdefault(index, []).append(run_dir)
    return jobs


def measured_ms(run_dir: Path) -> float:
    return context(load_prepared(run_dir)).base.measured_step_us / 1000.0


def paired_ratios(case_dir: Path, steps: dict[str, float] | None = None) -> dict[tuple[int, int], float]:
    """(setting, other) -> the measured change from one to the other paired round by round: the median over the
    rounds that ran both of the ratio of the round's two jobs (a round runs every setting back to back, so a
    neighbour's load that drifts from round to round cancels; ``steps``: job name -> its step, when known)."""
    steps = steps or {d.name: measured_ms(d) for ds in case_jobs(case_dir).values() for d in ds}
    by_round: dict[str, dict[int, float]] = {}
    for name, ms in steps.items():
        round_, index = name.split("-")
        by_round.setdefault(round_, {})[int(index)] = ms
    settings = sorted({i for jobs in by_round.values() for i in jobs})
    out = {}
    for a in settings:
        for b in settings:
            ratios = [jobs[b] / jobs[a] for jobs in by_round.values() if a in jobs and b in jobs and a != b]
            if ratios:
                out[(a, b)] = statistics.median(ratios)
    return out


def cross_errors(case_dir: Path, variant: Variant | None = None,
                 measured: dict[int, float] | None = None,
                 paired: dict[tuple[int, int], float] | None = None) -> list[float]:
    """|error| % of every (kept job, other setting) pair the model prices: the predicted ratio of the other setting
    to the job's own, against the measured ratio of the settings' median jobs (``paired``: against the ratio paired
    round by round, ``paired_ratios``)."""
    settings, jobs = case_settings(case_dir), case_jobs(case_dir)
    if any(index not in settings or not settings[index] for index in jobs if index != 0):
        return []  # a setting the script makes itself (its own option, no config): its jobs' recordings do not know it
    measured = measured or {i: statistics.median(measured_ms(d) for d in ds) for i, ds in jobs.items()}
    errors = []
    for index, dirs in jobs.items():
        for run_dir in dirs:
            run = load_prepared(run_dir)
            if variant is not None:
                variant(run)
            try:
                ctx = context(run)
            except (DproError, OSError) as err:
                print(f"  ({run_dir} not modelled: {err})", file=sys.stderr)
                continue
            mine = predict(ctx, {}).predicted_step_ms
            for other, knobs in settings.items():
                if other == index or other not in measured:
                    continue
                change = paired.get((index, other)) if paired is not None else measured[other] / measured[index]
                if change is None:
                    continue
                try:
                    theirs = predict(ctx, dict(knobs)).predicted_step_ms
                except DproError:  # a knob this recording cannot price (a compiled run, another precision)
                    continue
                errors.append(abs(100.0 * ((theirs / mine) / change - 1.0)))
    return errors


def case_dirs(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        inside = sorted(p for p in path.iterdir() if (p / "recorded").is_dir())
        found += [path] if (path / "recorded").is_dir() else inside
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kept", nargs="+", help="whatif_matrix --keep directories, or case directories in them")
    parser.add_argument("--doc", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    header = (f"{'kept case':<34} {'variant':<26} {'what-ifs':>8} {'median |err| %':>14} {'worst %':>8} "
              f"{'paired median %':>15} {'worst %':>8}")
    lines = ["each kept job predicts the change to every other setting of its case (measured: medians of the jobs; "
             "paired: each round's jobs, median over rounds)", header, "-" * len(header)]
    print("\n".join(lines), flush=True)
    pooled: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in VARIANTS}

    def row(label: str, name: str, errs: list[float], pairs: list[float]) -> str:
        return (f"{label:<34} {name:<26} {len(errs):>8} {statistics.median(errs):>14.1f} {max(errs):>8.1f} "
                f"{statistics.median(pairs):>15.1f} {max(pairs):>8.1f}")

    for case_dir in case_dirs(args.kept):
        steps = {d.name: measured_ms(d) for ds in case_jobs(case_dir).values() for d in ds}
        measured = {i: statistics.median(steps[d.name] for d in ds) for i, ds in case_jobs(case_dir).items()}
        paired = paired_ratios(case_dir, steps)
        for name, variant in VARIANTS.items():
            errs = cross_errors(case_dir, variant, measured)
            pairs = cross_errors(case_dir, variant, measured, paired)
            if not errs or not pairs:
                continue
            pooled[name][0].extend(errs)
            pooled[name][1].extend(pairs)
            line = row(f"{case_dir.parent.name}/{case_dir.name}", name, errs, pairs)
            lines.append(line)
            print(line, flush=True)
    for name, (errs, pairs) in pooled.items():
        if errs:
            line = row("all", name, errs, pairs)
            lines.append(line)
            print(line, flush=True)
    if args.doc:
        write_bench_doc(args.doc, "What-ifs from every kept job, side by side", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
