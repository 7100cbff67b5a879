"""`python -m coordinator.cli`: the same entry point as the `smoltorrent` script."""

import sys

from coordinator.cli.main import main

sys.exit(main())
