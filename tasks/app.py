"""The Celery app: Redis broker and result backend, set up for long idempotent transfers.

Each setting answers a known pitfall (see DESIGN.md, Celery):
- late acks + retry on worker loss: a killed worker's task runs again, as a
  counted retry, instead of vanishing (or being requeued forever), and at once: Celery
  waits a task's default_retry_delay (180 s of its own) before that retry.
- prefetch 1: a worker does not sit on transfers another could run now.
- the visibility timeout, set everywhere the Redis transport reads it, stays
  above the longest transfer plus its backoff, so nothing runs twice at once.
- JSON only: no pickle on any wire.
- a broker connection lost mid-task: running tasks go on (their Redis writes retry),
  the worker and its publishers survive kombu's use of closed channels
  (tasks/broker_transport.py), and what the dead Redis could not take back is sent
  again at reconnection (beat/reconnect.py).
"""

from __future__ import annotations

import time

from celery import Celery, Task

from beat.schedule import SCHEDULE
from coordinator import config
from coordinator.state.embedded_redis import ensure_redis_url
from smoltorrent import defaults
from tasks import broker_transport

REDIS_URL = ensure_redis_url()
broker_transport.register()


class SmoltorrentTask(Task):
    # The wait before a task whose worker process died runs again (the OOM killer took a
    # pool child, say); Celery's own 180 s left a gather or a store idle for 3 minutes.
    default_retry_delay = defaults.WORKER_LOST_RETRY_S
    # A countdown is held on the receiving worker's monotonic clock, not till its wall
    # clock reaches the sender's ETA (tasks/countdown.py): a clock stepped back held a
    # retry for as long as the step.
    Strategy = "tasks.countdown:strategy"

    def retry(self, args=None, kwargs=None, exc=None, throw=True, eta=None, countdown=None, **o):
        """A task run here by eager apply (a store in the process that asked for it,
        tasks/enqueue.py running_here) waits out its retry's countdown before Celery runs
        it again, as a worker would: Celery's eager apply runs it again at once, so a node
        down for a few seconds would use up every retry in those seconds."""
        limit = o.get("max_retries", self.max_retries)
        if self.request.is_eager and countdown and (limit is None or self.request.retries < limit):
            time.sleep(countdown)  # autoretry_for's backoff comes as a countdown too
        return super().retry(args, kwargs, exc, throw, eta, countdown, **o)


app = Celery(
    "smoltorrent",
    task_cls=SmoltorrentTask,
    broker=REDIS_URL,
    backend=REDIS_URL,
    # Every message carries a readable argsrepr/kwargsrepr (what Flower shows), and its
    # countdown, if any, in seconds (tasks/countdown.py).
    amqp="tasks.countdown:CountdownAMQP",
    include=[
        "tasks.store",
        "tasks.transfer",
        "tasks.chain",
        "tasks.commit",
        "tasks.gather",
        "tasks.remove",
        "tasks.dead_letters",
        "tasks.heartbeat",
        "tasks.discover",
        "beat.reconcile",
        "beat.retention",
        "beat.health",
        "beat.repair",
        "beat.scrub",
        "tasks.repair",
        "beat.crosscheck",
        "beat.boot",
        "tasks.event_log",
    ],
)

_transport = {"visibility_timeout": defaults.VISIBILITY_TIMEOUT_S}

app.conf.update(
    task_acks_late=True,
    task_retry_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_transport_options=_transport,
    result_backend_transport_options=_transport,
    visibility_timeout=defaults.VISIBILITY_TIMEOUT_S,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_accept_content=["json"],
    task_default_queue=config.CONTROL_QUEUE,
    task_track_started=True,
    task_send_sent_event=True,
    worker_send_task_events=True,
    result_extended=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    beat_schedule=SCHEDULE,
    # Cancelling them would only lose their progress: their messages cannot go back to a
    # Redis that is down, and a running transfer's own Redis writes retry until it is up.
    worker_cancel_long_running_tasks_on_connection_loss=False,
    # Publishing (a retry, the next task) while Redis restarts waits for it to come back
    # instead of failing the task after Celery's default ~1 s of attempts.
    task_publish_retry_policy={
        "max_retries": defaults.PUBLISH_RETRIES,
        "interval_start": 0,
        "interval_step": defaults.PUBLISH_RETRY_STEP_S,
        "interval_max": defaults.PUBLISH_RETRY_MAX_S,
    },
)
# Its signals connected before the worker sets up its logs (one of them formats them).
import tasks.event_log  # noqa: E402, F401

# After every task, malloc's free pages go back to the system (tasks/malloc_trim.py).
from tasks.malloc_trim import connect as _trim_after_tasks  # noqa: E402

_trim_after_tasks()

# Every pool process says what it runs, for when its result is lost (tasks/pool_runs.py).
from tasks.pool_runs import connect as _say_runs  # noqa: E402

_say_runs()

# At every reconnection to the broker: send again what the lost connection dropped.
app.steps["consumer"].add("beat.reconnect:Redrive")
