"""MXNet's parameter server (dist_sync on ps-lite): replay accuracy and the num_servers / bigarray_bound what-ifs
against real runs, and ``dpro optimize``'s setting against MXNet's defaults, side by side.

An unmodified Gluon script (``bench/scripts/gluon_train.py``, no dpro import) with 2 workers is recorded by dpro's
auto-attach (``DPRO_AUTO_RECORD``: what ``dpro-launch --profile`` does) under several settings, the settings
alternating within each round:

- loopback: ``dpro-launch --engine mxnet -np 2 -H localhost:2 --num-servers S`` (every process on this machine);
- 1gbit: the emulated cluster of ``dpro.testbed`` (2 hosts in network namespaces, 1 Gbit/s links); host k runs
  worker k and server k (MXNet's launcher's placement), host 0 also the scheduler. Needs root.

Each recording gives a row: measured step, ``dpro analyze``'s replay and its error. Each what-if row predicts one
setting from the recordings of another (``dpro whatif RUN --set num_servers=1``) and compares it with the median
measured step of that setting's own recordings; "ratio" compares predicted and measured change relative to the
recorded setting (so one recording's level, which varies from job to job, cancels). ``--optimize``: ``dpro
optimize`` on the first recording of ``--optimize-from`` (default: MXNet's defaults), then jobs with its env knobs
alternate with jobs at that setting.

    python bench/mxnet_ps.py [--networks loopback,1gbit] [--models mlp,cnn] [--rounds 2] [--optimize]
                             [--script a_gluon_script.py]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpro import testbed
from dpro.analyze import analyze_path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "scripts" / "gluon_train.py"
MXNET_PYTHON = ROOT / ".venv-mxnet" / "bin" / "python"
AUTOATTACH = ROOT / "launch" / "autoattach"
DEFAULT_BOUND = 1_000_000
# setting label -> (servers, bigarray bound); the first is MXNet's default placement for 2 workers
SETTINGS = {"2 servers": (2, DEFAULT_BOUND), "1 server": (1, DEFAULT_BOUND), "2 servers, no split": (2, 10**9)}
WHATIFS = [("2 servers", "1 server", {"num_servers": 1}),
           ("1 server", "2 servers", {"num_servers": 2}),
           ("2 servers", "2 servers, no split", {"mxnet.kvstore.bigarray_bound": 10**9}),
           ("2 servers, no split", "2 servers", {"mxnet.kvstore.bigarray_bound": DEFAULT_BOUND})]


def record_loopback(model: str, servers: int, bound: int, run_dir: Path, steps: int, window: str,
                    extra_env: dict[str, str] | None = None, script: Path = SCRIPT) -> None:
    cmd = [str(Path(sys.executable).with_name("dpro-launch")), "--engine", "mxnet", "-np", "2", "-H",
           "localhost:2", "--num-servers", str(servers), "--profile", window, "--run-dir", str(run_dir),
           str(MXNET_PYTHON), str(script), "--model", model, "--steps", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MXNET_KVSTORE_BIGARRAY_BOUND=str(bound), **(extra_env or {}))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def server_rank_order(addresses: list[str]) -> list[str]:
    """The servers' hosts in ps-lite's rank order: its scheduler numbers nodes by address, the greatest first
    (ps-lite's van.cc sorts them with ``hostname.compare(...) > 0``)."""
    return sorted(addresses, reverse=True)


def record_emulated(cluster: testbed.Cluster, model: str, servers: int, bound: int, run_dir: Path, steps: int,
                    window: str, extra_env: dict[str, str] | None = None, script: Path = SCRIPT) -> None:
    """The ps-lite roles started in the hosts' namespaces: scheduler and server 0 and worker 0 on host 0, server 1
    and worker 1 on host 1, further servers taking the hosts in turn (started in that order: ps-lite numbers the
    workers and servers as they connect)."""
    root = cluster.hosts[0].address
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    run_dir.mkdir(parents=True)
    pythonpath = f"{AUTOATTACH}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath,
                DMLC_PS_ROOT_URI=root, DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_SERVER=str(servers),
                DMLC_NUM_WORKER="2", MXNET_KVSTORE_BIGARRAY_BOUND=str(bound), DPRO_AUTO_RECORD="1",
                DPRO_PROFILE=window, DPRO_RUN_DIR=str(run_dir),
                DPRO_MXNET_SERVER_HOSTS=",".join(server_rank_order([cluster.hosts[k % len(cluster.hosts)].address
                                                                    for k in range(servers)])),
                **(extra_env or {}))
    roles = [("scheduler", 0)] + [("server", k % len(cluster.hosts)) for k in range(servers)] + [("worker", 0),
                                                                                            ("worker", 1)]
    argv = [str(MXNET_PYTHON), str(script), "--model", model, "--steps", str(steps)]
    procs, logs = [], []
    try:
        for i, (role, host) in enumerate(roles):
            log = open(run_dir.parent / f"{run_dir.name}.{i}-{role}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            env = dict(base, DMLC_ROLE=role, DMLC_NODE_HOST=cluster.hosts[host].address)
            procs.append((role, cluster.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT)))
            time.sleep(0.5 if role != "scheduler" else 1.0)
        deadline = time.monotonic() + 600
        for role, proc in procs:
            if role == "worker":
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                if proc.returncode != 0:
                    raise RuntimeError(f"a worker exited {proc.returncode}; logs: {run_dir}.*.log")
        for _, proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
        for log in logs:
            log.close()


