"""Stage 6, optimize: search knob settings, each candidate priced by replay (``search``); each engine's own
search lives in its engine module (``dpro.engines``), built from ``dpro.sim.choices``, which this package also
offers."""

from dpro.optimize import search
from dpro.optimize.search import *  # noqa: F403 - the package is the public face of search and choices
from dpro.sim import choices
from dpro.sim.choices import *  # noqa: F403

__all__ = [*search.__all__, *choices.__all__]
