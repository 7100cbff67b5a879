"""A Python that lacks what macOS's Python lacks: this directory first on PYTHONPATH makes
every process started with it import sitecustomize.py here before anything else."""

from __future__ import annotations

import os
from pathlib import Path

SHIM = Path(__file__).resolve().parent


def mac_pythonpath() -> str:
    """PYTHONPATH for a process that should run as on a Mac's Python."""
    return os.pathsep.join([str(SHIM), *filter(None, [os.environ.get("PYTHONPATH")])])
