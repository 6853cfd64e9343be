"""Stage 6, optimize: search knob settings, each candidate priced by replay (``search``); each engine's own
search lives in its engine module (``dpro.engines``)."""

from dpro.optimize import search
from dpro.optimize.search import *  # noqa: F403 - the package is the module's public face

__all__ = list(search.__all__)
