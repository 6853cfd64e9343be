"""A Keras model of nested blocks (functional sub-models) fit under MultiWorkerMirroredStrategy with DproCallback
(used by tests: layer paths, activation bytes, recompute applied from a config).

    TF_CONFIG=... python tf_blocks_fit.py --run-dir DIR [--steps 12] [--profile 5:9] [--config FILE] [--keras3]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

parser = argparse.ArgumentParser()
parser.add_argument("--run-dir", required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--profile", default="5:9")
parser.add_argument("--config", default=None)
parser.add_argument("--keras3", action="store_true")
args = parser.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "0" if args.keras3 else "1")

import tensorflow as tf  # noqa: E402

if args.keras3:
    import keras
else:
    import tf_keras as keras

from dpro.plugins.tf import DproCallback  # noqa: E402

BATCH = 32
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
strategy = tf.distribute.MultiWorkerMirroredStrategy() if "TF_CONFIG" in os.environ else tf.distribute.get_strategy()


def block(name: str, wide: int, out: int):
    inputs = keras.Input((24,) if name == "block1" else (out,))
    x = keras.layers.Dense(wide, activation="relu", name=f"{name}_wide")(inputs)
    x = keras.layers.Dense(out, activation="relu", name=f"{name}_out")(x)
    return keras.Model(inputs, x, name=name)


with strategy.scope():
    inputs = keras.Input((24,))
    x = block("block1", 512, 32)(inputs)
    x = block("block2", 256, 32)(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    model = keras.Model(inputs, outputs, name="blocks")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
x = tf.random.uniform((512, 24), seed=1)
y = tf.random.uniform((512, 4), seed=2)
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
start, stop = (int(v) for v in args.profile.split(":"))
model.fit(ds, steps_per_epoch=args.steps, epochs=1, verbose=0,
          callbacks=[DproCallback(run_dir=args.run_dir, steps=range(start, stop), config=args.config,
                                  batch_size=BATCH)])
print("done", flush=True)
