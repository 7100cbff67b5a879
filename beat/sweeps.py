"""One way to declare a sweep: a Celery task that runs under a Redis lock.

Two beat instances (or a beat and a manual run) may both send a sweep; the lock
makes the second a no-op instead of a second pass racing the first. The lock
expires after SWEEP_LOCK_TTL_S so a holder that died mid-sweep blocks nothing
for long; a live holder renews it every third of that, so a sweep longer than
the TTL keeps it. It names its holder's host and worker boot: a worker starting
again frees at once the locks its dead boot held (beat/boot.py). Before, they
stood every pass of their sweep down until they expired, ten minutes then (a
fault run's worker SIGKILLed mid-reconcile: no remove was sent again for the
rest of the run). Every run is recorded (start and end on the Redis clock, by
whom), and every stand-down counted, so two runs at once would show.
Adding a sweep is this decorator plus one entry in beat/schedule.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import uuid

from redis.exceptions import LockError, RedisError

from coordinator import config
from coordinator.state import redis_keys as K
from coordinator.state.sweeps import lock_holder
from smoltorrent import defaults
from tasks.app import app
from tasks.context import BOOT_ID, metadata
from tasks.readable import QUIET_TASKS

REGISTERED: list[str] = []  # every sweep's name, as its module declares it


def _renew(lock, stop: threading.Event) -> None:
    while not stop.wait(defaults.SWEEP_LOCK_TTL_S / 3):
        # Lost already (Redis away longer than the TTL): the sweep finishes; a second
        # one may have started, which every sweep's idempotent steps tolerate.
        with contextlib.suppress(LockError, RedisError):
            lock.reacquire()


def sweep(name: str):
    """Register `fn` as the Celery task smoltorrent.sweep.<name>, run under its lock."""

    def register(fn):
        task = f"smoltorrent.sweep.{name}"
        REGISTERED.append(name)

        # A frequent sweep sends no task events, so Flower is not buried in its rows.
        @app.task(name=task, send_events=task not in QUIET_TASKS)
        @functools.wraps(fn)
        def run(*args, **kwargs) -> dict:
            md = metadata()
            # Not thread-local: the renewing thread must see the token this one acquired
            # with (redis-py keeps it per thread by default, and the renewal then raised
            # LockError, suppressed, so every sweep lost its lock after the TTL).
            lock = md.r.lock(
                K.SWEEP_LOCK.format(name=name),
                timeout=defaults.SWEEP_LOCK_TTL_S,
                thread_local=False,
            )
            holder = lock_holder(config.host_id(), BOOT_ID, uuid.uuid4().hex)
            if not lock.acquire(blocking=False, token=holder):
                md.sweeps.sweep_skipped(name)
                return {"skipped": f"another {name} sweep is running"}
            stop = threading.Event()
            renewer = threading.Thread(target=_renew, args=(lock, stop), daemon=True)
            renewer.start()
            started = md.sweeps.redis_time()
            outcome = "failed"
            try:
                result = fn(*args, **kwargs)
                outcome = "done"
                return result
            finally:
                stop.set()
                renewer.join()
                with contextlib.suppress(RedisError):
                    md.sweeps.sweep_ran(name, started, f"{config.host_id()}:{os.getpid()}", outcome)
                # It may have expired during a very long sweep: nothing left to free.
                with contextlib.suppress(LockError):
                    lock.release()

        return run

    return register
