"""Stage 8, report: results the way people read them.

``text`` (terminal tables of an analysis), ``perfetto`` (measured and replayed timelines in one Chrome
trace), ``info`` (what a run directory holds), ``tables`` (table and size formatting shared by the CLIs).
"""
