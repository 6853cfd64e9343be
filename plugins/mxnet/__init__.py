"""dpro plugin for MXNet (Gluon, kvstore parameter server): ``Profiler`` records a window of a Gluon loop."""

from dpro.plugins.mxnet.profiler import Profiler

__all__ = ["Profiler"]
