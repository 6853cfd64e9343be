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
from keras_cnn import build_cnn, random_images  # noqa: E402  (next to this script)

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
    model = build_cnn(keras, args.width)
model.fit(random_images(tf), steps_per_epoch=args.steps, epochs=1, verbose=0)
