"""dpro's TensorFlow/Keras plugin: ``DproCallback`` for ``model.fit``, ``Profiler`` for custom loops.

Per-op times come from TensorFlow's profiler (XPlane), mapped to Keras layers; see ``recorder``.
"""

from dpro.plugins.tf.callback import DproCallback
from dpro.plugins.tf.profiler import Profiler
from dpro.plugins.tf.recorder import TFRecorder

__all__ = ["DproCallback", "Profiler", "TFRecorder"]
