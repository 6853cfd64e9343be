"""Recorder overhead: step time with dpro on vs off vs torch.profiler, side by side in one run.

Runs a 2-rank gloo DDP job per bundled model. Within one job the three modes rotate in blocks of
BLOCK steps (off -> dpro -> torch.profiler -> off ...), so all three see the same machine state;
the table gives, per mode, the median step's wall time and the training thread's CPU time
(``time.thread_time``: what the machine's neighbours cannot inflate), the overhead relative to "off", and the
spread of that overhead over the rounds (each round's median of a mode's block against its own "off" block).
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
        times: dict[str, list[tuple[int, float, float]]] = {m: [] for m in MODES}  # (round, wall ms, CPU ms)
        with Profiler(model, opt, run_dir=out_dir / f"dpro-{name}", steps=dpro_steps, total_steps=total) as prof, \
                profile(activities=[ProfilerActivity.CPU], schedule=sched,
                        on_trace_ready=_exporter(trace_path)) as tprof:
            for i in range(total):
                t0, c0 = time.perf_counter(), time.thread_time()
                x, y = example.batch(example.batch_size, gen)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                prof.step()
                tprof.step()
                if mode_of[i] in times:
                    times[mode_of[i]].append(((i - warmup) // (len(MODES) * BLOCK), (time.perf_counter() - t0) * 1000,
                                              (time.thread_time() - c0) * 1000))
        rows.append((name, times))
        del model, opt, prof, tprof  # free DDP before the process group goes
    if rank == 0:
        print_table(rows)
    dist.barrier()
    dist.destroy_process_group()


def _exporter(path: Path):  # noqa: ANN202 - torch.profiler's callback type
    return lambda prof: prof.export_chrome_trace(str(path))


def _overhead(times: dict[str, list[tuple[int, float, float]]], mode: str, k: int) -> tuple[float, float, float]:
    """The mode's median against "off" (%, column ``k``: 1 wall, 2 CPU), and the least and most of the rounds'."""
    def med(mode_: str, round_: int | None = None) -> float:
        return statistics.median(v[k] for v in times[mode_] if round_ is None or v[0] == round_)

    rounds = sorted({v[0] for v in times["off"]} & {v[0] for v in times[mode]})
    per_round = [100 * (med(mode, r) / med("off", r) - 1) for r in rounds]
    return 100 * (med(mode) / med("off") - 1), min(per_round), max(per_round)


def print_table(rows: list[tuple[str, dict[str, list[tuple[int, float, float]]]]]) -> None:
    head = (f"{'model':<12} {'steps/mode':>10} {'off ms':>8} {'dpro ms':>8} {'dpro +% wall [rounds]':>24} "
            f"{'off CPU ms':>10} {'dpro CPU ms':>11} {'dpro +% CPU [rounds]':>24} {'torch +% wall':>13} "
            f"{'torch +% CPU':>12}")
    print(head)
    print("-" * len(head))
    for name, times in rows:
        def ms(mode: str, k: int, times: dict = times) -> float:
            return statistics.median(v[k] for v in times[mode])

        wall, cpu = _overhead(times, "dpro", 1), _overhead(times, "dpro", 2)
        twall, tcpu = _overhead(times, "torch.profiler", 1)[0], _overhead(times, "torch.profiler", 2)[0]
        print(f"{name:<12} {len(times['off']):>10} {ms('off', 1):>8.2f} {ms('dpro', 1):>8.2f} "
              f"{f'{wall[0]:+.1f} [{wall[1]:+.1f}..{wall[2]:+.1f}]':>24} {ms('off', 2):>10.2f} {ms('dpro', 2):>11.2f} "
              f"{f'{cpu[0]:+.1f} [{cpu[1]:+.1f}..{cpu[2]:+.1f}]':>24} {twall:>+13.1f} {tcpu:>+12.1f}")
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
          f"{args.rounds} rounds; median step time (wall, and the training thread's CPU time) per mode", flush=True)
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               "--worker", "--models", args.models, "--rounds", str(args.rounds), "--out", out]
        return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
