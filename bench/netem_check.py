"""Check the emulated cluster network: TCP throughput and gloo all_reduce time per link rate.

For each rate, two hosts (dpro.testbed namespaces, tbf-limited links) run one rank each; the table
gives the single-stream TCP goodput from host 0 to host 1 and the median time of a 2-rank gloo
all_reduce per tensor size. The "loopback" row runs both ranks on one host (no link limit), the
baseline the limited rows compare with. Needs root; a delay above 0 needs the kernel's netem.

    python bench/netem_check.py [--rates 1gbit,10gbit] [--sizes-mb 1,8] [--iters 10] [--delay 0ms]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from dpro import testbed as tb


def worker(sizes_mb: list[float], iters: int) -> None:
    """One rank: per size, a warm-up then ``iters`` timed all_reduces; rank 0 prints JSON medians."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    medians = {}
    for mb in sizes_mb:
        tensor = torch.ones(int(mb * 1e6) // 4)
        dist.all_reduce(tensor)
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - t0)
        medians[str(mb)] = statistics.median(times)
    if dist.get_rank() == 0:
        print(json.dumps(medians), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def allreduce_times(cluster: tb.Cluster, ranks_per_host: int, sizes_mb: list[float], iters: int) -> dict[str, float]:
    world = ranks_per_host * len(cluster.hosts)
    argv = [sys.executable, __file__, "--worker", "--sizes-mb", ",".join(map(str, sizes_mb)), "--iters", str(iters)]
    results = tb.run_ranks(cluster, lambda rank: argv, ranks_per_host=ranks_per_host,
                           env_for_rank=lambda rank: tb.torch_rank_env(cluster, rank, world, ranks_per_host),
                           timeout=120)
    for rank, res in enumerate(results):
        if res.returncode != 0:
            raise SystemExit(f"rank {rank} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(results[0].stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="1gbit,10gbit")
    parser.add_argument("--sizes-mb", default="1,8")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--delay", default="0ms", help="one-way delay per host link (needs netem)")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of the TCP throughput test")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    if args.worker:
        worker(sizes, args.iters)
        return 0
    ok, why = tb.testbed_available()
    if not ok:
        print(f"cannot emulate a network here: {why}", file=sys.stderr)
        return 1
    print(f"2 hosts x 1 rank, gloo, 1 thread per rank, delay {args.delay}; median of {args.iters} all_reduces",
          flush=True)
    head = f"{'link':<10} {'TCP Gbit/s':>10} " + " ".join(f"{f'{mb:g} MB ms':>10}" for mb in sizes)
    print(head)
    print("-" * len(head))
    with tb.emulated_cluster(1) as cluster:
        times = allreduce_times(cluster, 2, sizes, args.iters)
    print(f"{'loopback':<10} {'-':>10} " + " ".join(f"{times[str(mb)] * 1e3:>10.2f}" for mb in sizes), flush=True)
    for rate in args.rates.split(","):
        with tb.emulated_cluster(2, tb.NetworkSpec(rate=rate, delay=args.delay)) as cluster:
            gbit = tb.measure_bandwidth(cluster, 0, 1, seconds=args.seconds) / 1e9
            times = allreduce_times(cluster, 1, sizes, args.iters)
        print(f"{rate:<10} {gbit:>10.3f} " + " ".join(f"{times[str(mb)] * 1e3:>10.2f}" for mb in sizes), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
