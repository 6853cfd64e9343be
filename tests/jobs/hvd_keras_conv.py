"""An unmodified Horovod Keras training script of a small 1-D convolutional net (it never imports dpro).

    horovodrun -np 2 -H localhost:2 --gloo python hvd_keras_conv.py [--steps 60] [--channels 64]

One ``model.fit`` epoch of ``--steps`` batches of synthetic sequences; bench/horovod_overhead.py --keras runs it.
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow.keras as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--channels", type=int, default=64)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--length", type=int, default=256)
args = parser.parse_args()

hvd.init()
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
c = args.channels
model = keras.Sequential([
    keras.Input((args.length, 8)),
    keras.layers.Conv1D(c, 5, padding="same", activation="relu"),
    keras.layers.Conv1D(c, 5, padding="same", activation="relu"),
    keras.layers.Conv1D(2 * c, 5, padding="same", strides=2, activation="relu"),
    keras.layers.Conv1D(2 * c, 3, padding="same", activation="relu"),
    keras.layers.GlobalAveragePooling1D(),
    keras.layers.Dense(256, activation="relu"),
    keras.layers.Dense(10),
])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
n = args.batch * args.steps
x = tf.random.stateless_normal((n, args.length, 8), seed=(hvd.rank(), 1))
y = tf.random.stateless_uniform((n,), seed=(hvd.rank(), 2), maxval=10, dtype=tf.int32)
model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
print(f"hvd.keras rank {hvd.rank()} of {hvd.size()} done", flush=True)
