"""Recorder overhead: step time with dpro on vs off vs torch.profiler, side by side in one run.

Runs a 2-rank gloo DDP job per bundled model. Within one job the three modes rotate in blocks of
BLOCK steps (off -> dpro -> torch.profiler -> off ...), so all three see the same machine state;
the table gives the median step time of each mode and the overhead relative to "off".
"off" steps run with dpro's dormant DDP comm-hook wrapper in place (the real off-window cost).

    python bench/overhead.py [--models mlp,convnet,transformer,wide_mlp] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 4
MODES = ("off", "dpro", "torch.profiler")


def worker(models: list[str], rounds: int, out_dir: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, schedule

    from dpro.plugins.torch import Profiler
    from dpro.plugins.torch.models import get_example

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for name in models:
        example = get_example(name)
        torch.manual_seed(0)
        model = DistributedDataParallel(example.build())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        warmup = BLOCK
        total = warmup + rounds * len(MODES) * BLOCK
        mode_of = ["warmup"] * warmup + [MODES[(i // BLOCK) % len(MODES)] for i in range(total - warmup)]
        dpro_steps = [i for i, m in enumerate(mode_of) if m == "dpro"]
        # torch.profiler's cycle: skip the warm-up, then wait over off+dpro blocks, run over its own block.
        sched = schedule(skip_first=warmup, wait=2 * BLOCK, warmup=1, active=BLOCK - 1, repeat=0)
        trace_path = out_dir / f"torch-{name}-{rank}.json"
        times: dict[str, list[float]] = {m: [] for m in MODES}
        with Profiler(model, opt, run_dir=out_dir / f"dpro-{name}", steps=dpro_steps, total_steps=total) as prof, \
                profile(activities=[ProfilerActivity.CPU], schedule=sched,
                        on_trace_ready=_exporter(trace_path)) as tprof:
            for i in range(total):
                t0 = time.perf_counter()
                x, y = example.batch(example.batch_size, gen)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                prof.step()
                tprof.step()
                if mode_of[i] in times:
                    times[mode_of[i]].append((time.perf_counter() - t0) * 1000)
        rows.append((name, {m: statistics.median(v) for m, v in times.items()}, len(times["off"])))
        del model, opt, prof, tprof  # free DDP before the process group goes
    if rank == 0:
        print_table(rows)
    dist.barrier()
    dist.destroy_process_group()


def _exporter(path: Path):  # noqa: ANN202 - torch.profiler's callback type
    return lambda prof: prof.export_chrome_trace(str(path))


def print_table(rows: list[tuple[str, dict[str, float], int]]) -> None:
    head = (f"{'model':<12} {'steps/mode':>10} {'off ms':>9} {'dpro ms':>9} {'dpro +%':>8} "
            f"{'torch.prof ms':>14} {'torch +%':>9}")
    print(head)
    print("-" * len(head))
    for name, med, n in rows:
        off = med["off"]
        print(f"{name:<12} {n:>10} {off:>9.2f} {med['dpro']:>9.2f} {100 * (med['dpro'] / off - 1):>+8.1f} "
              f"{med['torch.profiler']:>14.2f} {100 * (med['torch.profiler'] / off - 1):>+9.1f}")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,convnet,transformer,wide_mlp")
    parser.add_argument("--rounds", type=int, default=10, help="rotations of the three modes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.models.split(",")
    if args.worker:
        worker(models, args.rounds, Path(args.out))
        return 0
    print(f"2-rank gloo DDP, 1 thread per rank, blocks of {BLOCK} steps rotating {' -> '.join(MODES)}, "
          f"{args.rounds} rounds; median step time per mode", flush=True)
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               "--worker", "--models", args.models, "--rounds", str(args.rounds), "--out", out]
        return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
