"""At every reconnection of the worker to the broker, send again what the lost
connection dropped.

When the broker connection breaks (redis-server killed, restarted, unreachable), Celery
forgets the messages the worker had fetched and not started: prefetched ones, and
retries waiting out their countdown in its timer. It asks the broker to take them
back, which a dead Redis cannot do; the restarted Redis holds them only in the
transport's unacked hash, redelivered after the visibility timeout (hours), and a
message taken off a queue in the instant Redis died is nowhere at all. So as the
consumer starts again, before it takes any message, this host's open requests and
pending versions are compared with what live tasks hold (running in this worker, or
waiting in one of its queues), and the rest is sent again under its deterministic
id (coordinator/state/reconcile.py decides). Every task sent is idempotent: a lost
message that does come back later finds its work done.

A task shown running at the reconnection may in fact have ended with the connection:
its child finished, but the main process had not read that yet, and a retry it queued
before Redis died was fetched and lost. So each time tasks of the lost connection are
seen to end, the same check runs again (on the event loop, between two deliveries, so no
message is half-way between a queue and the worker while it reads). "Seen to end" is the
pool process's word as much as the main process's: a result lost with the connection
would show its task running for good (tasks/pool_runs.py).

The worker's first connection is left to beat/boot.py, which runs at every start.
"""

from __future__ import annotations

from celery import bootsteps
from celery.utils.log import get_task_logger
from celery.worker.state import active_requests, reserved_requests, scheduled_requests

from beat import reconcile
from coordinator import config
from coordinator.state import reconcile as decide
from smoltorrent import defaults
from tasks import pool_runs
from tasks.context import metadata

log = get_task_logger(__name__)


def in_worker() -> list[reconcile.TaskCall]:
    """The tasks this worker runs, has reserved or holds until their countdown ends."""
    held_here = {*active_requests, *reserved_requests, *scheduled_requests}
    return [(r.name, r.id, r.args, r.kwargs) for r in held_here if not pool_runs.ended(r)]


def running_ids() -> set[str]:
    """The tasks shown running whose pool process has not said they ended: one whose
    result was lost with the connection is shown running for good (tasks/pool_runs.py)."""
    return {r.id for r in active_requests if not pool_runs.ended(r)}


def run(host: str, channel) -> dict[str, int]:
    # What live tasks hold first, then the state: a task that ends in between has
    # settled its work by the time the state is read, so nothing is missed.
    queues = [config.host_queue(host), config.transfer_queue(host), config.CONTROL_QUEUE]
    now_held = reconcile.held(in_worker() + reconcile.queued(channel, queues))
    md = metadata()
    counts = reconcile.execute(md, decide.plan_reconnected(md, host, now_held))
    (log.warning if any(counts.values()) else log.info)(
        "reconnection of %s: sent again %s", host, counts
    )
    return counts


class Redrive(bootsteps.StartStopStep):
    """A consumer step: its start runs at every (re)connection, after the task consumer
    is set up and before the event loop takes the first message."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        self.connections = 0

    def start(self, c) -> None:
        self.connections += 1
        if self.connections == 1:
            return  # the worker's start: beat/boot.py brings its work back
        # Tasks of the lost connection still shown running: checked again as they end. The
        # timer entry belongs to this connection; Celery cancels it if this one breaks too.
        old = running_ids()
        self._redrive(c)
        if old:
            entry = c.timer.call_repeatedly(
                defaults.RECONNECT_RECHECK_S, self._on_tick, (c, old, lambda: entry)
            )

    def _on_tick(self, c, old: set[str], entry) -> None:
        ended = old - running_ids()
        if not ended:
            return
        old -= ended
        if not old:
            entry().cancel()
        self._redrive(c)

    @staticmethod
    def _redrive(c) -> None:
        try:
            run(config.host_id(), c.connection.default_channel)
        except Exception:  # Redis gone again: the next reconnection runs this again
            log.exception("re-sending after the broker reconnection failed")
