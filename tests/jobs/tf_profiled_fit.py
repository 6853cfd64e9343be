"""A 1-thread tf_keras fit whose batches 3..6 are profiled into the TensorBoard log dir argv[1].

What TensorBoard(profile_batch=(3, 6)) does (TensorBoard itself is not installed here, and its callback fails
writing summaries without it): start the profiler at the start of batch 3, stop it at the end of batch 6.
Used by tests/plugins/tf/test_import_xplane.py and bench/fuzz.py (a real XPlane to mutate).
"""
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
logdir = sys.argv[1]

class Profile(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3:
            tf.profiler.experimental.start(logdir)
    def on_train_batch_end(self, batch, logs=None):
        if batch == 6:
            tf.profiler.experimental.stop()

model = keras.Sequential([
    keras.Input(shape=(12, 12, 3)),
    keras.layers.Conv2D(4, 3, activation="relu", name="conv1"),
    keras.layers.BatchNormalization(name="bn1"),
    keras.layers.Flatten(name="flat"),
    keras.layers.Dense(16, activation="relu", name="fc1"),
    keras.layers.Dense(4, name="fc2"),
], name="convnet")
model.compile(optimizer=keras.optimizers.SGD(0.01),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = tf.random.uniform((128, 12, 12, 3), seed=1)
y = tf.random.uniform((128,), maxval=4, dtype=tf.int32, seed=2)
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
model.fit(ds, steps_per_epoch=9, epochs=1, verbose=0, callbacks=[Profile()])
