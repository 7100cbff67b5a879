"""One way to declare a sweep: a Celery task that runs under a Redis lock.

Two beat instances (or a beat and a manual run) may both send a sweep; the lock
makes the second a no-op instead of a second pass racing the first. The lock
expires after SWEEP_LOCK_TTL_S so a holder that died mid-sweep blocks nothing
for long. Adding a sweep is this decorator plus one entry in beat/schedule.py.
"""

from __future__ import annotations

import contextlib
import functools

from redis.exceptions import LockError

from coordinator.state import redis_keys as K
from smoltorrent import defaults
from tasks.app import app
from tasks.context import metadata


def sweep(name: str):
    """Register `fn` as the Celery task smoltorrent.sweep.<name>, run under its lock."""

    def register(fn):
        @app.task(name=f"smoltorrent.sweep.{name}")
        @functools.wraps(fn)
        def run(*args, **kwargs) -> dict:
            lock = metadata().r.lock(
                K.SWEEP_LOCK.format(name=name), timeout=defaults.SWEEP_LOCK_TTL_S
            )
            if not lock.acquire(blocking=False):
                return {"skipped": f"another {name} sweep is running"}
            try:
                return fn(*args, **kwargs)
            finally:
                # It may have expired during a very long sweep: nothing left to free.
                with contextlib.suppress(LockError):
                    lock.release()

        return run

    return register
