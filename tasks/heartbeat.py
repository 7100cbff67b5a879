"""The worker's heartbeat: a Redis TTL key per host holding the worker's boot id.

The CLI finds this host's worker by reading it (no broadcast a busy worker can
miss), and the reconcile sweep tells a request left by a dead worker (another
boot id, or none) from one a live worker runs.
"""

from __future__ import annotations

import contextlib
import threading

from celery.signals import worker_ready, worker_shutdown
from celery.utils.log import get_task_logger
from redis.exceptions import RedisError

from coordinator import config
from smoltorrent import defaults
from tasks.context import BOOT_ID, metadata

log = get_task_logger(__name__)
_stop = threading.Event()


def _beat() -> None:
    host = config.host_id()
    with contextlib.suppress(RedisError):  # started: its alive key speaks for it from now
        metadata().nodes.worker_started(host)
    while True:
        try:
            metadata().nodes.worker_alive(host, BOOT_ID)
        except RedisError as exc:  # Redis restarting: the next beat tries again
            log.warning("heartbeat not recorded: %s", exc)
        if _stop.wait(defaults.WORKER_HEARTBEAT_S):
            return


@worker_ready.connect
def start_heartbeat(sender=None, **_) -> None:
    threading.Thread(target=_beat, name="smoltorrent-heartbeat", daemon=True).start()


@worker_shutdown.connect
def stop_heartbeat(sender=None, **_) -> None:
    _stop.set()
    with contextlib.suppress(RedisError):  # if Redis is gone, the key expires on its own
        metadata().nodes.worker_gone(config.host_id(), BOOT_ID)
