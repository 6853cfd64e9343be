"""A plain Horovod Keras job (``horovod.tensorflow.keras``, tf_keras) that knows nothing of dpro (used by tests).

    horovodrun -np 2 -H localhost:2 --gloo python hvd_keras_job.py [--steps 8]
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow.keras as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()

hvd.init()
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = tf.random.uniform((16 * args.steps, 8), seed=1)
y = tf.random.uniform((16 * args.steps,), maxval=2, dtype=tf.int32, seed=2)
model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
print(f"hvd.keras rank {hvd.rank()} of {hvd.size()} done", flush=True)
