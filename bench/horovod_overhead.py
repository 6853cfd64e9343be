"""What recording a Horovod job costs its step, mechanism by mechanism, in jobs run side by side.

An unmodified Horovod script (PyTorch or Keras, Gloo) runs on 2 ranks, on loopback or on the emulated cluster network
(``dpro.testbed``: one rank per host, tbf-limited links), once per configuration, the configurations alternated
round by round:

- ``off``:        nothing recorded (dpro's step clock only: one wrapper call per step on rank 0);
- ``timeline``:   Horovod's own timeline (``HOROVOD_TIMELINE`` from ``hvd.init()``, ``horovodrun --timeline-filename``);
- ``cycles``:     the timeline with ``HOROVOD_TIMELINE_MARK_CYCLES=1``;
- ``hooks``:      dpro's recorder with its module, gradient and optimizer hooks, no allreduce polling, no timeline
                  (PyTorch only: a Keras job's recorder is TensorFlow's profiler, which has no parts to leave out);
- ``hooks+poll``: the recorder with every mechanism (launch marks and ``hvd.poll`` of every allreduce), no timeline
                  (PyTorch only);
- ``dpro``:       the recorder plus ``HOROVOD_TIMELINE=DYNAMIC`` (the timeline started and stopped by the recorder
                  around its window), over the whole window;
- ``blocks``:     what ``dpro-launch`` runs for Horovod by default: the recorder with every mechanism, no timeline, in
                  blocks (``--profile START:STOP:5``); its step is the mean over the recorded steps (each block's
                  first left out: the hooks go in at its start), against the same steps of the ``off`` job, and its
                  ``self`` column is what the recorder itself reported (``dpro info``: recorded vs gap steps);
- ``blocks+tl``:  the same with ``dpro-launch --horovod-timeline``: Horovod's timeline in the last block.

The ``model`` column (blocks configurations) is the step ``dpro whatif`` and ``dpro optimize`` start from, the
recorded configuration replayed with recording's measured cost taken out (``sim.whatif.without_recording_cost``),
against the same steps of the ``off`` job: how far the model's baseline is from the job that will run unrecorded.
The ``after`` column is the mean step after the window (the timeline stopped, the hooks removed) against the
same steps of the ``off`` job: what recording leaves behind for the rest of the job.

Each job runs ``--steps`` steps and records (where it records) the window ``--profile``. A job's step is the mean
interval between the ends of consecutive steps inside the window (rank 0's step clock, ``DPRO_STEP_TIMES``): what
the job's throughput is, and what the model's replay reproduces (a median would sit below both where a few steps
stall); the same steps of the ``off`` job are its baseline. The CPU time is rank 0's process (every thread: the
training thread, Horovod's background thread, dpro's builder thread) per step, the mean over the same steps. Each
configuration's overhead is given per round against that round's ``off`` job (the spread) and as the ratio of the
jobs' medians. The last lines time the merge of the timeline
into the loaded run (``dpro.engines.load_prepared``, with and without the timeline file).

    python bench/horovod_overhead.py [--loopback] [--rate 1gbit] [--rounds 3] [--steps 60] [--profile 20:50]
        [--configs off,timeline,cycles,hooks,hooks+poll,dpro,blocks,blocks+tl] [--doc FILE]
        [--script tests/jobs/conv1d_hvd.py [ARGS...]]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_doc import write_bench_doc

import launch as hvd_bench  # bench/launch.py: running a Horovod job on loopback or in the testbed's namespaces
from dpro import testbed as tb
from dpro.record.protocol import parse_window

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("off", "timeline", "cycles", "hooks", "hooks+poll", "dpro", "blocks", "blocks+tl")
BLOCK = 5
NO_COMM = "forward,backward,grad_ready,update"


def config_env(name: str, work: Path, window: str) -> dict[str, str]:
    """The environment of one configuration (run files under ``work``)."""
    record = {"DPRO_AUTO_RECORD": "1", "DPRO_PROFILE": window, "DPRO_RUN_DIR": str(work / "run")}
    timeline = {"HOROVOD_TIMELINE": str(work / "timeline.json")}
    return {"off": {}, "timeline": timeline, "cycles": {**timeline, "HOROVOD_TIMELINE_MARK_CYCLES": "1"},
            "hooks": {**record, "DPRO_MECHANISMS": NO_COMM}, "hooks+poll": record,
            "dpro": {**record, "HOROVOD_TIMELINE": "DYNAMIC"},
            "blocks": {**record, "DPRO_PROFILE": f"{window}:{BLOCK}"},
            "blocks+tl": {**record, "HOROVOD_TIMELINE": "DYNAMIC", "DPRO_PROFILE": f"{window}:{BLOCK}"}}[name]


def measured_steps(name: str, window: str) -> list[int]:
    """The steps a configuration's step time is the mean of: the window's, or the recorded steps of the blocks
    after each block's first; never the window's first or last (opening the window; closing it, which writes the
    run's files and runs its probes once, a second or so: one such step would move a mean of a hundred by 10%)."""
    start, stop = (int(v) for v in window.split(":"))
    if not name.startswith("blocks"):
        return list(range(start + 1, stop - 1))
    recorded = set(parse_window(f"{window}:{BLOCK}").steps)
    last = max(recorded)
    return [i for i in range(start, stop) if i in recorded and i - 1 in recorded and i != last]


def intervals(ends: list[float], steps: list[int]) -> list[float]:
    """Intervals (ms) ending at ``steps`` (step i ends at ``ends[i]``)."""
    return [(ends[i] - ends[i - 1]) * 1000.0 for i in steps if 0 < i < len(ends)]


def run_one(cluster: tb.Cluster | None, args: argparse.Namespace, name: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"dpro-hvd-{name.replace('+', '-')}-"))
    try:
        env = config_env(name, work, args.profile)
        result, wall, _ = hvd_bench.run_job(cluster, [], env, args.timeout, args)
        out = {"wall_s": wall}
        for config in ("window", "blocks"):  # off is the baseline of both
            steps = measured_steps(config, args.profile)
            suffix = "" if config == "window" else "_blocks"
            out["step_ms" + suffix] = statistics.fmean(intervals(result["step_ends"], steps))
            out["cpu_ms_per_step" + suffix] = statistics.fmean(intervals(result["cpu_ends"], steps))
        stop = int(args.profile.split(":")[1])
        after = intervals(result["step_ends"], list(range(stop + 1, len(result["step_ends"]))))
        out["after_ms"] = statistics.fmean(after) if after else None
        if name.startswith("blocks"):
            out["step_ms"], out["cpu_ms_per_step"] = out["step_ms_blocks"], out["cpu_ms_per_step_blocks"]
            out["self_pct"] = self_reported(work / "run")
            out["model_ms"] = modelled_step_ms(work / "run")
        if name == "dpro" and (work / "run").is_dir():
            out["merge"] = time_merge(work / "run")
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def self_reported(run_dir: Path) -> float | None:
    """Rank 0's own measure of its recording overhead (wall, %), as ``dpro info`` shows it."""
    from dpro.engines import load_prepared

    overhead = load_prepared(run_dir).ranks[0].header.get("recording_overhead") or {}
    return overhead.get("wall_pct")


