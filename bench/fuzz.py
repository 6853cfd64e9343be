"""Fuzz campaign: mutated run directories, journals, Horovod timelines, Kineto traces, configs and ``--set`` values,
each given to the real command (``dpro info/analyze/whatif/optimize``, ``dpro-launch --apply``) in its own
process, under a memory limit and a timeout, in a sandbox whose every file is checked afterwards.

Seeds: the hand-written runs of tests/run_builder.py (torch, a crashed rank's journal, Horovod with its
timeline), the recorded MXNet run and the two Kineto traces in tests/data, an applied config, and (unless
``--no-record``) a 2-rank plain DDP job and a 2-rank Horovod job recorded here by ``dpro-launch`` and a
TensorFlow profile (``dpro import-xplane``) of a tf_keras fit.

Outcomes, per seed: ``ok`` (accepted), ``refused`` (one ``dpro: error:`` line, exit 2), and the failures:
``traceback``, ``hang`` (over ``--timeout``), ``memory`` (MemoryError or killed at ``--memory-mb``),
``other`` (any other exit), ``wrote-outside`` (a file outside the run directory changed). Failures are written
to ``--findings`` as corpus lines (tests/data/fuzz/corpus.jsonl takes them as regression cases).

    python bench/fuzz.py [--inputs 600] [--seed 1] [--timeout 30] [--memory-mb 1024] [--jobs 2] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from fuzzing import (  # noqa: E402
    SEEDS,
    Mutation,
    Seed,
    apply_mutation,
    cli_argv,
    imported_run,
    random_mutation,
    tree_state,
)
from measured import measured_argv, read_measurement  # noqa: E402

OUTCOMES = ("ok", "refused", "traceback", "hang", "memory", "other", "wrote-outside")
FAILURES = frozenset(OUTCOMES[2:])


@dataclass
class Result:
    seed: str
    mutation: Mutation
    outcome: str
    wall_s: float
    max_rss_mb: float
    said: str


def record_seeds(work: Path, python: str) -> dict[str, Path]:
    """Real recordings to mutate: a plain DDP job and (if Horovod is installed) a Horovod job."""
    jobs = ROOT / "tests" / "jobs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(python).parent}{os.pathsep}{os.environ['PATH']}"}
    out = {}
    for name, argv in (("recorded-torch", ["-np", "2", "python", str(jobs / "plain_ddp.py"), "--steps", "8"]),
                       ("recorded-horovod", ["-np", "2", "--engine", "horovod", "python",
                                             str(jobs / "plain_hvd.py"), "--steps", "8"])):
        run = work / name
        proc = subprocess.run([python, "-m", "dpro.launch", "--profile", "2:6", "--run-dir", str(run), *argv],
                              env=env, cwd=work, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0:
            out[name] = run
        else:
            print(f"# could not record {name} (left out): {proc.stderr.strip()[-300:]}", file=sys.stderr)
    logs = work / "tf-logs"
    proc = subprocess.run([python, str(jobs / "tf_profiled_fit.py"), str(logs)], cwd=work, capture_output=True,
                          env={**env, "CUDA_VISIBLE_DEVICES": ""}, text=True, timeout=300)
    profiles = sorted(logs.rglob("*.xplane.pb"))
    if proc.returncode == 0 and profiles:
        out["recorded-xplane"] = profiles[0]
    else:
        print(f"# could not record a TensorFlow profile (left out): {proc.stderr.strip()[-300:]}", file=sys.stderr)
    return out


def run_one(seed: Seed, built: Path, mutation: Mutation, sandbox: Path, python: str, pick: int,
            timeout_s: float, memory_mb: int) -> Result:
    """Copy the seed into ``sandbox``, mutate it, run the command, classify what happened."""
    outside, home, cwd, tmp = (sandbox / d for d in ("outside", "home", "cwd", "tmp"))
    for d in (outside, home, cwd, tmp):
        d.mkdir(parents=True)
    (outside / "keep.txt").write_text("must stay as it is")
    folder = sandbox / "input"
    if built.is_dir() and seed.kind == "run":
        seed_path = Path(shutil.copytree(built, folder / built.name, symlinks=True))
    else:
        folder.mkdir()
        seed_path = Path(shutil.copy(built, folder / built.name))
    extra = apply_mutation(seed_path, mutation, outside)
    run_root = seed_path if seed.kind == "run" else imported_run(seed_path) if seed.kind == "xplane" else None
    before = tree_state(sandbox, skip=run_root)
    argv = cli_argv(seed, seed_path, extra, python, pick)
    env = {"PATH": f"{Path(python).parent}{os.pathsep}/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmp),
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "DPRO_RUN_DIR": str(cwd / "dpro-runs"),
           # importing Keras (dpro import-xplane) writes its settings file, KERAS_HOME/keras.json, when there is none
           "KERAS_HOME": str(sandbox.parent / "keras-home"), **dict(seed.env)}
    rss_file = sandbox.parent / f"{sandbox.name}.measured.json"
    capped = measured_argv(python, rss_file, argv, limit_bytes=memory_mb << 20)
    start = time.perf_counter()
    proc = subprocess.Popen(capped, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stderr.read()), daemon=True)
    reader.start()
    status, usage, hung = _wait(proc.pid, start + timeout_s)
    reader.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    measured = read_measurement(rss_file)
    rss_mb = measured["rss_mb"] if measured else usage.ru_maxrss / 1024.0
    rss_file.unlink(missing_ok=True)
    err = b"".join(chunks)
    said = err.decode("utf-8", "replace")
    outcome = _outcome(proc.returncode, said, hung)
    last = said.strip().splitlines()[-1] if said.strip() else ""
    after = tree_state(sandbox, skip=run_root)
    if outcome in ("ok", "refused") and after != before:
        outcome = "wrote-outside"
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        last = f"changed {', '.join(changed[:5])}" + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return Result(seed.name, mutation, outcome, wall, rss_mb, last[:300])


def _wait(pid: int, deadline: float) -> tuple[int, resource.struct_rusage, bool]:
    """Wait for ``pid`` (killing its process group at ``deadline``); its status, its own resource usage, and
    whether it was killed for running too long."""
    hung = False
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, usage, hung
        if not hung and time.perf_counter() > deadline:
            os.killpg(pid, 9)
            hung = True
        time.sleep(0.01)


def _outcome(rc: int, said: str, hung: bool) -> str:
    lines = said.strip().splitlines()
    if hung:
        return "hang"
    if "MemoryError" in said or rc in (-9, 137):  # 137: killed (128 + SIGKILL)
        return "memory"
    if "Traceback (most recent call last)" in said:
        return "traceback"
    if rc == 0:
        return "ok"
    if rc == 2 and lines and lines[-1].startswith(("dpro: error: ", "dpro-launch: error: ")):
        return "refused"
    return "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=600, help="mutated inputs in all (default 600)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before an input counts as a hang")
    parser.add_argument("--memory-mb", type=int, default=1024, help="address-space limit per process (MB)")
    parser.add_argument("--jobs", type=int, default=2, help="inputs run at once (default 2)")
    parser.add_argument("--no-record", action="store_true", help="only the hand-written and stored seeds")
    parser.add_argument("--findings", type=Path, default=Path("fuzz-findings.jsonl"),
                        help="where failing inputs are written, one corpus line each")
    args = parser.parse_args()
    python = sys.executable
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="dpro-fuzz-") as tmp:
        work = Path(tmp)
        seeds: dict[str, tuple[Seed, Path]] = {}
        for name, seed in SEEDS.items():
            seeds[name] = (seed, seed.build(work / "seeds" / name))
        if not args.no_record:
            base = SEEDS["torch-run"]
            for name, path in record_seeds(work, python).items():
                kind = "xplane" if name == "recorded-xplane" else "run"
                seeds[name] = (Seed(name, base.build, kind, base.commands), path)
        plan = []
        names = sorted(seeds)
        for i in range(args.inputs):
            name = names[i % len(names)]
            seed, built = seeds[name]
            plan.append((i, seed, built, random_mutation(rng, built, seed), rng.randrange(8)))
        print(f"# {len(plan)} inputs over {len(names)} seeds ({', '.join(names)}); {args.jobs} at once, "
              f"{args.timeout:.0f} s and {args.memory_mb} MB each", file=sys.stderr)
        results: list[Result] = []
        t0 = time.perf_counter()

        def one(item: tuple) -> Result:
            i, seed, built, mutation, pick = item
            sandbox = work / "cases" / f"{i:05d}"
            try:
                return run_one(seed, built, mutation, sandbox, python, pick, args.timeout, args.memory_mb)
            except OSError as err:  # the harness could not start the input (e.g. an argument too long): say so
                return Result(seed.name, mutation, "other", 0.0, 0.0, f"not run: {err}")
            finally:
                shutil.rmtree(sandbox, ignore_errors=True)

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for n, result in enumerate(pool.map(one, plan), 1):
                results.append(result)
                if result.outcome in FAILURES:
                    print(f"! {result.outcome}: {result.seed} {json.dumps(result.mutation.to_json())[:200]} -> "
                          f"{result.said}", file=sys.stderr)
                if n % 50 == 0 or n == len(plan):
                    print(f"# {n}/{len(plan)} inputs, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    report(results)
    failures = [r for r in results if r.outcome in FAILURES]
    if failures:
        with args.findings.open("a") as f:
            for r in failures:
                f.write(json.dumps({"seed": r.seed, "mutation": r.mutation.to_json(),
                                    "found": f"{r.outcome}: {r.said}"}) + "\n")
        print(f"\n{len(failures)} failing input(s) appended to {args.findings}")
    return 1 if failures else 0


def report(results: list[Result]) -> None:
    by_seed: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        by_seed[r.seed][r.outcome] += 1
    header = ["seed", "inputs", *OUTCOMES, "max wall s", "max RSS MB"]
    rows = []
    for name in sorted(by_seed) + ["all"]:
        mine = [r for r in results if name in ("all", r.seed)]
        counts = Counter(r.outcome for r in mine)
        rows.append([name, str(len(mine)), *(str(counts[o]) for o in OUTCOMES),
                     f"{max(r.wall_s for r in mine):.1f}", f"{max(r.max_rss_mb for r in mine):.0f}"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    sys.exit(main())
