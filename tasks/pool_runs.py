"""What each pool process of this worker runs, in its own words.

The worker's main process learns that a task ended from the result its pool process
sends back through a pipe, read by Celery's event loop. When the broker connection breaks
just as a task ends, that result can be lost: after the reconnection Celery's event loop
had no reader for that process's result pipe, 52 KB waited in it unread, and the pool
still counted the job running a minute later, its process long idle (a chain retry
ending 3 ms before redis-server was SIGKILLed: 4 of about 250 runs of the held-retry test
in tests/tasks/test_durable_requests.py). The main process then shows the task running for
good, and the reconnection's re-drive (beat/reconnect.py), which leaves what a running
task holds to it, waited on it for good. (That process is lost to the pool until the
task's hard time limit, when Celery replaces it.)

So each pool process also says what it runs where the main process can read it: a file
named by its pid, naming its latest run (task id and retry count: a retry keeps the id)
and whether that run has ended, replaced whole as the run starts and as it ends (Celery's
task_prerun and task_postrun, sent in the pool process; task_postrun comes after every
write of the task, its retry or its dead letter, so a run said ended has settled what it
did). The files are in RAM where the system has /dev/shm, and go with the worker's
shutdown; a worker that was SIGKILLed had none, so each worker's start removes the
directories of workers whose main process is gone (named by its pid).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from celery import signals

from smoltorrent.processes import alive
from tasks.context import BOOT_ID

_RAM = Path("/dev/shm")
_PARENT = _RAM if _RAM.is_dir() else Path(tempfile.gettempdir())
# One directory per worker boot, so a pid a dead worker's process had says nothing here,
# named by the worker's main process (imported there, before the pool forks) so a later
# worker can tell whose worker is gone.
DIRECTORY = _PARENT / f"smoltorrent-runs-{os.getpid()}-{BOOT_ID}"
_NAME = re.compile(r"smoltorrent-runs-(\d+)-[0-9a-f]{32}")
RUNNING, ENDED = "running", "ended"


def _run(task_id: str | None, retries: int | None) -> str:
    return f"{task_id}#{retries or 0}"


def _say(task, state: str) -> None:
    path = DIRECTORY / str(os.getpid())
    tmp = DIRECTORY / f"{os.getpid()}.tmp"
    try:
        DIRECTORY.mkdir(exist_ok=True)
        tmp.write_text(f"{_run(task.request.id, task.request.retries)} {state}")
        os.replace(tmp, path)  # whole: a reader never sees half a line
    except OSError:
        # Unsaid: the main process waits for the task's result, as it did before. What the
        # process said of its last run must not stand for this one.
        with contextlib.suppress(OSError):
            path.unlink()


def ended(request) -> bool:
    """Whether the pool process running Celery's `request` said that run ended. False
    when it said nothing, or names another run: it may be about to start this one (a
    process says "running" a moment after the pool hands it a task, never before)."""
    if request.worker_pid is None:
        return False  # not handed to a process yet
    try:
        said = (DIRECTORY / str(request.worker_pid)).read_text()
    except OSError:
        return False
    return said == f"{_run(request.id, request.request_dict.get('retries'))} {ENDED}"


def result_lost(task_id: str) -> bool:
    """Whether a pool process said a run of `task_id` ended and none says one is running: a
    hard time limit on it then strikes a task whose result Celery lost (shown running for
    good, see above), not one that ran too long."""
    said = set()
    try:
        for path in DIRECTORY.iterdir():
            with contextlib.suppress(OSError):  # a process's file replaced meanwhile
                run, _, state = path.read_text().rpartition(" ")
                if run.startswith(f"{task_id}#"):
                    said.add(state)
    except OSError:
        return False
    return said == {ENDED}


def _on_start(task=None, **_) -> None:
    if task is not None:
        _say(task, RUNNING)


def _on_end(task=None, **_) -> None:
    if task is not None:
        _say(task, ENDED)


def _clear(**_) -> None:
    shutil.rmtree(DIRECTORY, ignore_errors=True)


def _remove_the_gone(**_) -> None:
    """Remove the directories of workers whose main process is gone (SIGKILLed: no
    shutdown removed them), so /dev/shm does not fill with them over a month."""
    for path in _PARENT.glob("smoltorrent-runs-*"):
        named = _NAME.fullmatch(path.name)
        if named and not alive(int(named[1])):
            shutil.rmtree(path, ignore_errors=True)


def connect() -> None:
    """Have every pool process say what it runs, the directory go with the worker, and a
    starting worker remove those of workers gone (tasks/app.py)."""
    signals.task_prerun.connect(_on_start, weak=False)
    signals.task_postrun.connect(_on_end, weak=False)
    signals.worker_shutdown.connect(_clear, weak=False)
    signals.worker_init.connect(_remove_the_gone, weak=False)
