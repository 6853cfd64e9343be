"""The environment between ``dpro-launch`` and the job it starts: each ``DPRO_*`` variable a launcher sets and a
plugin reads, named here once (the launcher, the plugins' auto-attach and the core import these names)."""

from __future__ import annotations

import sys

__all__ = ["APPLY_SEARCH", "AUTO_RECORD", "BACKWARD_MARKS", "CLOCK_SKEW", "CONFIG", "FORCE", "LAUNCH", "MECHANISMS",
           "PROBES", "PROBE_COMPILE", "PROFILE", "RUN_DIR", "SEEN_FILE", "STEP_TIMES", "say"]

LAUNCH = "DPRO_LAUNCH"                  # "1" in every process dpro-launch starts
AUTO_RECORD = "DPRO_AUTO_RECORD"        # "1": the plugins attach a recorder to the script (its model or optimizer)
PROFILE = "DPRO_PROFILE"                # the window, "START:STOP[:BLOCK]"
RUN_DIR = "DPRO_RUN_DIR"                # the run directory (a new or empty one; its parent for --apply auto)
CONFIG = "DPRO_CONFIG"                  # the applied config to apply (a config.json path)
APPLY_SEARCH = "DPRO_APPLY_SEARCH"      # --apply auto: the ranks pick the newest config made for their model here
FORCE = "DPRO_FORCE"                    # "1": apply a config made for another job anyway
BACKWARD_MARKS = "DPRO_BACKWARD_MARKS"  # "tensors": the torch recorder times BW per module with tensor hooks
MECHANISMS = "DPRO_MECHANISMS"          # the torch recorder's mechanisms, comma-separated (the overhead benches)
PROBES = "DPRO_PROBES"                  # "0": the torch, MXNet and TF recorders run no probe passes after their window
PROBE_COMPILE = "DPRO_PROBE_COMPILE"    # module paths the recorders' compile probe times (<root> when unset;
#                                       "0": none; the TF recorder's: <root> only)
STEP_TIMES = "DPRO_STEP_TIMES"          # a file where rank 0 of an unrecorded job writes when each step ended
SEEN_FILE = "seen.json"                 # what the auto-attach saw of a job it recorded nothing of (in RUN_DIR)
CLOCK_SKEW = "DPRO_CLOCK_SKEW_US"       # tests: a skew added to the ranks' clocks, to check the alignment


def say(text: str) -> None:
    """What an auto-attached plugin tells the user: one line on stderr, marked as dpro's."""
    print(f"[dpro] {text}", file=sys.stderr, flush=True)
