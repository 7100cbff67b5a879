"""The local cluster's process checks, on a Python without /proc (macOS's)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.macos_python import mac_pythonpath

TIMEOUT_S = 60.0  # seconds for the script below on a loaded box

# `sh` starts a sleep in the background and exits, so the sleep is no child of the script:
# only /proc or ps can say whether it is alive (kill(0) also answers for a zombie).
SCRIPT = """
import os, signal, subprocess, time
from coordinator.local.cluster import _alive
started = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
pid = int(started.stdout)
try:
    print("running", _alive(pid))
finally:
    os.kill(pid, signal.SIGKILL)
deadline = time.monotonic() + 30
while _alive(pid) and time.monotonic() < deadline:
    time.sleep(0.05)
print("killed", _alive(pid))
"""


def test_alive_tells_a_running_process_from_a_killed_one_without_proc() -> None:
    env = dict(os.environ, PYTHONPATH=mac_pythonpath())
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    # It said "dead" for a running Redis, so a Mac's `smoltorrent demo` left it running.
    assert result.stdout.split("\n")[:2] == ["running True", "killed False"]
