"""Horovod's fusion knobs three ways: defaults, Horovod's own autotuner, and dpro's config.

A 2-rank Horovod (PyTorch + Gloo) job of a communication-heavy bundled model (``wide_mlp``: 42 MB of
gradients, little compute) runs on the emulated cluster network (dpro.testbed: two hosts in network
namespaces joined by tbf-limited links, 1 Gbit/s by default), one rank per host:

- default:  Horovod's defaults (HOROVOD_FUSION_THRESHOLD 128 MiB, HOROVOD_CYCLE_TIME 1 ms in 0.28.1);
- autotune: ``HOROVOD_AUTOTUNE=1`` (what ``horovodrun --autotune`` sets) with shortened sampling
            (``--autotune-steps-per-sample``, ``--autotune-warmup-samples``, ``--autotune-bayes-samples``);
            its time to a setting runs from the job's start until the autotuner logs its best
            parameters; its step time is measured on the same job's steps after that;
- dpro:     a short recorded run (``record_horovod`` + ``HOROVOD_TIMELINE`` in the run directory), then
            ``dpro optimize`` (Horovod fusion search by replay), then a job with the config's ``env``
            knobs (and ``groups=`` when the config has ``tensor_groups``); its time to a setting runs, like
            autotune's, from the job's start until the recording is complete (the last rank file written at
            the profiled window's end), plus the search.

Each measured step time is the mean over the steps after warm-up, from rank 0 (the job's throughput, and what the
replay reproduces; a median sits below it where a few steps stall). The last lines say how much
recording inflated the step it models: the recorded window's step against the unrecorded default jobs (the same
setting), next to what the recorder measured itself against the gaps of its window (``dpro info``).

``--script train.py [args...]`` (last on the command line) runs any unmodified Horovod training script
instead of the bundled job. Its step time is measured without its cooperation: dpro's auto-attach
(``dpro/launch/autoattach`` first on ``PYTHONPATH``, what ``dpro-launch`` does) with
``DPRO_STEP_TIMES`` times the end of every ``step()`` of the script's ``hvd.DistributedOptimizer`` on rank
0 (no recorder, one wrapper call per step); the step time is the mean interval between step ends after
``--warmup`` steps. The script needs only to step an ``hvd.DistributedOptimizer`` once per iteration (what
dpro records anyway). Its own arguments decide how many steps it runs; ``--autotune-args`` are appended
for the autotune job (e.g. ``"--steps 220"``, so the autotuner has time to finish), ``--record-args`` for
the recorded job. The dpro way records the script the way ``dpro-launch`` does (``DPRO_AUTO_RECORD``,
``--profile`` window; ``HOROVOD_TIMELINE=DYNAMIC`` with ``--horovod-timeline``) and applies the config's
``tensor_groups`` through ``DPRO_CONFIG``.

Ranks are started directly in their namespaces (no ssh, so no ``horovodrun -H``): a Horovod
rendezvous server (``horovod.runner.http.http_server.RendezvousServer``, what ``horovodrun --gloo``
runs) lives in host 0's namespace, and each rank gets the ``HOROVOD_GLOO_*`` / ``HOROVOD_RANK`` ...
environment ``horovodrun`` would give it. Horovod 0.28.1 opens its process-set gloo contexts on the
interface the machine's host name resolves to (not ``HOROVOD_GLOO_IFACE``), which inside a namespace is
loopback; so each host's namespace gets an ``/etc/netns/<namespace>/hosts`` (``ip netns exec`` mounts it
over /etc/hosts) mapping the host name to the host's own address, removed again afterwards.
``--loopback`` runs the same on one host with
``horovodrun -np 2 -H localhost:2 --gloo`` instead. Needs root for the namespaces.

    python bench/launch.py [--model wide_mlp] [--rate 1gbit] [--steps 40] [--loopback] [--check 16/25,128/1]
        [--profile 8:28:5] [--record-steps 30]
    python bench/launch.py --loopback --warmup 5 --script tests/jobs/conv1d_hvd.py --steps 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpro import testbed as tb

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "hvd_job.py"
TIMELINE = "horovod-timeline.json"


# ---- inside host 0: Horovod's rendezvous server -------------------------------------------------

def serve_rendezvous(hosts: str, size: int) -> None:
    """What ``horovodrun --gloo`` runs in its launcher: the HTTP rendezvous of the gloo contexts."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(parse_hosts(hosts), size))
    print(port, flush=True)
    while True:
        time.sleep(3600)


