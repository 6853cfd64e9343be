"""A custom MultiWorkerMirroredStrategy training loop (``strategy.run`` in a ``tf.function``) recording itself with
``dpro.plugins.tf.Profiler`` (used by tests). Without TF_CONFIG it runs one worker.

    TF_CONFIG=... python tf_custom_loop.py --run-dir DIR [--steps 14] [--profile 5:10] [--keras3]
"""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--run-dir", required=True)
parser.add_argument("--steps", type=int, default=14)
parser.add_argument("--profile", default="5:10")
parser.add_argument("--keras3", action="store_true")
args = parser.parse_args()

os.environ["TF_USE_LEGACY_KERAS"] = "0" if args.keras3 else "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

if args.keras3:
    import keras
else:
    import tf_keras as keras

from dpro.plugins.tf import Profiler  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
strategy = tf.distribute.MultiWorkerMirroredStrategy() if "TF_CONFIG" in os.environ else tf.distribute.get_strategy()
GLOBAL_BATCH = 32
with strategy.scope():
    model = keras.Sequential([
        keras.Input(shape=(12,)),
        keras.layers.Dense(48, activation="relu", name="hidden1"),
        keras.layers.Dense(48, activation="tanh", name="hidden2"),
        keras.layers.Dense(4, name="head"),
    ], name="mlp")
    optimizer = keras.optimizers.SGD(0.05)
    loss_of = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

x = tf.random.uniform((512, 12), seed=5)
y = tf.random.uniform((512,), maxval=4, dtype=tf.int32, seed=6)
data = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH))


def replica_step(features: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    with tf.GradientTape() as tape:
        per_example = loss_of(labels, model(features, training=True))
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


@tf.function
def train_step(batch: tuple) -> tf.Tensor:
    losses = strategy.run(replica_step, args=batch)
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


start, stop = (int(v) for v in args.profile.split(":"))
batches = iter(data)
with Profiler(model, run_dir=args.run_dir, steps=range(start, stop), optimizer=optimizer,
              strategy=strategy) as prof:
    for _ in range(args.steps):
        train_step(next(batches)).numpy()
        prof.step()
print("done", flush=True)
