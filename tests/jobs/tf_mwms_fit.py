"""A plain Keras (tf_keras) MultiWorkerMirroredStrategy job that knows nothing of dpro.

Each worker prints ``TF_WORKER <json>`` (its task index, the cluster, OMP_NUM_THREADS) and, with ``--out DIR``,
writes the same JSON to ``DIR/worker-<index>.json``; then it fits a tiny Conv2D + Dense model on random data
for ``--steps`` steps. ``--fail-worker I --fail-step S`` makes worker I exit with status 3 at step S (S < 0:
before it joins the cluster, so that the other workers wait for it until they are stopped).

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]}, "task": {"type": "worker",
    "index": 0}}' python tf_mwms_fit.py   # and index 1 in a second shell
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--fail-worker", type=int, default=None)
    parser.add_argument("--fail-step", type=int, default=3, help="< 0: before joining the cluster")
    parser.add_argument("--tag", default="", help="a word to find the processes by (tests)")
    return parser.parse_args()


def report(out: Path | None) -> int:
    """Print (and write) this worker's view of the cluster; returns its task index."""
    tf_config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    index = int(tf_config.get("task", {}).get("index", 0))
    doc = {"index": index, "task": tf_config.get("task"), "cluster": tf_config.get("cluster"),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "pid": os.getpid()}
    print("TF_WORKER " + json.dumps(doc, sort_keys=True), flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"worker-{index}.json").write_text(json.dumps(doc))
    return index


def dataset(batch: int) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=(256,)).astype("int64")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return data.with_options(options)


class FailAt(keras.callbacks.Callback):
    """Exit with status 3 at the start of step ``step`` (a worker that crashes mid-training)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if batch == self.step:
            print(f"worker failing at step {batch}", flush=True)
            os._exit(3)


def main() -> None:
    args = parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    index = report(args.out)
    if args.fail_worker == index and args.fail_step < 0:
        print("worker failing before it joins the cluster", flush=True)
        raise SystemExit(3)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([
            keras.layers.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [FailAt(args.fail_step)] if args.fail_worker == index and args.fail_step >= 0 else []
    model.fit(dataset(args.batch), epochs=1, steps_per_epoch=args.steps, verbose=0, callbacks=callbacks)
    print(f"worker {index} done: {args.steps} steps on {strategy.num_replicas_in_sync} replicas", flush=True)


if __name__ == "__main__":
    main()
