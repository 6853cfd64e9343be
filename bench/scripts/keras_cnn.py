"""The small image CNN of the Keras benches (bench/scripts/keras_train.py, bench/tf_overhead.py): two conv/pool
stages, dropout, two dense layers, Adam. Built inside the caller's strategy scope."""

from typing import Any


def build_cnn(keras: Any, width: int = 16) -> Any:
    """A compiled ``keras.Sequential`` CNN for 24x24x3 images and 10 classes; ``keras`` is tf_keras or Keras 3."""
    model = keras.Sequential([
        keras.Input(shape=(24, 24, 3)),
        keras.layers.Conv2D(width, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(2 * width, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def random_images(tf: Any, count: int = 512, batch: int = 32) -> Any:
    """A repeating dataset of ``count`` random images and labels in batches of ``batch``."""
    images = tf.random.uniform((count, 24, 24, 3), seed=3)
    labels = tf.random.uniform((count,), maxval=10, dtype=tf.int32, seed=4)
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch).repeat()
