"""Replay speed: generated data-parallel DAGs of 10^4 .. 10^6 nodes, nodes replayed per second.

Each rank runs FW ops, then BW ops; every ``comm_every`` BW ops launch an allreduce that joins all
ranks (arrivals + one transfer), then UPDATE. Planning (topological levels) and replay are timed
separately; both should grow linearly with the number of nodes.

    python bench/replay_speed.py [--sizes 8x1250,32x3125,128x8000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dpro.dag.graph import Graph, GraphBuilder
from dpro.sim.replay import plan_levels, replay


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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
