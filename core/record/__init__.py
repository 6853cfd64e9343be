"""The recording protocol every plugin uses: the trace schema (``trace``) and the framework-neutral
recording session (``protocol``): step window, run directory, clocks, per-rank writer."""
