"""A background process's CPU priority: a nice value, and on Linux its autogroup's.

A trainer's writer process (smoltorrent/snapshot_writer.py) does work the training step
must not wait on, yet it runs in a session of its own (so that it outlives the trainer),
and on Linux with autogroup (sched(7); on by default in most distributions) every
session is a scheduling group the kernel weighs as much as any other, whatever the nice
values inside it: a nice process alone in its session still takes a core from a
trainer's whole session. So the writer lowers both its own nice value and its
autogroup's (/proc/self/autogroup). Neither makes it run any less: while the trainer
keeps every core busy it has a smaller share of them, never none, and all of a core
the trainer leaves idle. Where there is no autogroup (macOS, a kernel built without it,
a process in a CPU cgroup other than the root one) the nice value alone counts.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

from smoltorrent import defaults

log = logging.getLogger(__name__)

AUTOGROUP = "/proc/self/autogroup"


def lower(nice: int) -> None:
    """Run this process at nice `nice` at least, and its autogroup too when it is this
    process's alone (it leads its session). Call it before starting any thread: Linux
    keeps a nice value per thread, and a thread starts at its creator's. Never raises."""
    if nice <= 0:
        return
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        if current < nice:  # lower only: raising a priority back takes a privilege
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        log.warning("cannot lower this process's priority to nice %d: %s", nice, exc)
    # Another session's autogroup (a writer started by hand in a shell) may hold the
    # trainer too: only the group of a session this process leads is its own.
    if os.path.exists(AUTOGROUP) and os.getsid(0) == os.getpid():
        threading.Thread(
            target=_autogroup, args=(nice,), name="autogroup-nice", daemon=True
        ).start()


def autogroup_nice(path: str = AUTOGROUP) -> int | None:
    """The nice value of the autogroup `path` names ("/autogroup-413 nice 10"); None
    where there is none."""
    try:
        with open(path) as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _autogroup(nice: int) -> None:
    """Write the autogroup's nice value, retrying while Linux rate-limits the change; a
    thread of its own, so the writer's first save is not held by the retries."""
    current = autogroup_nice()
    if current is None or current >= nice:
        return
    for attempt in range(defaults.AUTOGROUP_NICE_TRIES):
        try:
            with open(AUTOGROUP, "w") as f:
                f.write(str(nice))
            return
        except OSError as exc:
            if exc.errno == errno.EAGAIN and attempt + 1 < defaults.AUTOGROUP_NICE_TRIES:
                time.sleep(defaults.AUTOGROUP_NICE_RETRY_S)
                continue
            # A container's read-only /proc, or a kernel that refuses: the nice value alone.
            log.warning("cannot set this session's autogroup to nice %d: %s", nice, exc)
            return
