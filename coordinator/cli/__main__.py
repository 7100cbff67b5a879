"""`python -m coordinator.cli`: the same entry point as the `smoltorrent` script."""

import sys

from coordinator.cli.main import run

sys.exit(run())