def modelled_step_ms(run_dir: Path) -> float | None:
    """The step what-if and optimize start from (``dpro whatif``'s baseline: the recorded configuration replayed,
    recording's measured cost taken out), to set beside the unrecorded job's."""
    from dpro.engines import load_prepared
    from dpro.errors import DproError
    from dpro.launch.pipeline import find_recorded_run
    from dpro.sim.whatif import context, predict

    try:
        return predict(context(load_prepared(find_recorded_run(run_dir) or run_dir)), {}).predicted_step_ms
    except DproError as err:
        print(f"no model of {run_dir}: {err}", file=sys.stderr)
        return None


def time_merge(run_dir: Path) -> dict[str, float]:
    """``load_prepared`` of the recorded run with its timeline, then with the timeline moved away (s)."""
    from dpro.engines import load_prepared
    from dpro.launch.pipeline import find_recorded_run

    recorded = find_recorded_run(run_dir) or run_dir
    began = time.perf_counter()
    load_prepared(recorded)
    merged = time.perf_counter() - began
    timeline = recorded / hvd_bench.TIMELINE
    if timeline.is_file():
        timeline.rename(recorded / "timeline.aside")
    began = time.perf_counter()
    load_prepared(recorded)
    return {"with_timeline_s": merged, "without_s": time.perf_counter() - began}


