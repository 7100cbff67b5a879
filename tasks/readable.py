"""What Flower (and the worker's log, and `celery inspect`) show for a task's arguments.

Celery puts `argsrepr`/`kwargsrepr` in every message, by default the repr of the raw
arguments: for a transfer, a dict of a 32-hex version key, a digest and a node id. Here
they become a line a person reads: the checkpoint's name in args, and in kwargs the shard,
the node and the bytes.

The app uses ReadableAMQP as its AMQP class (tasks/app.py), so every message gets them:
send_task, apply_async, a beat entry, a dead-letter replay, and a retry. A retry is
published by the task itself with only its raw arguments, so the text its first message
carried (with sizes the retry cannot know) is kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from celery import current_task
from celery.app.amqp import AMQP

from coordinator.plan.safetensors_header import format_bytes
from smoltorrent import defaults
from tasks.chain_batches import chain_entries

Readable = tuple[str, str]  # (argsrepr, kwargsrepr)

# Sweeps that run every few seconds to a minute: in Flower they would bury the stores and
# gathers a person looks for (health alone adds 360 rows an hour), so they send no task
# events (neither their sending nor their run: beat/sweeps.py, ReadableAMQP). Their runs
# are on record in Redis (coordinator/state/sweeps.py) and in the worker's log; the rarer
# sweeps (retention, crosscheck, scrub) stay listed.
QUIET_TASKS = frozenset(
    {"smoltorrent.sweep.health", "smoltorrent.sweep.repair", "smoltorrent.sweep.reconcile"}
)
# Where Celery's AMQP.as_task_v2 takes create_sent_event among its positional arguments
# after (task_id, name, args, kwargs): Celery's send_task passes it there.
_SENT_EVENT_AT = 12


def _cut(text: str) -> str:
    limit = defaults.TASK_REPR_MAX_CHARS
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short(key: object) -> str:
    """Version keys, digests and node ids: their first 12 hex are enough to tell apart."""
    return str(key)[:12]


def transfer_repr(
    name: str, shard: int, replica: int, node_id: str, blob_size: int | None = None
) -> Readable:
    size = f", {format_bytes(blob_size)}" if blob_size is not None else ""
    return _cut(name), _cut(f"shard {shard} -> node {_short(node_id)} (copy {replica + 1}){size}")


def chain_repr(
    name: str,
    shards: Sequence[int],
    replicas: Sequence[int],
    node_ids: Sequence[str],
) -> Readable:
    """A chain task's line: its shard, or a batch's chunks (its first few, and how many)."""
    nodes = " -> ".join(_short(n) for n in node_ids)
    copies = ", ".join(str(r + 1) for r in replicas)
    if len(shards) == 1:
        what = f"shard {shards[0]}"
    else:
        listed = [str(s) for s in shards[: defaults.TASK_REPR_SHARDS]]
        listed += ["…"] if len(shards) > defaults.TASK_REPR_SHARDS else []
        what = f"{len(shards)} chunks ({', '.join(listed)})"
    return _cut(name), _cut(f"{what} -> nodes {nodes} (copies {copies})")


def describe(task: str, args: Sequence, kwargs: Mapping) -> Readable | None:
    """A readable (argsrepr, kwargsrepr) for one of our tasks; None leaves Celery's own."""
    try:
        if task == "smoltorrent.transfer":
            return transfer_repr(
                kwargs["name"],
                kwargs["shard"],
                kwargs["replica"],
                kwargs["node_id"],
                kwargs.get("blob_size"),
            )
        if task == "smoltorrent.chain":
            shards = [entry.shard for entry in chain_entries(kwargs)]
            return chain_repr(kwargs["name"], shards, kwargs["replicas"], kwargs["node_ids"])
        if task == "smoltorrent.store":
            path, name, replicas = args[0], args[1], args[2]
            shards = args[3] if len(args) > 3 else None
            split = f", {shards} shards" if shards else ""
            return _cut(name), _cut(f"from {path}, {replicas} copies{split}")
        if task == "smoltorrent.gather":
            vkey, out = args[0], args[1]
            return _cut(kwargs.get("name") or f"version {_short(vkey)}"), _cut(f"into {out}")
        if task in ("smoltorrent.commit", "smoltorrent.remove"):
            vkey = args[0] if args else kwargs["vkey"]
            return _cut(kwargs.get("name") or f"version {_short(vkey)}"), f"version {_short(vkey)}"
        if task.startswith("smoltorrent.sweep."):
            return task.rpartition(".")[2], ""
    except (IndexError, KeyError, TypeError, ValueError):
        return None  # a message of another shape (an older release): Celery's repr is fine
    return None


class ReadableAMQP(AMQP):
    """Celery's AMQP with our argsrepr/kwargsrepr filled in where the sender gave none."""

    def as_task_v2(self, task_id, name, args=None, kwargs=None, *rest, **options):
        if name in QUIET_TASKS:  # no task-sent event: see QUIET_TASKS
            if len(rest) > _SENT_EVENT_AT:
                rest = (*rest[:_SENT_EVENT_AT], False, *rest[_SENT_EVENT_AT + 1 :])
            if "create_sent_event" in options:
                options["create_sent_event"] = False
        if options.get("argsrepr") is None and options.get("kwargsrepr") is None:
            readable = _retried(task_id) or describe(name, args or (), kwargs or {})
            if readable is not None:
                options["argsrepr"], options["kwargsrepr"] = readable
        return super().as_task_v2(task_id, name, args, kwargs, *rest, **options)


def _retried(task_id: str) -> Readable | None:
    """The text of the running task when it publishes itself again (a retry)."""
    task = current_task
    request = getattr(task, "request", None) if task else None
    if request is None or request.id != task_id:
        return None
    argsrepr, kwargsrepr = getattr(request, "argsrepr", None), getattr(request, "kwargsrepr", None)
    return (argsrepr, kwargsrepr) if argsrepr is not None and kwargsrepr is not None else None
