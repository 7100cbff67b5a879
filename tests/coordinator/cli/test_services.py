"""`worker` and `beat` run without the CLI's rendering: every prefork pool child starts as
a copy of the worker, so whatever the worker imports, each child carries too."""

from __future__ import annotations

import subprocess
import sys

RENDERING = (
    "rich",
    "coordinator.cli.transfer_commands",
    "coordinator.cli.listing_commands",
    "coordinator.cli.node_commands",
    "coordinator.cli.operation_commands",
    "coordinator.cli.daemon_commands",
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


# What a command under --json goes through: its imports, the no-bar and the JSON writers.
JSON_PROBE = """
import sys
from coordinator.cli import main, transfer_commands
from coordinator.cli.output import emit_json, error
with transfer_commands._progress(as_json=True) as bar:
    bar.update(bar.add_task("gathering", total=1), completed=1)
emit_json({"ok": True})
error("a failure", "a hint", as_json=True)
print(sorted(m for m in sys.modules if m.split(".")[0] == "rich"))
"""


def test_a_command_under_json_never_imports_rich():
    """rich's imports are a tenth of a second of every command's start; a script reading
    --json sees none of what it draws."""
    out = subprocess.run(
        [sys.executable, "-c", JSON_PROBE], capture_output=True, text=True, check=True
    )
    assert out.stdout.splitlines()[-1] == "[]"
