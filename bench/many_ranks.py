"""Runs of many ranks: ``dpro analyze`` of wide runs (``tests/run_builder.make_wide_run``: 200 layers, 10 steps a
rank) of 64 .. 1024 ranks, measured in its own process, and where its time and memory go, stage by stage.

Two tables:

- per rank count, ``dpro -q analyze RUN`` repeated: wall and CPU seconds and memory, median [min..max]. Memory is
  the peak RSS of the largest process (what /usr/bin/time -v reports) and the peak of the process tree's PSS summed
  over the processes, sampled every 0.1 s (the readers and the steps' models run in forked workers, which share
  pages with their parent: PSS counts a shared page once);
- per stage, in this process (one run, ``--profile-ranks``): seconds and the RSS after it, so growth per rank shows
  which stage holds what. ``--tracemalloc`` adds each stage's peak of traced Python allocations (slower).

The run directories are written once under ``--work`` (outside the repository) and reused. ``--before DIR`` also
measures the command with another checkout's package first on the path (the code before a change: DIR holds a
``dpro`` link to that checkout's ``core/``).

    python bench/many_ranks.py --ranks 64,256,1024 --repeat 3 --profile-ranks 64,256,1024 \\
        [--before DIR --before-ranks 64,256] [--doc docs/benchmarks/many-ranks.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_doc import printed_lines, write_bench_doc  # noqa: E402
from run_builder import make_wide_run  # noqa: E402

from dpro.io.pool import collector_paused  # noqa: E402

LAYERS, STEPS = 200, range(3, 13)


def wide_run(work: Path, ranks: int) -> Path:
    """The run directory of ``ranks`` ranks under ``work``, written when missing."""
    root = work / f"wide-{ranks}"
    if not (root / f"rank-{ranks - 1}.json").is_file():
        make_wide_run(root, world_size=ranks, layers=LAYERS, steps=STEPS)
    return root


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    """Wall, CPU (the command and its workers), peak RSS of the largest process, sampled peak PSS of the tree."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak_pss = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        peak_pss = max(peak_pss, sum(_pss_kb(p) for p in _tree(proc.pid)))
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed with status {proc.returncode}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024,
            "pss_mb": peak_pss / 1024}


def _spread(rows: list[dict[str, float]], key: str, fmt: str) -> str:
    values = [r[key] for r in rows]
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}..{max(values):{fmt}}]"


def command_rows(work: Path, ranks: list[int], repeat: int, pythonpath: str | None, jobs: int | None) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    label = f"before: PYTHONPATH={pythonpath}" if pythonpath else "this checkout"
    extra = [] if jobs is None else ["--jobs", str(jobs)]
    jobs_flag = f" --jobs {jobs}" if jobs else ""
    print(f"dpro -q analyze RUN{jobs_flag} ({label}; {repeat} runs each: median [min..max])")
    print(f"{'ranks':>6} {'run MB':>7} {'wall s':>20} {'CPU s':>20} {'peak RSS MB':>22} {'peak tree PSS MB':>22}")
    for n in ranks:
        run = wide_run(work, n)
        size = sum(f.stat().st_size for f in run.iterdir() if f.is_file()) / 1e6
        rows = []
        rows = [measure([sys.executable, "-m", "dpro", "-q", "analyze", str(run), *extra], env) for _ in range(repeat)]
        print(f"{n:>6} {size:>7.0f} {_spread(rows, 'wall_s', '.1f'):>20} {_spread(rows, 'cpu_s', '.1f'):>20} "
              f"{_spread(rows, 'rss_mb', '.0f'):>22} {_spread(rows, 'pss_mb', '.0f'):>22}", flush=True)


# what dpro analyze calls, before and after the change (cumulative cProfile seconds of each, where it exists)
PROFILED = ("load_run", "align", "step_model", "wired_step_model", "graph_from_steps", "graph_of_wired", "replay",
            "breakdown", "critical_ops", "stragglers", "_as_recorded_note", "fit_interference", "write_replay_trace")