@contextlib.contextmanager
def resolvable_hosts(cluster: tb.Cluster):
    """/etc/netns/<ns>/hosts: the machine's host name resolves to each host's own address in its namespace."""
    made = []
    try:
        for host in cluster.hosts:
            folder = Path("/etc/netns") / host.netns
            folder.mkdir(parents=True, exist_ok=False)
            made.append(folder)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{host.address} {socket.gethostname()}\n")
        yield
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only when empty


# ---- running one job -----------------------------------------------------------------------------

def _rank0_json(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        line = line.split("<stdout>:", 1)[-1].strip()
        if line.startswith("{") and '"step_ms"' in line:
            return json.loads(line)
    raise RuntimeError(f"no result line in the job's output:\n{stdout[-3000:]}")


def hvd_env(cluster: tb.Cluster, rank: int, world: int, port: int) -> dict[str, str]:
    """The environment horovodrun --gloo gives a rank (one rank per host)."""
    host = cluster.hosts[rank]
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": cluster.hosts[0].address, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": host.ifname,
        "HOROVOD_HOSTNAME": host.name, "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(world),
        "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": str(rank),
        "HOROVOD_CROSS_SIZE": str(world), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    }


def _step_clock_result(path: Path, warmup: int) -> dict:
    """Step time of an unmodified script from its step clock (``DPRO_STEP_TIMES``): the mean interval
    between the ends of consecutive ``hvd.DistributedOptimizer`` steps after ``warmup`` steps."""
    if not path.is_file():
        raise RuntimeError(f"the script wrote no step times ({path}): does it step a hvd.DistributedOptimizer?")
    ends = json.loads(path.read_text())["step_ends"]
    intervals = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    tail = intervals[max(0, warmup - 1):] or intervals
    if not tail:
        raise RuntimeError(f"the script ran {len(ends)} step(s): too few to time")
    return {"step_ms": statistics.fmean(tail) * 1000, "steps": len(ends), "step_ends": ends,
            "cpu_ends": json.loads(path.read_text()).get("cpu_ends", [])}


def run_job(cluster: tb.Cluster | None, job_args: list[str], env: dict[str, str], timeout: float,
            args: argparse.Namespace | None = None, extra_script_args: list[str] = ()) -> tuple[dict, float, str]:
    """Run hvd_job.py (or ``args.script``) on 2 ranks; return rank 0's result (``step_ms``, ``step_ends``), the
    wall time from launch to exit and the output."""
    clock = None
    if args is not None and args.script:
        from dpro.launch.env import AUTOATTACH_DIR

        clock = Path(tempfile.mkdtemp(prefix="dpro-steps-")) / "steps.json"
        path = os.pathsep.join(p for p in (str(AUTOATTACH_DIR), env.get("PYTHONPATH", os.environ.get("PYTHONPATH")))
                               if p)
        env = {**env, "PYTHONPATH": path, "DPRO_STEP_TIMES": str(clock)}
        argv = [sys.executable, *args.script, *extra_script_args]
    else:
        argv = [sys.executable, str(JOB), *job_args]
    try:
        result, wall, output = _run(cluster, argv, env, timeout)
        return (_step_clock_result(clock, args.warmup) if clock else result), wall, output
    finally:
        if clock is not None:
            shutil.rmtree(clock.parent, ignore_errors=True)


