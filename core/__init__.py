"""dpro: profile distributed training, replay its step DAG, and apply a better configuration.

The package is framework-neutral: it imports no training framework. Plugins under
``dpro.plugins.<framework>`` record traces; the modules here read, analyze and report them.
"""

__version__ = "0.1.0"
