"""After every task, the pool child gives the memory malloc holds free back to the system.

glibc keeps what a task freed (its per-chunk buffers, the plan's and the manifest's
objects) inside its heaps, where a few live blocks pin whole pages: the one pool child
that stored or gathered grew with the checkpoint's chunk count, although its live Python
heap after the task did not (bench/RESULTS.md, "2026-11-29: worker memory 1 to 16 GB").
`malloc_trim(0)` returns every free page of every arena, and is cheap beside any task.
A task may call it midway too, once a big transient is gone and before its next phase
(the gather, once its manifest is parsed). Off glibc (macOS, musl) there is no such call
and nothing is done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _find_malloc_trim()


def release_freed_memory() -> bool:
    """Give malloc's free pages back to the system; whether this libc can (glibc)."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def _after_task(**_) -> None:
    release_freed_memory()


def connect() -> None:
    """release_freed_memory after every task this process runs (tasks/app.py). Celery is
    imported here, not with the module: a reader's own gather (tasks/gathering.py) gives
    freed memory back too, and starts without Celery."""
    from celery import signals

    signals.task_postrun.connect(_after_task, weak=False)
