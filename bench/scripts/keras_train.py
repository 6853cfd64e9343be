"""An unmodified Keras training script (it never imports dpro), for benches: a small image CNN with pooling,
dropout and Adam under MultiWorkerMirroredStrategy (tf_keras). ``dpro-launch --engine tf -np 2 -H localhost:2
--profile 10:30 python bench/scripts/keras_train.py``.
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--width", type=int, default=16)
parser.add_argument("--threads", type=int, default=1, help="TensorFlow's inter- and intra-op threads (0: its default)")
args = parser.parse_args()

if args.threads:
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = keras.Sequential([
        keras.Input(shape=(24, 24, 3)),
        keras.layers.Conv2D(args.width, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(2 * args.width, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
images = tf.random.uniform((512, 24, 24, 3), seed=3)
labels = tf.random.uniform((512,), maxval=10, dtype=tf.int32, seed=4)
data = tf.data.Dataset.from_tensor_slices((images, labels)).batch(32).repeat()
model.fit(data, steps_per_epoch=args.steps, epochs=1, verbose=0)
