"""A 2-worker MultiWorkerMirroredStrategy tf_keras job recording itself with DproCallback (used by tests).

    TF_CONFIG=... python tf_keras_job.py --run-dir DIR [--steps 16] [--profile 6:12] [--bytes-per-pack 0]
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--run-dir", required=True)
parser.add_argument("--steps", type=int, default=16)
parser.add_argument("--profile", default="6:12")
parser.add_argument("--bytes-per-pack", type=int, default=0)
parser.add_argument("--keras3", action="store_true")
args = parser.parse_args()

if args.keras3:
    import keras
else:
    import tf_keras as keras

from dpro.plugins.tf import DproCallback  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
if "TF_CONFIG" in os.environ:
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=args.bytes_per_pack)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
else:
    strategy = tf.distribute.get_strategy()
with strategy.scope():
    model = keras.Sequential([
        keras.Input(shape=(16, 16, 3)),
        keras.layers.Conv2D(8, 3, activation="relu", name="conv1"),
        keras.layers.BatchNormalization(name="bn1"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(64, activation="relu", name="fc1"),
        keras.layers.Dense(10, name="fc2"),
    ], name="convnet")
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = tf.random.uniform((256, 16, 16, 3), seed=1)
y = tf.random.uniform((256,), maxval=10, dtype=tf.int32, seed=2)
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
start, stop = (int(v) for v in args.profile.split(":"))
model.fit(ds, steps_per_epoch=args.steps, epochs=1, verbose=0,
          callbacks=[DproCallback(run_dir=args.run_dir, steps=range(start, stop))])
print("done", flush=True)
