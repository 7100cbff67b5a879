"""`worker` and `beat` run without the CLI's rendering: every prefork pool child starts as
a copy of the worker, so whatever the worker imports, each child carries too."""

from __future__ import annotations

import subprocess
import sys

RENDERING = (
    "rich",
    "coordinator.cli.commands",
    "coordinator.cli.output",
    "coordinator.cli.reports",
)

# What `smoltorrent worker` imports before Celery takes over: the entry point, the command
# and the app (the tasks and everything they use).
PROBE = """
import sys
from coordinator.cli import main, services
import tasks.app
print(sorted(m for m in sys.modules if m.split(".")[0] == "rich" or m in {rendering!r}))
"""


def test_the_worker_and_beat_commands_import_none_of_the_cli_rendering():
    code = PROBE.format(rendering=set(RENDERING[1:]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