def cprofile_rows(work: Path, ranks: list[int], pythonpath: str | None) -> None:
    """``dpro -q analyze RUN`` under cProfile (its own process): cumulative seconds in each of ``PROFILED``."""
    import pstats
    import tempfile

    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    for n in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "analyze.prof"
            subprocess.run([sys.executable, "-m", "cProfile", "-o", str(out), "-m", "dpro", "-q", "analyze",
                            str(wide_run(work, n))], env=env, check=True, stdout=subprocess.DEVNULL)
            stats = pstats.Stats(str(out)).stats  # (file, line, function) -> (calls, ..., tottime, cumtime, ...)
        total = max(v[3] for v in stats.values())
        print(f"\ncProfile of dpro analyze, {n} ranks ({'before: ' + pythonpath if pythonpath else 'this checkout'}; "
              f"in the main process; {total:.1f} s under the profiler)")
        print(f"{'function':<22} {'calls':>6} {'cum s':>8} {'ms/rank':>8} {'share':>6}")
        for name in PROFILED:
            rows = [v for (path, _, fn), v in stats.items() if fn == name and "/dpro/" in path or
                    fn == name and "/core/" in path]
            if rows:
                calls, cum = sum(r[0] for r in rows), max(r[3] for r in rows)
                print(f"{name:<22} {calls:>6} {cum:>8.2f} {1000 * cum / n:>8.1f} {100 * cum / total:>5.0f}%")


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _stages(run_dir: Path, jobs: int | None, state: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    """The calls ``dpro analyze`` makes, one per stage, each leaving its result in ``state``."""
    from dpro.analyze.run import breakdown, critical_ops, stragglers
    from dpro.dag.align import align
    from dpro.dag.step_model import model_steps, wired_step_model
    from dpro.dag.wiring import graph_of_wired
    from dpro.engines import load_prepared
    from dpro.record.trace import analysis_file
    from dpro.report.perfetto import write_replay_trace
    from dpro.sim.interference import fit_interference
    from dpro.sim.replay import plan_levels, predicted_step_us, replay
    from dpro.sim.steps import replay_recorded_run

    def model() -> None:
        state["model"], state["wired"] = wired_step_model(state["run"], state["alignment"])

    def perfetto() -> None:
        write_replay_trace(analysis_file(run_dir, "replay.json"), state["run"], state["alignment"], state["g"],
                           state["sched"], steps=state["model"].steps)

    return [
        ("load (parse, check, columns)", lambda: state.update(run=load_prepared(run_dir, jobs=jobs))),
        ("align", lambda: state.update(alignment=align(state["run"]))),
        ("recorded steps replayed (check)", lambda: state.update(recorded=replay_recorded_run(
            state["run"], state["alignment"], model_steps(state["run"])[0], jobs=jobs).graph.size)),
        ("step model (+ its wiring)", model),
        ("graph (stitched iterations)", lambda: state.update(g=graph_of_wired(state["model"], state["wired"], 4))),
        ("replay", lambda: state.update(sched=replay(state["g"], plan_levels(state["g"])))),
        ("predicted step + breakdown", lambda: state.update(
            pred=statistics.median(predicted_step_us(state["g"], state["sched"]).values()),
            parts=breakdown(state["g"], state["sched"]))),
        ("critical path", lambda: state.update(critical=critical_ops(state["g"], state["sched"]))),
        ("stragglers", lambda: state.update(stragglers=stragglers(state["model"]))),
        ("interference fit", lambda: state.update(fit=fit_interference(state["run"], state["model"].steps))),
        ("replay.json (Perfetto)", perfetto),
    ]


def stage_rows(work: Path, ranks: list[int], jobs: int | None, traced: bool) -> None:
    """Each stage of ``dpro analyze`` timed in this process (the same calls it makes)."""
    for n in ranks:
        run_dir = wide_run(work, n)
        print(f"\nstages of dpro analyze, {n} ranks ({'jobs ' + str(jobs) if jobs else 'default jobs'}): seconds, RSS "
              f"after it{', traced peak' if traced else ''}; per rank")
        print(f"{'stage':<34} {'s':>7} {'ms/rank':>8} {'RSS MB':>7} {'MB/rank':>8}"
              + (f" {'traced MB':>10}" if traced else ""))
        state: dict[str, Any] = {}
        base = _rss_mb()
        total = 0.0
        for name, stage in _stages(run_dir, jobs, state):
            with collector_paused():  # as dpro analyze runs them
                took, peak = _timed(stage, traced)
            total += took
            rss = _rss_mb()
            print(f"{name:<34} {took:>7.2f} {1000 * took / n:>8.1f} {rss:>7.0f} {(rss - base) / n:>8.2f}"
                  + (f" {peak:>10.0f}" if traced else ""), flush=True)
        print(f"{'total':<34} {total:>7.2f} {1000 * total / n:>8.1f}   (graph: {state['g'].size:,} nodes, recorded "
              f"steps' graph {state['recorded']:,}; peak RSS {_peak_mb():.0f} MB)")
        state.clear()


def _timed(stage: Callable[[], None], traced: bool) -> tuple[float, float]:
    """Seconds ``stage`` took, and its peak of traced allocations in MB (0 unless ``traced``)."""
    if traced:
        tracemalloc.start()
    t0 = time.perf_counter()
    stage()
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] / 2**20 if traced else 0.0
    if traced:
        tracemalloc.stop()
    return took, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="64,256,1024", help="rank counts measured with dpro analyze")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile-ranks", default="64,256", help="rank counts profiled stage by stage ('' none)")
    parser.add_argument("--tracemalloc", action="store_true", help="also each stage's traced allocation peak")
    parser.add_argument("--jobs", type=int, default=None, help="dpro analyze --jobs (default: its own)")
    parser.add_argument("--work", default="/tmp/dpro-many-ranks", help="where the run directories are written")
    parser.add_argument("--before", default=None, metavar="PYTHONPATH",
                        help="also measure the code at PYTHONPATH (a checkout before a change) on --before-ranks")
    parser.add_argument("--before-ranks", default="64,256", help="rank counts measured with --before")
    parser.add_argument("--doc", default=None, help="also write the tables to this page (e.g. docs/benchmarks/...)")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    with printed_lines() as lines:
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
        if args.before:
            before_ranks = [int(n) for n in args.before_ranks.split(",")]
            command_rows(work, before_ranks, args.repeat, args.before, None)
            if args.profile_ranks:
                cprofile_rows(work, before_ranks, args.before)
        if args.ranks:
            command_rows(work, [int(n) for n in args.ranks.split(",")], args.repeat, None, args.jobs)
        if args.profile_ranks:
            cprofile_rows(work, [int(n) for n in args.profile_ranks.split(",")][:1], None)
            stage_rows(work, [int(n) for n in args.profile_ranks.split(",")], args.jobs, args.tracemalloc)
    if args.doc:
        write_bench_doc(args.doc, "dpro analyze of many ranks: time and memory, stage by stage", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
