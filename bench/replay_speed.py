"""Replay speed: generated data-parallel DAGs of 10^4 .. 10^6 nodes, nodes replayed per second.

Each rank runs FW ops, then BW ops; every ``comm_every`` BW ops launch an allreduce that joins all
ranks (arrivals + one transfer), then UPDATE. Planning (topological levels) and replay are timed
separately; both should grow linearly with the number of nodes.

With ``--scale-out RUN`` it also times ``dpro whatif RUN --set world_size=N`` for each N of ``--world-sizes``
(the N-rank DAG of the run's step, replayed once per seed; each in its own process: wall, CPU, peak RSS).

    python bench/replay_speed.py [--sizes 8x1250,32x3125,128x8000] [--scale-out RUN --world-sizes 64,256,1024]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dpro.dag.graph import Graph, GraphBuilder
from dpro.sim.replay import plan_levels, replay

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measured import measured_argv, read_measurement  # noqa: E402


def data_parallel_dag(ranks: int, ops_per_rank: int, comm_every: int = 16, seed: int = 0) -> Graph:
    """A synthetic step: ``ranks`` x ``ops_per_rank`` compute ops plus collectives joining the ranks."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder()
    n_fw = ops_per_rank // 2
    n_bw = ops_per_rank - n_fw
    durations = rng.uniform(5, 50, size=(ranks, ops_per_rank))
    n_comm = n_bw // comm_every
    transfers = [b.add(f"COMM.{k}.transfer", "XFER", -1, 0, None, float(rng.uniform(20, 200)))
                 for k in range(n_comm)]
    for r in range(ranks):
        compute, comm = f"r{r}/compute", f"r{r}/comm"
        for i in range(n_fw):
            b.add(f"FW.{i}", "FW", r, 0, compute, durations[r, i], 1.0)
        last_comm = []
        for i in range(n_bw):
            node = b.add(f"BW.{i}", "BW", r, 0, compute, durations[r, n_fw + i], 1.0)
            if (i + 1) % comm_every == 0 and (k := i // comm_every) < n_comm:
                arrival = b.add(f"COMM.{k}", "COMM", r, 0, comm, 0.0, 0.0, [node])
                b.preds[transfers[k]].append(arrival)
                b.occupy(comm, transfers[k])
                last_comm = [transfers[k]]
        b.add("UPDATE", "UPDATE", r, 0, compute, 100.0, 0.0, last_comm)
    return b.build()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8x1250,32x3125,128x8000", help="RANKSxOPS_PER_RANK,...")
    parser.add_argument("--repeat", type=int, default=3, help="replays per size (best is reported)")
    parser.add_argument("--scale-out", metavar="RUN", help="a run directory to scale out with dpro whatif")
    parser.add_argument("--world-sizes", default="64,256,1024")
    args = parser.parse_args()
    print(f"{'ranks x ops':>12} {'nodes':>10} {'edges':>10} {'build s':>8} {'plan s':>8} {'replay s':>9} "
          f"{'plan+replay s':>14} {'nodes/s':>12} {'us/node':>8}")
    for spec in args.sizes.split(","):
        ranks, ops = (int(v) for v in spec.split("x"))
        t0 = time.perf_counter()
        g = data_parallel_dag(ranks, ops)
        built = time.perf_counter() - t0
        best_plan = best_replay = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            plan = plan_levels(g)
            t1 = time.perf_counter()
            replay(g, plan)
            t2 = time.perf_counter()
            best_plan, best_replay = min(best_plan, t1 - t0), min(best_replay, t2 - t1)
        total = best_plan + best_replay
        print(f"{spec:>12} {g.size:>10,} {len(g.pred_idx):>10,} {built:>8.2f} {best_plan:>8.3f} {best_replay:>9.3f} "
              f"{total:>14.3f} {g.size / total:>12,.0f} {1e6 * total / g.size:>8.2f}", flush=True)
    if args.scale_out:
        scale_out_rows(args.scale_out, [int(n) for n in args.world_sizes.split(",")])
    return 0


def scale_out_rows(run: str, world_sizes: list[int]) -> None:
    """``dpro whatif RUN --set world_size=N`` per N, each measured in its own process."""
    print(f"\nscale-out of {run}: dpro whatif --set world_size=N (the N-rank DAG, one replay per seed)")
    print(f"{'ranks':>6} {'predicted ms':>13} {'p50 ms':>9} {'p90 ms':>9} {'nodes':>10} {'wall s':>7} {'CPU s':>6} "
          f"{'peak RSS MB':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "measured.json"
        for n in world_sizes:
            argv = [sys.executable, "-m", "dpro", "-q", "whatif", run, "--set", f"world_size={n}", "--json"]
            proc = subprocess.run(measured_argv(sys.executable, out, argv), capture_output=True, text=True,
                                  timeout=1800, check=True)
            doc, m = json.loads(proc.stdout), read_measurement(out)
            spread = doc.get("spread") or {}
            print(f"{n:>6} {doc['predicted_step_ms']:>13.2f} {spread.get('p50', float('nan')):>9.2f} "
                  f"{spread.get('p90', float('nan')):>9.2f} {doc.get('graph_nodes', 0):>10,} {m['wall_s']:>7.2f} "
                  f"{m['cpu_s']:>6.2f} {m['rss_mb']:>12.0f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
