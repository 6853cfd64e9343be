"""``python -m dpro``: the ``dpro`` command line."""

import sys

from dpro.cli import main

if __name__ == "__main__":
    sys.exit(main())
