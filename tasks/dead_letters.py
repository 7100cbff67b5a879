"""The dead-letter queue: a record per task that failed for good, replayable.

`task_failure` fires for exhausted retries, hard time-limit kills and worker
loss past the retries alike (`on_failure` misses the last two), so the
handler is a signal receiver. A dead transfer also settles in the commit
barrier: the version commits under-replicated if every shard still has a
copy, or stays pending until the replay succeeds.

A task cut off from Redis (its retry, result or settle could not be written
while redis-server restarted) did not fail: its failure can reach this
receiver once Redis is back, and a dead letter then would settle replicas
that a retry was about to place. It is left open instead, and sent again by
the worker's reconnection check (beat/reconnect.py) or the reconcile sweep.

Nor did a task whose hard time limit struck after its pool process had said it ended:
Celery lost its result with the broker connection and showed it running until then
(tasks/pool_runs.py). The run settled what it did; the reconnection sent again what it
left.
"""

from __future__ import annotations

from billiard.exceptions import TimeLimitExceeded
from celery.signals import task_failure
from celery.utils.log import get_task_logger
from kombu.exceptions import OperationalError

from coordinator import config
from coordinator.state.requests import FAILED
from smoltorrent.errors import CheckpointFormatError, GatherError, NotFoundError
from tasks.app import app
from tasks.chain_batches import chain_entries
from tasks.context import REDIS_TRANSIENT, metadata
from tasks.enqueue import settle
from tasks.pool_runs import result_lost

log = get_task_logger(__name__)

# Failures a replay cannot fix: the caller sees them directly.
NOT_DEAD_LETTERS = (CheckpointFormatError, GatherError, NotFoundError)
# Redis lost under the task (kombu raises OperationalError for a publish that gave up).
CUT_OFF = (*REDIS_TRANSIENT, OperationalError)


@task_failure.connect
def record_dead_letter(
    sender=None, task_id=None, exception=None, args=None, kwargs=None, einfo=None, **_
) -> None:
    if sender is None or not sender.name.startswith("smoltorrent."):
        return
    if isinstance(exception, CUT_OFF):
        log.warning(
            "%s (%s) lost Redis (%s): left open, sent again", task_id, sender.name, exception
        )
        return
    if isinstance(exception, TimeLimitExceeded) and result_lost(task_id):
        log.warning(
            "%s (%s) hit its time limit after its process said it ended: its result was "
            "lost with the broker connection, and it was sent again; not a dead letter",
            task_id,
            sender.name,
        )
        return
    kwargs = kwargs or {}
    if not isinstance(exception, NOT_DEAD_LETTERS):
        metadata().dead_letters.add_dead_letter(
            task_id,
            {
                "task": sender.name,
                "args": list(args or ()),
                "kwargs": kwargs,
                "queue": _queue_of(sender, kwargs),
                "error": f"{type(exception).__name__}: {exception}",
                "traceback": str(einfo) if einfo else "",
                "checkpoint": kwargs.get("name"),
                "shard": kwargs.get("shard"),
                # A chain task's batch: every chunk it carries, its own first.
                **(
                    {"shards": [e.shard for e in chain_entries(kwargs)]}
                    if sender.name == "smoltorrent.chain"
                    else {}
                ),
                "node": kwargs.get("node_id")
                or getattr(exception, "node_id", None)
                or _chain_nodes(kwargs),
            },
        )
        log.error("dead letter %s (%s): %s", task_id, sender.name, exception)
    if kwargs.get("request_id"):
        # The request failed for good: whoever waits on it (CLI, API) hears why.
        metadata().requests.finish_request(
            kwargs["request_id"], FAILED, error=f"{type(exception).__name__}: {exception}"
        )
    if sender.name == "smoltorrent.chain":
        # Each replica it still owed, of every entry it carries, settles as failed, as its
        # own transfer would have.
        for entry in chain_entries(kwargs):
            for replica in entry.replicas:
                settle(kwargs["vkey"], entry.shard, replica, None, entry.digest, same=entry.same)
    if sender.name == "smoltorrent.transfer":
        # Settled even when not replayable (its node was removed): the version must not
        # wait forever for a transfer that will never run again.
        settle(
            kwargs["vkey"],
            kwargs["shard"],
            kwargs["replica"],
            None,
            kwargs["digest"],
            same=kwargs.get("same", ()),
        )


def _chain_nodes(kwargs: dict) -> str | None:
    """A chain task's nodes, in chain order, as one field of its record."""
    nodes = kwargs.get("node_ids")
    return ",".join(nodes) if nodes else None


def _queue_of(sender, kwargs: dict) -> str:
    """Where a replay must go: transfers read the source, so they go back to its host."""
    if sender.name in ("smoltorrent.transfer", "smoltorrent.chain"):
        try:
            return config.transfer_queue(metadata().versions.version(kwargs["vkey"])["host"])
        except NotFoundError:
            pass
    request = getattr(sender, "request", None)
    delivery = (getattr(request, "delivery_info", None) or {}) if request else {}
    return delivery.get("routing_key") or config.CONTROL_QUEUE


def replay(task_id: str) -> str:
    """Send a dead task again with its own id and arguments; its record is dropped."""
    md = metadata()
    record = md.dead_letters.dead_letter(task_id)
    md.dead_letters.remove_dead_letter(task_id)
    app.send_task(
        record["task"],
        args=record["args"],
        kwargs=record["kwargs"],
        queue=record["queue"],
        task_id=task_id,
    )
    return task_id
