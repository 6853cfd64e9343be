"""An unmodified Horovod Keras training script (it never imports dpro), for benches: the CNN of keras_train.py
with ``horovod.tensorflow.keras`` (tf_keras, ``hvd.DistributedOptimizer`` around Adam).
``dpro-launch -np 2 -H localhost:2 --gloo --profile 10:30 python bench/scripts/hvd_keras_train.py``.
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow.keras as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402
from keras_cnn import build_cnn, random_images  # noqa: E402  (next to this script)

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--width", type=int, default=16)
parser.add_argument("--threads", type=int, default=1, help="TensorFlow's inter- and intra-op threads (0: its default)")
args = parser.parse_args()

hvd.init()
if args.threads:
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
model = build_cnn(keras, args.width)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
model.fit(random_images(tf), steps_per_epoch=args.steps, epochs=1, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
