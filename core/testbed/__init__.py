"""The emulated cluster network (Linux network namespaces + tc): a test and benchmark tool, not part of the
analysis pipeline. ``python -m dpro.testbed cleanup`` removes namespaces left by killed runs; see
``dpro.testbed.emulate`` for the details."""

from dpro.testbed import emulate
from dpro.testbed.emulate import *  # noqa: F403 - the package is the module's public face

__all__ = list(emulate.__all__)