def _run(cluster: tb.Cluster | None, argv: list[str], env: dict[str, str], timeout: float) -> tuple[dict, float, str]:
    began = time.time()
    if cluster is None:
        launcher = str(Path(sys.executable).with_name("horovodrun"))
        proc = subprocess.run([launcher, "-np", "2", "-H", "localhost:2", "--gloo", *argv], capture_output=True,
                              text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **env})
        if proc.returncode != 0:
            raise RuntimeError(f"job failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return _result(argv, proc.stdout), time.time() - began, proc.stdout + proc.stderr
    world = len(cluster.hosts)
    hosts = ",".join(f"{h.name}:1" for h in cluster.hosts)
    server = cluster.popen(0, [sys.executable, __file__, "rendezvous", "--hosts", hosts, "--size", str(world)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(server.stdout.readline())
        results = tb.run_ranks(cluster, lambda rank: argv, ranks_per_host=1,
                               env_for_rank=lambda rank: {**hvd_env(cluster, rank, world, port), **env},
                               timeout=timeout, cwd=ROOT)
    finally:
        server.kill()
        server.wait()
    for rank, res in enumerate(results):
        if res.returncode != 0:
            raise RuntimeError(f"rank {rank} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return _result(argv, results[0].stdout), time.time() - began, results[0].stdout + results[0].stderr


def _result(argv: list[str], stdout: str) -> dict:
    return _rank0_json(stdout) if argv[1:2] == [str(JOB)] else {}


def choose_network(args: argparse.Namespace) -> str:
    """Loopback when asked for or when the emulated network cannot be made here (``args.loopback`` is set then);
    a SIGTERM still removes the namespaces and /etc/netns. Returns where the jobs run, for the table's title."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.loopback:
        ok, why = tb.testbed_available()
        if not ok:
            print(f"emulated network unavailable ({why}); running on loopback", file=sys.stderr)
            args.loopback = True
    return "loopback (one host, horovodrun)"


# ---- the three ways --------------------------------------------------------------------------------

def measure(cluster: tb.Cluster | None, args: argparse.Namespace, env: dict[str, str],
            extra: list[str] = ()) -> list[float]:
    """Median step time (ms) of ``args.repeat`` jobs with ``env``."""
    times = []
    for _ in range(args.repeat):
        result, _, _ = run_job(cluster, ["--model", args.model, "--steps", str(args.steps), "--profile", "",
                                         "--warmup", str(args.warmup), *extra], env, args.timeout, args)
        times.append(result["step_ms"])
    return times


def default_run(cluster: tb.Cluster | None, args: argparse.Namespace) -> dict:
    times = measure(cluster, args, {})
    return {"setting": "128 MiB / 1 ms (defaults)", "find_s": 0.0, "step_ms": statistics.median(times),
            "runs_ms": times}


def autotune_run(cluster: tb.Cluster | None, args: argparse.Namespace, work: Path) -> dict:
    log = work / "autotune.csv"
    # the autotuner also tries hierarchical allgather and the response cache, each value with a whole
    # Bayesian search of its own (nested: 4x longer); fixing them keeps it to dpro's two knobs
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log), "HOROVOD_LOG_LEVEL": "INFO",
           "HOROVOD_HIERARCHICAL_ALLGATHER": "0", "HOROVOD_CACHE_CAPACITY": "1024",
           "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": str(args.autotune_steps_per_sample),
           "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": str(args.autotune_warmup_samples),
           "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(args.autotune_bayes_samples)}
    began = time.time()
    result, wall, output = run_job(cluster, ["--model", args.model, "--steps", str(args.autotune_steps),
                                             "--profile", "", "--warmup", str(args.warmup)], env, args.timeout * 6,
                                   args, args.autotune_args.split())
    lines = [ln for ln in log.read_text().splitlines()[1:] if ln.strip()] if log.exists() else []
    done_at = log.stat().st_mtime if log.exists() else None  # the best parameters are its last line
    ends = result["step_ends"]
    after = [b - a for a, b in zip(ends, ends[1:], strict=False) if done_at is not None and a >= done_at]
    finished = "Autotuner: Best params" in output and len(after) >= 5
    best = lines[-1].split(",") if lines else []
    setting = (f"{float(best[5]) / 2**20 if float(best[5]) > 1024 else float(best[5]):.1f} MiB / "
               f"{float(best[4]):.1f} ms" if len(best) >= 6 else "?")
    return {"setting": setting + ("" if finished else " (autotuning did not finish)"),
            "find_s": (done_at - began) if finished else float("nan"),
            "step_ms": statistics.fmean(after) * 1000 if finished else float("nan"),
            "job_s": wall, "samples": len(lines) - 1 if finished else len(lines), "steps": len(ends),
            "steps_after": len(after)}


def dpro_run(cluster: tb.Cluster | None, args: argparse.Namespace, work: Path) -> dict:
    run_dir = work / "dpro-run"
    run_dir.mkdir()
    began = time.time()
    if args.script:  # recorded the way dpro-launch records an unmodified script
        record_env = {"DPRO_AUTO_RECORD": "1", "DPRO_PROFILE": args.profile, "DPRO_RUN_DIR": str(run_dir)}
        if args.horovod_timeline:  # dpro-launch --horovod-timeline
            record_env["HOROVOD_TIMELINE"] = "DYNAMIC"
    else:
        record_env = {"HOROVOD_TIMELINE": str(run_dir / TIMELINE)}
    _, record_s, _ = run_job(cluster, ["--model", args.model, "--steps", str(args.record_steps), "--profile",
                                       args.profile, "--run-dir", str(run_dir)], record_env, args.timeout, args,
                             args.record_args.split())
    recorded_at = _recording_complete(run_dir)
    config = work / "config.json"
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "dpro", "optimize", str(run_dir), "--output", str(config)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"dpro optimize failed:\n{out.stdout}\n{out.stderr}")
    optimize_s = time.time() - t0
    # as for autotune (job start to its "best params" line): job start until the recording is complete, plus
    # the search; the job's steps after the profiled window and its exit are not waited for
    found = (recorded_at - began) + optimize_s
    doc = json.loads(config.read_text())
    env = dict(doc["knobs"]["env"])
    extra: list[str] = []
    if doc["knobs"].get("tensor_groups"):
        if args.script:
            env["DPRO_CONFIG"] = str(config)  # auto-attach gives hvd.DistributedOptimizer the groups
        else:
            extra = ["--config", str(config)]
    times = measure(cluster, args, env, extra)
    analysis = subprocess.run([sys.executable, "-m", "dpro", "analyze", str(run_dir), "--json"], capture_output=True,
                              text=True, timeout=600)
    replay = json.loads(analysis.stdout) if analysis.returncode == 0 else {}
    groups = f" + {len(doc['knobs']['tensor_groups'])} groups" if doc["knobs"].get("tensor_groups") else ""
    if "HOROVOD_CACHE_CAPACITY" in env:
        groups += f", cache {env['HOROVOD_CACHE_CAPACITY']}"
    return {"setting": f"{int(env['HOROVOD_FUSION_THRESHOLD']) / 2**20:g} MiB / {env['HOROVOD_CYCLE_TIME']} ms{groups}",
            "find_s": found, "record_s": record_s, "recorded_s": recorded_at - began, "optimize_s": optimize_s,
            "step_ms": statistics.median(times),
            "runs_ms": times, "predicted_ms": doc["predicted"]["step_ms"],
            "recorded_measured_ms": doc["baseline"]["step_ms"], "recorded_replay_ms": replay.get("predicted_step_ms"),
            "self_check_pct": _self_check(run_dir),
            "analyze_error_pct": replay.get("error_pct"), "explain": [e["why"] for e in doc["explain"]]}


def _self_check(run_dir: Path) -> float | None:
    """The recorded job's own measure of what recording cost its step (rank 0, wall %; ``dpro info``)."""
    from dpro.engines import load_prepared
    from dpro.launch.pipeline import find_recorded_run

    recorded = find_recorded_run(run_dir)
    if recorded is None:
        return None
    overhead = load_prepared(recorded).ranks[0].header.get("recording_overhead") or {}
    return overhead.get("wall_pct")


def _recording_complete(run_dir: Path) -> float:
    """When the recording was complete: the last rank file (or Horovod timeline) written, as a ``time.time()``."""
    from dpro.launch.pipeline import find_recorded_run

    recorded = find_recorded_run(run_dir)
    files = [*recorded.glob("rank-*.json"), *recorded.glob(TIMELINE)] if recorded is not None else []
    if not files:
        raise RuntimeError(f"the recorded job left no rank files in {run_dir}")
    return max(p.stat().st_mtime for p in files)


def check_settings(cluster: tb.Cluster | None, args: argparse.Namespace, work: Path) -> list[dict]:
    """Measure other settings and set them next to dpro's prediction for them.

    The recorded setting is measured too, and the jobs are interleaved (round r runs one job of every
    setting), so a machine that gets busier or quieter during the check shifts all settings alike. Each
    row gives the error of the prediction (``error_pct``) and of the predicted ratio to the recorded
    setting (``relative_error_pct``: prediction / prediction of the recorded setting vs measured / measured
    of the recorded setting), which leaves out the level (the recorded job's own overhead and drift)."""
    from dpro.engines import load_prepared
    from dpro.engines.horovod.search import horovod_predict, knobs_in_force
    from dpro.sim.whatif import context

    ctx = context(load_prepared(work / "dpro-run"))
    threshold0, cycle0, _ = knobs_in_force(ctx)
    settings = [(threshold0 / 2**20, cycle0)] + [tuple(float(v) for v in item.split("/"))
                                                 for item in args.check.split(",")]
    predicted = [horovod_predict(ctx, mb * 2**20, ms) for mb, ms in settings]  # as the engine's search does
    runs: list[list[float]] = [[] for _ in settings]
    one = argparse.Namespace(**{**vars(args), "repeat": 1})
    for _ in range(args.repeat):
        for k, (mb, ms) in enumerate(settings):
            env = {"HOROVOD_FUSION_THRESHOLD": str(int(mb * 2**20)), "HOROVOD_CYCLE_TIME": f"{ms:g}"}
            runs[k] += measure(cluster, one, env)
    base_step, base_pred = statistics.median(runs[0]), predicted[0]
    out = []
    for k, (mb, ms) in enumerate(settings):
        step = statistics.median(runs[k])
        ratio_pred, ratio_meas = predicted[k] / base_pred, step / base_step
        out.append({"setting": f"{mb:g} MiB / {ms:g} ms" + (" (recorded)" if k == 0 else ""), "step_ms": step,
                    "runs_ms": runs[k], "predicted_ms": predicted[k],
                    "error_pct": 100.0 * (predicted[k] - step) / step,
                    "relative_error_pct": 100.0 * (ratio_pred - ratio_meas) / ratio_meas})
        print("check", out[-1], file=sys.stderr)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    rdv = sub.add_parser("rendezvous", help="(internal) Horovod's rendezvous server, run inside host 0")
    rdv.add_argument("--hosts", required=True)
    rdv.add_argument("--size", type=int, required=True)
    parser.add_argument("--model", default="wide_mlp")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--loopback", action="store_true", help="one host, horovodrun -H localhost:2 (no emulation)")
    parser.add_argument("--steps", type=int, default=40, help="steps of each measured job")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of each measured mean")
    parser.add_argument("--record-steps", type=int, default=30)
    parser.add_argument("--profile", default="8:28:5", help="the steps dpro records, START:STOP[:BLOCK] (default: "
                                                            "blocks, as dpro-launch records Horovod)")
    parser.add_argument("--autotune-steps", type=int, default=220)
    parser.add_argument("--repeat", type=int, default=3, help="jobs per measured setting (median of their means)")
    parser.add_argument("--autotune-steps-per-sample", type=int, default=2)
    parser.add_argument("--autotune-warmup-samples", type=int, default=1)
    parser.add_argument("--autotune-bayes-samples", type=int, default=10)
    parser.add_argument("--only", default="default,autotune,dpro")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--keep", default=None, help="keep the runs, logs and config in this new directory")
    parser.add_argument("--check", default="", help="also measure these THRESHOLD_MB/CYCLE_MS settings, e.g. "
                                                     "'4/5,32/1': the replay's prediction next to the measurement")
    parser.add_argument("--autotune-args", default="", help="with --script: appended to the autotune job's "
                                                            "arguments (e.g. '--steps 220')")
    parser.add_argument("--record-args", default="", help="with --script: appended to the recorded job's arguments")
    parser.add_argument("--horovod-timeline", action="store_true",
                        help="with --script: record with Horovod's timeline in the last block (dpro-launch's flag)")
    parser.add_argument("--script", nargs=argparse.REMAINDER, default=None,
                        help="SCRIPT [ARGS...] (last): an unmodified Horovod training script instead of the bundled "
                             "job; its steps are timed by dpro's step clock (see the module docstring)")
    args = parser.parse_args()
    if args.command == "rendezvous":
        serve_rendezvous(args.hosts, args.size)
        return 0
    where = choose_network(args)
    rows: dict[str, dict] = {}
    keep = contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="dpro-launch-")
    with keep as tmp:
        work = Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.loopback:
            cluster_cm = None
        else:
            cluster_cm = tb.emulated_cluster(2, tb.NetworkSpec(rate=args.rate))
            where = f"emulated {args.rate} links, 2 hosts x 1 rank"
        cluster = cluster_cm.__enter__() if cluster_cm is not None else None
        names = resolvable_hosts(cluster) if cluster is not None else contextlib.nullcontext()
        names.__enter__()
        try:
            if cluster is not None:
                print(f"measured link: {tb.measure_bandwidth(cluster) / 1e9:.2f} Gbit/s", file=sys.stderr)
            only = args.only.split(",")
            if "default" in only:
                rows["default"] = default_run(cluster, args)
                print("default", rows["default"], file=sys.stderr)
            if "dpro" in only:
                rows["dpro"] = dpro_run(cluster, args, work)
                print("dpro", {k: v for k, v in rows["dpro"].items() if k != "explain"}, file=sys.stderr)
            if args.check and "dpro" in rows:
                rows["check"] = check_settings(cluster, args, work)
            if "autotune" in only:
                rows["autotune"] = autotune_run(cluster, args, work)
                print("autotune", rows["autotune"], file=sys.stderr)
        finally:
            names.__exit__(None, None, None)
            if cluster_cm is not None:
                cluster_cm.__exit__(None, None, None)
    what = f"script {' '.join(args.script)}" if args.script else f"model {args.model}"
    length = "the script's steps" if args.script else f"{args.steps} steps"
    print(f"\nHorovod 0.28.1 + Gloo, {what}, {where}; step = mean of steps after {args.warmup}, "
          f"median of {args.repeat} jobs of {length} (autotune: the steps after it finished, 1 job)")
    print(f"{'way':<10} {'setting':<34} {'step ms':>9} {'jobs (ms)':<24} {'time to setting s':>18}")

    def jobs(r: dict) -> str:
        return ", ".join(f"{t:.0f}" for t in r.get("runs_ms", [])) or "1 job"

    for name in ("default", "autotune", "dpro"):
        if name in rows:
            r = rows[name]
            print(f"{name:<10} {r['setting']:<34} {r['step_ms']:>9.1f} {jobs(r):<24} {r['find_s']:>18.1f}")
    for r in rows.get("check", []):
        print(f"{'check':<10} {r['setting']:<34} {r['step_ms']:>9.1f} {jobs(r):<24}   dpro predicted "
              f"{r['predicted_ms']:.1f} ({r['error_pct']:+.1f}%; ratio to the recorded setting "
              f"{r['relative_error_pct']:+.1f}%)")
    if "dpro" in rows:
        d = rows["dpro"]
        print(f"\ndpro: recording complete {d['recorded_s']:.1f} s after the job's start (the job ran "
              f"{d['record_s']:.1f} s) + optimize {d['optimize_s']:.1f} s; the recorded run "
              f"measured {d['recorded_measured_ms']:.1f} ms, replayed {d['recorded_replay_ms']:.1f} ms "
              f"(error {d['analyze_error_pct']:+.1f}%); its config predicts {d['predicted_ms']:.1f} ms")
        for why in d["explain"]:
            print(f"  - {why}")
        if "default" in rows:  # what recording did to the step it models, measured against the unrecorded jobs
            inflation = 100.0 * (d["recorded_measured_ms"] / rows["default"]["step_ms"] - 1.0)
            own = d.get("self_check_pct")
            print(f"recording inflation: the recorded window {d['recorded_measured_ms']:.1f} ms against the unrecorded "
                  f"jobs' {rows['default']['step_ms']:.1f} ms at the same setting ({inflation:+.1f}%); the recorder's "
                  f"own check: {'n/a' if own is None else f'{own:+.1f}%'}")
    print(json.dumps(rows, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
