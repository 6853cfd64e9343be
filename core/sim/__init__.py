"""Stages 4-5: replay the DAG (``replay``), the cost models (``cost``) and what-if transformations (``whatif``)."""