def record(cluster: testbed.Cluster | None, model: str, servers: int, bound: int, run_dir: Path,
           args: argparse.Namespace) -> None:
    if cluster is None:
        record_loopback(model, servers, bound, run_dir, args.steps, args.window, script=Path(args.script))
    else:
        record_emulated(cluster, model, servers, bound, run_dir, args.steps, args.window, script=Path(args.script))


def whatif_ms(run_dir: Path, knobs: dict[str, object]) -> tuple[float, float]:
    """(predicted step under ``knobs``, the replay of the run as recorded), ms."""
    cmd = [str(Path(sys.executable).with_name("dpro")), "whatif", str(run_dir), "--json"]
    for k, v in knobs.items():
        cmd += ["--set", f"{k}={json.dumps(v)}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    doc = json.loads(proc.stdout)
    return float(doc["predicted_step_ms"]), float(doc["baseline_predicted_step_ms"])


def optimize_env(run_dir: Path) -> dict[str, str]:
    cmd = [str(Path(sys.executable).with_name("dpro")), "optimize", str(run_dir), "-o",
           str(run_dir.with_name(run_dir.name + ".config.json"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    print("    " + "\n    ".join(proc.stdout.strip().splitlines()), flush=True)
    config = json.loads(run_dir.with_name(run_dir.name + ".config.json").read_text())
    return dict(config["knobs"].get("env", {}))


def spread(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--networks", default="loopback,1gbit")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--rounds", type=int, default=2, help="recordings of each setting (alternating)")
    parser.add_argument("--script", default=str(SCRIPT),
                        help="the Gluon script every role runs (it takes --model NAME and --steps N); default: "
                             "bench/scripts/gluon_train.py")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", default="10:30")
    parser.add_argument("--optimize", action="store_true",
                        help="also dpro optimize on a recording of --optimize-from, its setting against that one")
    parser.add_argument("--optimize-from", default="2 servers", choices=list(SETTINGS),
                        help="the setting dpro optimize starts from (default: MXNet's, 2 servers)")
    parser.add_argument("--keep", default=None, help="keep the runs in this new directory")
    parser.add_argument("--from", dest="from_dir", default=None,
                        help="record nothing: price the runs a --keep directory holds again (after a model change)")
    args = parser.parse_args()
    if not MXNET_PYTHON.exists():
        print("no .venv-mxnet (make mxnet builds it)")
        return 1
    work = Path(args.from_dir or args.keep or tempfile.mkdtemp(prefix="dpro-mxnet-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    replaying = args.from_dir is not None
    rows, what_rows, opt_rows = [], [], []
    for network in args.networks.split(","):
        if replaying and not any(work.glob(f"{network}-*")):
            continue
        if network != "loopback" and not replaying:
            ok, why = testbed.testbed_available()
            if not ok:
                print(f"{network}: skipped ({why})")
                continue
        cluster_cm = testbed.emulated_cluster(2, testbed.NetworkSpec(rate=network)) \
            if network != "loopback" and not replaying else None
        cluster = cluster_cm.__enter__() if cluster_cm is not None else None
        try:
            for model in args.models.split(","):
                runs: dict[str, list[Path]] = {label: [] for label in SETTINGS}
                measured: dict[str, list[float]] = {label: [] for label in SETTINGS}

                for k in range(args.rounds):
                    for label in SETTINGS:
                        run_dir = work / f"{network}-{model}-{label.replace(' ', '').replace(',', '-')}-{k}"
                        if replaying:
                            if not run_dir.is_dir():
                                continue
                        else:
                            print(f"[{network} {model}] recording {label} ({k + 1}/{args.rounds})", flush=True)
                            record(cluster, model, *SETTINGS[label], run_dir, args)
                        a = analyze_path(run_dir)
                        runs[label].append(run_dir)
                        measured[label].append(a.measured_step_ms)
                        rows.append((network, model, label, a.measured_step_ms, a.predicted_step_ms, a.error_pct))
                for source, target, knobs in WHATIFS:
                    if not measured[source] or not measured[target]:
                        continue
                    target_ms = statistics.median(measured[target])
                    source_ms = statistics.median(measured[source])
                    for run_dir, recorded_ms in zip(runs[source], measured[source], strict=True):
                        predicted, replayed = whatif_ms(run_dir, knobs)
                        err = 100 * (predicted / target_ms - 1)
                        ratio = 100 * ((predicted / replayed) / (target_ms / source_ms) - 1)
                        what_rows.append((network, model, f"{source} -> {target}", recorded_ms, predicted, target_ms,
                                          err, ratio, measured[target]))
                source = args.optimize_from
                if args.optimize and runs[source]:
                    ran = work / f"{network}-{model}-opt-dpro-0" / "run.json"
                    env = optimize_env(runs[source][0]) if not replaying or not ran.exists() else {
                        "DMLC_NUM_SERVER": str(json.loads(ran.read_text())["knobs"]["num_servers"]),
                        "MXNET_KVSTORE_BIGARRAY_BOUND": str(
                            json.loads(ran.read_text())["knobs"]["mxnet.kvstore.bigarray_bound"])}
                    servers0, bound0 = SETTINGS[source]
                    chosen = {"DMLC_NUM_SERVER": env.get("DMLC_NUM_SERVER", str(servers0)),
                              "MXNET_KVSTORE_BIGARRAY_BOUND": env.get("MXNET_KVSTORE_BIGARRAY_BOUND", str(bound0))}
                    recorded, tuned = [], []
                    for k in range(args.rounds):
                        for which, bucket in (("recorded", recorded), ("dpro", tuned)):
                            run_dir = work / f"{network}-{model}-opt-{which}-{k}"
                            servers, bound = (servers0, bound0) if which == "recorded" else (
                                int(chosen["DMLC_NUM_SERVER"]), int(chosen["MXNET_KVSTORE_BIGARRAY_BOUND"]))
                            if not replaying:
                                record(cluster, model, servers, bound, run_dir, args)
                            elif not run_dir.is_dir():
                                continue
                            bucket.append(analyze_path(run_dir).measured_step_ms)
                    if recorded and tuned:
                        opt_rows.append((network, model, source, chosen, recorded, tuned))
        finally:
            if cluster_cm is not None:
                cluster_cm.__exit__(None, None, None)

    print("\nreplay accuracy (one row per recording)")
    print("| network | model | setting | measured ms | replayed ms | error |")
    print("|---|---|---|---|---|---|")
    for network, model, label, m, p, e in rows:
        print(f"| {network} | {model} | {label} | {m:.2f} | {p:.2f} | {e:+.2f}% |")
    errors = [abs(r[5]) for r in rows]
    if errors:
        print(f"\nmedian |error| {statistics.median(errors):.2f}%, worst {max(errors):.2f}% over {len(errors)}")
    print("\nwhat-if against real runs (predicted from each recording of the source setting)")
    print("| network | model | what-if | recorded ms | predicted ms | measured ms (target's median) | target's jobs "
          "ms | error | ratio error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for network, model, what, rec, pred, meas, err, ratio, jobs in what_rows:
        print(f"| {network} | {model} | {what} | {rec:.2f} | {pred:.2f} | {meas:.2f} | {spread(jobs)} | {err:+.2f}% | "
              f"{ratio:+.2f}% |")
    if what_rows:
        print(f"\nmedian |error| {statistics.median(abs(r[6]) for r in what_rows):.2f}%, worst "
              f"{max(abs(r[6]) for r in what_rows):.2f}%; ratio: median "
              f"{statistics.median(abs(r[7]) for r in what_rows):.2f}%, worst {max(abs(r[7]) for r in what_rows):.2f}%")
        # how far a setting's own jobs lie from their median: no prediction can be judged closer than this
        own = [abs(100 * (m / statistics.median(ms) - 1)) for ms in {tuple(r[8]) for r in what_rows} for m in ms]
        print(f"noise floor: the target settings' own jobs lie {statistics.median(own):.2f}% (median), at most "
              f"{max(own):.2f}% from their median")
    if opt_rows:
        print("\ndpro optimize from a recording of one setting: its env against that setting, jobs alternating")
        print("| network | model | from | dpro's env | that setting ms (jobs) | dpro ms (jobs) | change |")
        print("|---|---|---|---|---|---|---|")
        for network, model, source, chosen, d, t in opt_rows:
            change = 100 * (statistics.median(t) / statistics.median(d) - 1)
            print(f"| {network} | {model} | {source} | {chosen} | {statistics.median(d):.2f} ({spread(d)}) | "
                  f"{statistics.median(t):.2f} ({spread(t)}) | {change:+.1f}% |")
    if not args.keep and not replaying:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
