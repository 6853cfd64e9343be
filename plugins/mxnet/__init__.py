"""dpro plugin for mxnet (not built yet: see the project's issues)."""
