"""Recorder overhead for Keras (MultiWorkerMirroredStrategy): recorded steps vs unrecorded ones in the same fit.

Each job is a 2-worker MWMS ``model.fit`` on loopback (1 thread per worker) with ``DproCallback`` recording the
middle block of steps. Blocks: warm-up, off (before the window), dpro (the window: TensorFlow's profiler runs),
off (after). A timing callback, first in the list, takes each step's wall time and the process's CPU time
(``time.process_time``: TensorFlow runs a step's ops on its own threads, so the training thread's CPU time says
little). The one-off cost at the window's end (profiler stop, XPlane parse, rank file) falls between two steps and
is reported on its own. ``--rounds`` jobs in a row; medians per round, then the median and spread of the rounds.

    python bench/tf_overhead.py [--rounds 3] [--block 15] [--width 16]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpro.io.load import interrupted_calls

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_keras as keras

    from dpro.plugins.tf import DproCallback

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    sys.path.insert(0, str(SCRIPTS))
    from keras_cnn import build_cnn, random_images

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_cnn(keras, args.width)
    block = args.block
    window = range(2 * block, 3 * block)
    total = 4 * block

    class Timer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int, float, float, float, float]] = []  # step, wall0, wall1, cpu0, cpu1

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            self._t = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.rows.append((batch, self._t[0], time.perf_counter(), self._t[1], time.process_time()))

    timer = Timer()
    model.fit(random_images(tf), steps_per_epoch=total, epochs=1, verbose=0,
              callbacks=[timer, DproCallback(run_dir=args.run_dir, steps=window)])
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    Path(args.out, f"worker-{index}.json").write_text(json.dumps({"rows": timer.rows, "block": block}))


def summarize(doc: dict) -> dict[str, float]:
    block, rows = doc["block"], {r[0]: r for r in doc["rows"]}

    def med(steps: range, what: int) -> float:
        return statistics.median((rows[s][what + 1] - rows[s][what]) * 1000.0 for s in steps)

    off = range(block + 1, 2 * block)
    off = [*off, *range(3 * block + 1, 4 * block)]   # the first step after the window waits for the close
    on = range(2 * block + 1, 3 * block)              # the window's first step starts the profiler
    wall_off = statistics.median((rows[s][2] - rows[s][1]) * 1000.0 for s in off)
    cpu_off = statistics.median((rows[s][4] - rows[s][3]) * 1000.0 for s in off)
    close_ms = (rows[3 * block][1] - rows[3 * block - 1][2]) * 1000.0
    return {"wall_off": wall_off, "wall_on": med(on, 1), "cpu_off": cpu_off, "cpu_on": med(on, 3),
            "close_ms": close_ms}


def one_job(args: argparse.Namespace, tmp: Path, rnd: int, attempts: int = 3) -> dict[str, float]:
    """One 2-worker job; a job whose worker TensorFlow's profiler killed while it stopped (``rank-<r>.busy.txt``
    in the run directory says so) runs again, up to ``attempts`` times."""
    for attempt in range(attempts):
        out = tmp / f"round{rnd}-{attempt}"
        failure = _run_workers(args, out)
        if failure is None:
            return summarize(json.loads((out / "worker-0.json").read_text()))
        if attempt + 1 == attempts or not interrupted_calls(out / "run"):
            raise RuntimeError(f"worker failed:\n{failure[-3000:]}")
        print("  (a worker died while stopping TensorFlow's profiler; running the job again)", flush=True)
    raise AssertionError("unreachable")


def _run_workers(args: argparse.Namespace, out: Path) -> str | None:
    """Run both workers writing into ``out``; the first failed worker's stderr, or None."""
    socks = [socket.socket() for _ in range(3)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    workers = [f"127.0.0.1:{p}" for p in ports[:2]]
    out.mkdir()
    procs = []
    for i in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", DPRO_TF_PORT=str(ports[2]),
                   TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--out", str(out), "--run-dir",
                                       str(out / "run"), "--block", str(args.block), "--width", str(args.width)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    failures = []
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            failures.append(err)
    return failures[0] if failures else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block", type=int, default=15, help="steps per block")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    print(f"2-worker MWMS Keras fit (keras_train CNN, width {args.width}), blocks of {args.block} steps: "
          f"warm-up, off, dpro, off; worker 0's medians", flush=True)
    head = (f"{'round':>5} {'off ms':>8} {'dpro ms':>8} {'wall +%':>8} {'off CPU ms':>10} {'dpro CPU ms':>11} "
            f"{'CPU +%':>7} {'close ms':>9}")
    print(head + "\n" + "-" * len(head), flush=True)
    walls, cpus = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            r = one_job(args, Path(tmp), rnd)
            wall, cpu = 100 * (r["wall_on"] / r["wall_off"] - 1), 100 * (r["cpu_on"] / r["cpu_off"] - 1)
            walls.append(wall)
            cpus.append(cpu)
            print(f"{rnd:>5} {r['wall_off']:>8.2f} {r['wall_on']:>8.2f} {wall:>+8.1f} {r['cpu_off']:>10.2f} "
                  f"{r['cpu_on']:>11.2f} {cpu:>+7.1f} {r['close_ms']:>9.0f}", flush=True)
    print(f"\nrecorded vs unrecorded steps: wall {statistics.median(walls):+.1f}% (range {min(walls):+.1f} .. "
          f"{max(walls):+.1f}), process CPU {statistics.median(cpus):+.1f}% (range {min(cpus):+.1f} .. "
          f"{max(cpus):+.1f}) over {args.rounds} jobs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
