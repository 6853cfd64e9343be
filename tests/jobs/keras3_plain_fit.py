"""A plain Keras 3 fit on one worker that knows nothing of dpro (dpro-launch's auto-attach records it and applies
configs to it); with ``--report-jit`` it prints ``JIT_COMPILE <bool>`` at each batch's end (what the train function
was built with).

    python keras3_plain_fit.py [--steps 8] [--report-jit]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--report-jit", action="store_true")
args = parser.parse_args()

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
inputs = keras.Input((24,), name="features")
x = keras.layers.Dense(128, activation="relu", name="fc1")(inputs)
x = keras.layers.Dense(64, activation="relu", name="fc2")(x)
model = keras.Model(inputs, keras.layers.Dense(4, name="head")(x), name="plain")
model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
data = tf.data.Dataset.from_tensor_slices((tf.random.uniform((256, 24), seed=1), tf.random.uniform((256, 4), seed=2)))


class ReportJit(keras.callbacks.Callback):
    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        print(f"JIT_COMPILE {bool(self.model.jit_compile)}", flush=True)


model.fit(data.batch(16).repeat(), steps_per_epoch=args.steps, epochs=1, verbose=0,
          callbacks=[ReportJit()] if args.report_jit else [])
print("done", flush=True)
