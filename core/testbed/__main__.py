"""``python -m dpro.testbed``: check, cleanup, and the helpers that run inside emulated hosts."""

import sys

from dpro.testbed.emulate import main

sys.exit(main())
