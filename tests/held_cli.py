"""`smoltorrent ARGV` that stops itself (SIGSTOP) the first time it enters a named function,
so a test lands a fault in exactly that phase of a real command: it sees the process
stopped, applies the fault, and lets it go on with SIGCONT. Nothing else changes.

    python -m tests.held_cli MODULE:QUALNAME ARGV...

e.g. `coordinator.cli.transfer_commands:_report_store` (a store's summary, after the
commit) or `coordinator.state.requests:Requests.finish_request`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def hold_at(target: str) -> None:
    module_name, _, qualname = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, attr)
    held = False

    def stopping(*args, **kwargs):
        nonlocal held
        if not held:
            held = True
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(*args, **kwargs)

    setattr(owner, attr, stopping)


def start(env: dict[str, str], target: str, *argv: str) -> subprocess.Popen:
    """The command, started; it runs until it enters `target`, then stops."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.held_cli", target, *argv],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_worker(env: dict[str, str], target: str, log: Path) -> subprocess.Popen:
    """`smoltorrent worker` (in a session of its own, output appended to `log`) whose pool
    process stops itself as it enters `target`: stopped_child finds it."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.held_cli", target]
            + ["worker", "--loglevel", "INFO", "--concurrency", "2"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stopped_child(parent: int) -> int | None:
    """A process of `parent`'s that has stopped itself (state T), if any."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            pid, _, rest = stat.read_text().partition(" (")
            fields = rest.rpartition(")")[2].split()
            if fields[0] == "T" and int(fields[1]) == parent:
                return int(pid)
    return None


def wait_stopped(proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until `proc` has stopped itself at its target (AssertionError if it ended first)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"it ended before its held phase: {proc.communicate()}"
        # /proc/PID/stat: "pid (comm) state ...", state T when stopped by a signal.
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        if stat.rpartition(")")[2].split()[0] == "T":
            return
        assert time.monotonic() < deadline, "it never reached its held phase"
        time.sleep(0.05)


if __name__ == "__main__":
    hold_at(sys.argv[1])
    from coordinator.cli.main import main

    sys.exit(main(sys.argv[2:]))
