"""Recorder overhead: step time with dpro on vs off, and with torch.profiler on vs off, side by side in one run.

Two 2-rank gloo DDP jobs run the bundled models, one per profiler: in each, blocks of BLOCK steps recorded by the
profiler alternate with "off" blocks, so both see the same machine state. Each profiler has a job of its own because
torch.profiler's blocks, which export a trace each, slow the blocks after them: with all three modes rotating in one
job, dpro's mlp blocks measured +2.7 to +7.9%, against +0.4 to +0.7% with off and dpro blocks alone.
The table gives, per mode, the median step's wall time and the training thread's CPU time
(``time.thread_time``: what the machine's neighbours cannot inflate), the overhead relative to its job's "off"
blocks, and the spread of that overhead over the rounds (each round's median of a mode's block against its own
"off" block). "off" steps run with dpro's dormant DDP comm-hook wrapper in place once the first dpro block has run
(the real off-window cost after a window).

``--breakdown`` prices each recording mechanism (``dpro.plugins.torch.recorder.MECHANISMS``) instead: in one job the
recorder rotates through blocks with all mechanisms, with each one left out in turn, with none (the step hand-off
and the builder thread alone), and with BW timed by tensor hooks per module instead of gradient marks, against "off"
blocks; a second, identical DDP model with no hook at all ("built-in")
prices the dormant Python comm hook. A mechanism's cost is the all-mechanisms overhead minus the overhead without it.
First, in a 1-rank job (no other rank to share the cores with), ``hook_chain`` (32 tiny modules whose compute is next
to nothing) gives each mechanism's cost per event (per module forward, BW mark, gradient, bucket, optimizer step); each
bundled model's line then also shows its events per step times that cost, an estimate that the step-to-step noise of
the bigger models cannot blur.

    python bench/overhead.py [--models mlp,convnet,transformer,wide_mlp] [--rounds 10] [--breakdown]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BLOCK = 4
PROFILERS = ("dpro", "torch.profiler")  # each in a job of its own, its blocks alternating with "off" blocks
# --breakdown's dpro blocks; "tensor-bw": all mechanisms, BW from tensor hooks per module (backward_marks="tensors")
VARIANTS = ("all", "-forward", "-backward", "-grad_ready", "-comm", "-update", "none", "tensor-bw")
CARRY_BW = ("forward", "grad_ready")  # mechanisms BW is timed with: each is priced against "-backward"


def worker(models: list[str], rounds: int, out_dir: Path, profiler: str) -> None:
    """One job: blocks of "off" steps alternating with blocks recorded by ``profiler`` (dpro or torch.profiler);
    rank 0 writes each model's step times to ``out_dir/<profiler>-<model>.json``."""
    import json

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, schedule

    from dpro.plugins.torch import Profiler
    from dpro.plugins.torch.models import get_example

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    modes = ("off", profiler)
    for name in models:
        example = get_example(name)
        torch.manual_seed(0)
        model = DistributedDataParallel(example.build())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        warmup = BLOCK
        total = warmup + rounds * len(modes) * BLOCK
        mode_of = ["warmup"] * warmup + [modes[(i // BLOCK) % len(modes)] for i in range(total - warmup)]
        times: dict[str, list[tuple[int, float, float]]] = {m: [] for m in modes}  # (round, wall ms, CPU ms)
        if profiler == "dpro":
            recorder = Profiler(model, opt, run_dir=out_dir / f"dpro-{name}",
                                steps=[i for i, m in enumerate(mode_of) if m == "dpro"], total_steps=total)
        else:  # torch.profiler's cycle: skip the warm-up, then wait over an off block, run over its own block
            sched = schedule(skip_first=warmup, wait=BLOCK, warmup=1, active=BLOCK - 1, repeat=0)
            recorder = profile(activities=[ProfilerActivity.CPU], schedule=sched,
                               on_trace_ready=_exporter(out_dir / f"torch-{name}-{rank}.json"))
        with recorder as prof:
            for i in range(total):
                wall, cpu = _timed_step(example, model, opt, gen, prof.step)
                if mode_of[i] in times:
                    times[mode_of[i]].append(((i - warmup) // (len(modes) * BLOCK), wall, cpu))
        if rank == 0:
            (out_dir / f"{profiler}-{name}.json").write_text(json.dumps(times))
        del model, opt, prof, recorder  # free DDP before the process group goes
    dist.barrier()
    dist.destroy_process_group()


def breakdown_worker(models: list[str], rounds: int, out_dir: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dpro.plugins.torch.models import get_example
    from dpro.plugins.torch.recorder import MECHANISMS, TorchRecorder

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    modes = ("off", "built-in", *VARIANTS)
    mechanisms_of = {"all": MECHANISMS, "none": (), "tensor-bw": MECHANISMS}
    # BW hangs on the forward hooks (tensor marks) or on the gradient marks: leaving either out leaves BW out too
    mechanisms_of.update({f"-{m}": tuple(x for x in MECHANISMS if x != m and not (m in CARRY_BW and x == "backward"))
                          for m in MECHANISMS})
    rows = []
    for name in models:
        example = _hook_chain() if name == "hook_chain" else get_example(name)
        ddp_args = {} if name != "hook_chain" else {"bucket_cap_mb": 0.004}  # a bucket per few layers
        torch.manual_seed(0)
        model = DistributedDataParallel(example.build(), **ddp_args)
        torch.manual_seed(0)
        builtin = DistributedDataParallel(example.build(), **ddp_args)  # never recorded: DDP's own C++ allreduce
        opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, builtin)}
        gen = torch.Generator().manual_seed(rank)
        warmup = 2 * BLOCK
        total = warmup + rounds * len(modes) * BLOCK
        mode_of = ["warmup"] * warmup + [modes[(i // BLOCK) % len(modes)] for i in range(total - warmup)]
        window = [i for i, m in enumerate(mode_of) if m in VARIANTS]
        recorder = TorchRecorder(model, opts[id(model)], out_dir / f"breakdown-{name}", window, total_steps=total)
        times: dict[str, list[tuple[int, float, float]]] = {m: [] for m in modes}
        recorder.start()
        for i in range(total):
            if i in recorder.window and mode_of[i] != mode_of[i - 1]:
                # hooks are installed when a step opens (in the step() before it): put this block's in place
                recorder.suspend()
                recorder.mechanisms = frozenset(mechanisms_of[mode_of[i]])
                recorder.backward_marks = "tensors" if mode_of[i] == "tensor-bw" else "gradients"
                recorder.resume()
            net = builtin if mode_of[i] == "built-in" else model
            wall, cpu = _timed_step(example, net, opts[id(net)], gen, recorder.step)
            if mode_of[i] in times:
                times[mode_of[i]].append(((i - warmup) // (len(modes) * BLOCK), wall, cpu))
        recorder.close()
        builder_ms = recorder.build_cpu_s * 1000 / max(len(window), 1)
        start_ms = recorder._writer.header.get("window_start_ms", float("nan"))
        all_steps = {i for i in window if mode_of[i] == "all"}
        events = [row for row in recorder._writer.rows if row[5].get("step") in all_steps]
        per_step = {cat: sum(1 for row in events if row[1] == cat) / max(len(all_steps), 1) for cat in ("FW", "COMM")}
        per_step["BW"] = sum(1 for row in events if row[1] == "BW") / max(len(all_steps), 1)
        per_step["grads"] = sum(len(row[5].get("grads", ())) for row in events if row[1] == "BW") / max(
            len(all_steps), 1)
        rows.append((name, times, builder_ms, start_ms, per_step))
        del model, builtin, opts, recorder
    if rank == 0:
        print_breakdown(rows, out_dir / "per_event.json")
    dist.barrier()
    dist.destroy_process_group()


def _timed_step(example: Any, net: Any, opt: Any, gen: Any, *after: Callable[[], None]) -> tuple[float, float]:
    """One training step of ``net`` and the profilers' ``step()`` calls ``after`` it: (wall ms, training-thread CPU
    ms)."""
    import torch

    t0, c0 = time.perf_counter(), time.thread_time()
    x, y = example.batch(example.batch_size, gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    for step in after:
        step()
    return (time.perf_counter() - t0) * 1000, (time.thread_time() - c0) * 1000


def _hook_chain():  # noqa: ANN202 - an Example, built where torch is imported
    """32 tiny modules in a chain (16 Linear(16, 16) + ReLU, batch 4): the compute is next to nothing, so the step
    is the hooks' cost, and a mechanism's cost divided by its events per step is its cost per event."""
    import torch
    from torch import nn

    from dpro.plugins.torch.models import Example

    def build() -> nn.Module:
        return nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(16, 16), nn.ReLU())], nn.Linear(16, 10))

    def batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g)

    return Example("hook_chain", build, batch, 4)


def _cost(times: dict[str, list[tuple[int, float, float]]], mode: str, base: str, k: int) -> tuple[float, float, float]:
    """``mode``'s median minus ``base``'s in ms (column ``k``: 1 wall, 2 CPU), and the least and most of the rounds'."""
    def med(mode_: str, round_: int | None = None) -> float:
        return statistics.median(v[k] for v in times[mode_] if round_ is None or v[0] == round_)

    rounds = sorted({v[0] for v in times[base]} & {v[0] for v in times[mode]})
    per_round = [med(mode, r) - med(base, r) for r in rounds]
    return med(mode) - med(base), min(per_round), max(per_round)


def print_breakdown(rows: list[tuple[str, dict[str, list[tuple[int, float, float]]], float, float, dict[str, float]]],
                    per_event_file: Path) -> None:
    """Per model: what each mechanism costs the training thread per step (CPU ms, and % of the off step); hook_chain's
    costs per event are kept in ``per_event_file`` for the models measured after it."""
    import json

    from dpro.plugins.torch.recorder import MECHANISMS

    per_event: dict[str, float] = json.loads(per_event_file.read_text()) if per_event_file.exists() else {}
    for name, times, builder_ms, start_ms, per_step in rows:
        off_cpu = statistics.median(v[2] for v in times["off"])
        off_wall = statistics.median(v[1] for v in times["off"])
        print(f"\n{name}: off step {off_cpu:.2f} ms training-thread CPU, {off_wall:.2f} ms wall; "
              f"{len(times['off'])} steps per mode")
        head = (f"{'what':<44} {'CPU ms/step [rounds]':>26} {'% of step':>9} {'wall ms/step':>12}  "
                f"{'per event (hook_chain) / events x per-event cost':<48}")
        print(head)
        print("-" * len(head))

        def line(label: str, cpu: tuple[float, float, float], wall: float, note: str = "",
                 off_cpu: float = off_cpu) -> None:
            print(f"{label:<44} {f'{cpu[0]:+.3f} [{cpu[1]:+.3f}..{cpu[2]:+.3f}]':>26} "
                  f"{100 * cpu[0] / off_cpu:>+9.1f} {wall:>+12.3f}{note}")

        line("recording, all mechanisms", _cost(times, "all", "off", 2), _cost(times, "all", "off", 1)[0])
        for mech in MECHANISMS:
            without = "-forward" if mech == "forward" else f"-{mech}"
            base = "-backward" if mech in CARRY_BW else "all"  # alone: BW marks hang on its hooks
            cpu = _cost(times, base, without, 2)
            events = _events_per_step(mech, per_step)
            if name == "hook_chain" and events:
                per_event[mech] = cpu[0] * 1000.0 / events
            estimate = (f"  ~{per_event[mech] * events / 1000.0:.3f} ms from {events:g} x {per_event[mech]:.1f} us"
                        if mech in per_event and name != "hook_chain" else
                        f"  {cpu[0] * 1000.0 / events:.1f} us per event ({events:g}/step)" if events else "")
            line(f"  {mech}" + (" (without backward)" if mech in CARRY_BW else ""), cpu,
                 _cost(times, base, without, 1)[0], estimate)
        line("  BW from tensor hooks instead (per module)", _cost(times, "tensor-bw", "all", 2),
             _cost(times, "tensor-bw", "all", 1)[0])
        line("  steps alone (no hooks: log, hand-off)", _cost(times, "none", "off", 2),
             _cost(times, "none", "off", 1)[0])
        line("dormant Python comm hook vs DDP built-in", _cost(times, "off", "built-in", 2),
             _cost(times, "off", "built-in", 1)[0])
        if name == "hook_chain":
            per_event_file.write_text(json.dumps(per_event))
        print(f"{'builder thread (rows + journal), off the training thread':<58} CPU {builder_ms:.3f} ms/step")
        print(f"{'window start (clock exchange, probe), once per run':<58} wall {start_ms:.1f} ms")
    sys.stdout.flush()


def _events_per_step(mechanism: str, per_step: dict[str, float]) -> float:
    """How many times a mechanism's hook runs in a step: module forwards (a pre and a post hook each), BW events (one
    mark per backward pass; with tensor hooks, one per recorded module), gradients, buckets, the optimizer step."""
    return {"forward": per_step["FW"], "backward": per_step["BW"], "grad_ready": per_step["grads"],
            "comm": per_step["COMM"], "update": 1.0}.get(mechanism, 0.0)


def _exporter(path: Path):  # noqa: ANN202 - torch.profiler's callback type
    return lambda prof: prof.export_chrome_trace(str(path))


def _overhead(times: dict[str, list[tuple[int, float, float]]], mode: str, k: int) -> tuple[float, float, float]:
    """The mode's median against "off" (%, column ``k``: 1 wall, 2 CPU), and the least and most of the rounds'."""
    def med(mode_: str, round_: int | None = None) -> float:
        return statistics.median(v[k] for v in times[mode_] if round_ is None or v[0] == round_)

    rounds = sorted({v[0] for v in times["off"]} & {v[0] for v in times[mode]})
    per_round = [100 * (med(mode, r) / med("off", r) - 1) for r in rounds]
    return 100 * (med(mode) / med("off") - 1), min(per_round), max(per_round)


def print_table(models: list[str], out_dir: Path) -> None:
    """One line per model: dpro's job (off and dpro blocks) and torch.profiler's job (off and torch.profiler blocks),
    each profiler against the off blocks of its own job."""
    import json

    head = (f"{'model':<12} {'steps/mode':>10} {'off ms':>8} {'dpro ms':>8} {'dpro +% wall [rounds]':>24} "
            f"{'off CPU ms':>10} {'dpro CPU ms':>11} {'dpro +% CPU [rounds]':>24} {'torch +% wall':>13} "
            f"{'torch +% CPU':>12}")
    print(head)
    print("-" * len(head))
    for name in models:
        times = json.loads((out_dir / f"dpro-{name}.json").read_text())
        torch_times = json.loads((out_dir / f"torch.profiler-{name}.json").read_text())

        def ms(mode: str, k: int, times: dict = times) -> float:
            return statistics.median(v[k] for v in times[mode])

        wall, cpu = _overhead(times, "dpro", 1), _overhead(times, "dpro", 2)
        twall, tcpu = _overhead(torch_times, "torch.profiler", 1)[0], _overhead(torch_times, "torch.profiler", 2)[0]
        print(f"{name:<12} {len(times['off']):>10} {ms('off', 1):>8.2f} {ms('dpro', 1):>8.2f} "
              f"{f'{wall[0]:+.1f} [{wall[1]:+.1f}..{wall[2]:+.1f}]':>24} {ms('off', 2):>10.2f} {ms('dpro', 2):>11.2f} "
              f"{f'{cpu[0]:+.1f} [{cpu[1]:+.1f}..{cpu[2]:+.1f}]':>24} {twall:>+13.1f} {tcpu:>+12.1f}")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,convnet,transformer,wide_mlp")
    parser.add_argument("--rounds", type=int, default=10, help="rotations of the three modes")
    parser.add_argument("--breakdown", action="store_true", help="price each recording mechanism (see above)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profiler", default="dpro", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.models.split(",")
    if args.worker:
        if args.breakdown:
            breakdown_worker(models, args.rounds, Path(args.out))
        else:
            worker(models, args.rounds, Path(args.out), args.profiler)
        return 0
    if args.breakdown:
        print(f"2-rank gloo DDP, 1 thread per rank, blocks of {BLOCK} steps rotating "
              f"{' -> '.join(('off', 'built-in', *VARIANTS))}, {args.rounds} rounds; median step time (wall, and the "
              "training thread's CPU time) per mode", flush=True)
    else:
        print(f"2-rank gloo DDP, 1 thread per rank; one job per profiler, blocks of {BLOCK} steps alternating off -> "
              f"profiler, {args.rounds} rounds; median step time (wall, and the training thread's CPU time) per mode",
              flush=True)
    with tempfile.TemporaryDirectory() as out:
        if args.breakdown:
            jobs = [(1, "hook_chain", 3 * args.rounds, ""), (2, args.models, args.rounds, "")]
        else:
            jobs = [(2, args.models, args.rounds, profiler) for profiler in PROFILERS]
        for ranks, models_arg, rounds, profiler in jobs:
            status = _job(ranks, models_arg, rounds, out, args.breakdown, profiler)
            if status:
                return status
        if not args.breakdown:
            print_table(models, Path(out))
        return 0


def _job(ranks: int, models: str, rounds: int, out: str, breakdown: bool, profiler: str) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", __file__,
           "--worker", "--models", models, "--rounds", str(rounds), "--out", out,
           *(["--breakdown"] if breakdown else ["--profiler", profiler])]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.strip() and not line.startswith("USDT:") and "Warning" not in line and "_warn_once" not in line:
            print(line, end="", flush=True)  # (torch.profiler's start/stop notes and cycle warnings, per rank)
    return proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
