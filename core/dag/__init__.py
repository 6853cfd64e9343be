"""Stages 2-3: align the ranks' clocks (``align``) and build the global DAG of a step (``graph``)."""