def spread(values: list[float]) -> str:
    return f"{min(values):+.1f} .. {max(values):+.1f}" if values else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loopback", action="store_true", help="one host, horovodrun -H localhost:2")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="(the bundled script's --steps)")
    parser.add_argument("--profile", default="20:50", help="the recorded window, START:STOP")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--doc", default=None, help="also write the table to this markdown file (e.g. "
                                                     "docs/benchmarks/horovod_overhead.md)")
    parser.add_argument("--script", nargs=argparse.REMAINDER, default=None,
                        help="SCRIPT [ARGS...] (last): an unmodified Horovod script; default tests/jobs/conv1d_hvd.py")
    args = parser.parse_args()
    if not args.script:
        args.script = [str(ROOT / "tests" / "jobs" / "conv1d_hvd.py"), "--steps", str(args.steps)]
    args.warmup = 0
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or "off" not in configs:
        parser.error(f"--configs: choose from {', '.join(CONFIGS)}, off included (unknown: {unknown})")
    where = hvd_bench.choose_network(args)
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    with contextlib.ExitStack() as stack:
        cluster = None
        if not args.loopback:
            cluster = stack.enter_context(tb.emulated_cluster(2, tb.NetworkSpec(rate=args.rate)))
            stack.enter_context(hvd_bench.resolvable_hosts(cluster))
            where = f"emulated {args.rate} links, 2 hosts x 1 rank"
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]  # a different config first each round
            for name in order:
                runs[name].append(run_one(cluster, args, name))
                print(f"round {r + 1}/{args.rounds} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    def baseline(name: str, key: str) -> list[float]:
        return [x[key + ("_blocks" if name.startswith("blocks") else "")] for x in runs["off"]]

    script = " ".join([Path(args.script[0]).name, *args.script[1:]])
    table = [f"Horovod 0.28.1 + Gloo, script {script}, {where}; window {args.profile}; {args.rounds} rounds, "
             f"configurations alternated",
             f"{'config':<11} {'step ms':>8} {'vs off':>7} {'per round %':>15} {'CPU ms/step':>12} {'vs off':>7}"
             f" {'self %':>22} {'model':>7} {'after':>7}   jobs (ms)"]
    for name in configs:
        steps = [x["step_ms"] for x in runs[name]]
        cpu = [x["cpu_ms_per_step"] for x in runs[name]]
        base, base_cpu = baseline(name, "step_ms"), baseline(name, "cpu_ms_per_step")
        per_round = [100.0 * (s / b - 1.0) for s, b in zip(steps, base, strict=True)]
        ratio = 100.0 * (statistics.median(steps) / statistics.median(base) - 1.0)
        cpu_ratio = 100.0 * (statistics.median(cpu) / statistics.median(base_cpu) - 1.0)
        own = [x["self_pct"] for x in runs[name] if x.get("self_pct") is not None]
        own_text = f"{statistics.median(own):+.1f} ({spread(own)})" if own else "-"
        models = [x["model_ms"] for x in runs[name] if x.get("model_ms")]
        model_text = f"{100.0 * (statistics.median(models) / statistics.median(base) - 1.0):+.1f}%" if models else "-"
        afters = [x["after_ms"] for x in runs[name] if x.get("after_ms")]
        off_after = [x["after_ms"] for x in runs["off"] if x.get("after_ms")]
        after_text = f"{100.0 * (statistics.median(afters) / statistics.median(off_after) - 1.0):+.1f}%" \
            if afters and off_after else "-"
        table.append(f"{name:<11} {statistics.median(steps):>8.1f} {ratio:>+6.1f}% {spread(per_round):>15} "
                     f"{statistics.median(cpu):>12.1f} {cpu_ratio:>+6.1f}% {own_text:>22} {model_text:>7} "
                     f"{after_text:>7}   "
                     f"{', '.join(f'{s:.1f}' for s in steps)}")
    merges = [x["merge"] for x in runs.get("dpro", []) if "merge" in x]
    if merges:
        merged, alone = (statistics.median(m[k] for m in merges) for k in ("with_timeline_s", "without_s"))
        table.append(f"timeline merge at load time: load_prepared {merged:.2f} s with the timeline, "
                     f"{alone:.2f} s without")
    print("\n" + "\n".join(table))
    print(json.dumps(runs))
    if args.doc:
        write_bench_doc(args.doc, "What recording costs a Horovod job", table,
                        note="2 cores; see the bench's docstring for the configurations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
