"""``python -m dpro.launch ...`` is ``dpro-launch ...``."""

import sys

from dpro.launch.cli import main

sys.exit(main())
