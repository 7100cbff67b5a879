"""The reconcile sweep: re-drive every open request and pending or removing version
that no live task is moving (coordinator/state/reconcile.py decides what), on the
beat schedule and at every worker start (step 3 of beat/boot.py)."""

from __future__ import annotations

import json

from celery.utils.log import get_task_logger
from kombu.exceptions import ContentDisallowed, DecodeError

from beat.sweeps import sweep
from coordinator import config
from coordinator.state import reconcile as decide
from coordinator.state.requests import QUEUED
from smoltorrent import defaults
from tasks.app import app
from tasks.chain_batches import chain_entries
from tasks.context import metadata
from tasks.enqueue import (
    redrive_request,
    send_commit,
    send_drop_spool,
    send_remove,
    send_transfers,
    transfer_time_limit,
)

log = get_task_logger(__name__)

REQUEST_TASKS = ("smoltorrent.store", "smoltorrent.gather")
DELIVERY_TASKS = ("smoltorrent.transfer", "smoltorrent.chain")
COMMIT_TASK = "smoltorrent.commit"
ACCEPT = ["application/json"]  # what tasks/app.py accepts: a queued pickle is never loaded

# (task name, task id, args, kwargs) of one task a live worker or a queue holds
TaskCall = tuple[str, str, list, dict]


def queued(channel, queues: list[str]) -> list[TaskCall]:
    """The task messages waiting in `queues`, read from the Redis transport's lists (one
    per priority step) through the consumer's own channel; none is taken off."""
    out = []
    keys = [channel._q_for_pri(q, priority) for q in queues for priority in channel.priority_steps]
    # A client of its own: the channel's `client` is the asynchronous one its BRPOP uses.
    with channel.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.lrange(key, 0, -1)
        lists = pipe.execute()
    for raws in lists:
        out += [c for raw in raws if (c := _call(channel, json.loads(raw))) is not None]
    return out


def fetched(channel) -> list[TaskCall]:
    """The task messages a worker has taken off a queue and not acked: prefetched, waiting
    out a retry's countdown, or running (the Redis transport's unacked hash)."""
    with channel.conn_or_acquire() as client:
        raws = client.hvals(channel.unacked_key)
    return [c for raw in raws if (c := _call(channel, json.loads(raw)[0])) is not None]


def _call(channel, payload: dict) -> TaskCall | None:
    message = channel.Message(payload, channel=channel, accept=ACCEPT)
    try:
        args, kwargs, _ = message.decode()
    except (ContentDisallowed, DecodeError, ValueError):
        return None  # not one of ours: it holds nothing of this host's work
    return (message.headers.get("task"), message.headers.get("id"), args, kwargs)


def held(calls: list[TaskCall]) -> decide.Held:
    requests, shards, commits = set(), set(), set()
    for name, task_id, args, kwargs in calls:
        if name in REQUEST_TASKS:
            requests.add(kwargs.get("request_id") or task_id)
        elif name == "smoltorrent.chain":  # a batch holds every chunk it carries
            shards |= {(kwargs["vkey"], e.shard) for e in chain_entries(kwargs)}
        elif name in DELIVERY_TASKS:
            shards.add((kwargs["vkey"], int(kwargs["shard"])))
        elif name == COMMIT_TASK and args:
            commits.add(args[0])
    return decide.Held(frozenset(requests), frozenset(shards), frozenset(commits))


def _stale_after(vkey: str, version: dict[str, str]) -> float:
    """How long a pending version's transfers can legitimately stay silent: the longest
    hard time limit of its shards, then every backoff step of its retries."""
    sizes = [s.blob_size for s in metadata().versions.manifest(vkey).entries] or [0]
    retries = config.transfer_retries()
    backoff = sum(
        min(defaults.RETRY_BACKOFF_BASE_S * 2**n, defaults.RETRY_BACKOFF_MAX_S)
        for n in range(retries)
    )
    return transfer_time_limit(max(sizes)) * (retries + 1) + backoff + config.reconcile_grace()


def in_broker(md) -> decide.Held:
    """The store and gather tasks still in the broker for the hosts with queued requests:
    waiting in their queue, or taken off it by a worker and not acked. Such a request is
    only waiting its turn (a backlog), not lost; sending it again would run it twice."""
    hosts = {r.get("host") for _, r in md.requests.open_requests() if r.get("state") == QUEUED}
    if not hosts:
        return decide.Held()
    with app.connection_for_read() as connection:
        channel = connection.default_channel
        calls = queued(channel, [config.host_queue(h) for h in sorted(hosts)]) + fetched(channel)
    return held(calls)


def run_pass(started_host: str | None = None) -> dict[str, int]:
    md = metadata()
    actions = decide.plan(
        md,
        md.sweeps.redis_time(),  # the clock the timestamps it compares were written on
        grace=config.reconcile_grace(),
        stale_after=_stale_after,
        deadline=defaults.PENDING_DEADLINE_S,
        started_host=started_host,
        held=None if started_host else in_broker(md),
    )
    counts = execute(md, actions)
    if any(counts.values()):
        log.warning(
            "reconcile%s: %s", f" at start of {started_host}" if started_host else "", counts
        )
    return counts


def execute(md, actions: decide.Actions) -> dict[str, int]:
    """Send what a pass decided; how many of each."""
    for rid, record in actions.requests:
        redrive_request(rid, record)
    for vkey in actions.transfers:
        v, plan = md.versions.version(vkey), md.transfers.plan(vkey)
        manifest = md.versions.manifest(vkey)
        busy = actions.busy.get(vkey, set())
        # A task delivering a blob serves every entry using it (Manifest.first_uses).
        busy |= {i for i, first in enumerate(manifest.first_uses()) if first in busy}
        skip = md.transfers.settled(vkey) | {f"{s}:{r}" for s in busy for r in range(len(plan[s]))}
        send_transfers(vkey, manifest, plan, v["host"], skip=skip)
        md.transfers.mark_resent(vkey)
    for vkey in actions.commits:
        send_commit(vkey)
        md.transfers.mark_commit_enqueued(vkey)
    for vkey, reason in actions.aborts:
        if md.versions.abort(vkey, reason):
            send_drop_spool(vkey, md.versions.version(vkey)["host"])
    for vkey in actions.removes:
        send_remove(vkey)
    return actions.counts()


@sweep("reconcile")
def reconcile() -> dict[str, int]:
    """One pass over every host's requests and versions."""
    return run_pass()
