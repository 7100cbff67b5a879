"""The reconcile sweep: re-drive every open request and pending or removing version
that no live task is moving (coordinator/state/reconcile.py decides what), on the
beat schedule and at every worker start (step 3 of beat/boot.py)."""

from __future__ import annotations

import time

from celery.utils.log import get_task_logger

from beat.sweeps import sweep
from coordinator import config
from coordinator.state import reconcile as decide
from smoltorrent import defaults
from tasks.context import metadata
from tasks.enqueue import (
    redrive_request,
    send_commit,
    send_remove,
    send_transfers,
    transfer_time_limit,
)

log = get_task_logger(__name__)


def _stale_after(vkey: str, version: dict[str, str]) -> float:
    """How long a pending version's transfers can legitimately stay silent: the longest
    hard time limit of its shards, then every backoff step of its retries."""
    sizes = [s.blob_size for s in metadata().manifest(vkey).shards] or [0]
    retries = config.transfer_retries()
    backoff = sum(
        min(defaults.RETRY_BACKOFF_BASE_S * 2**n, defaults.RETRY_BACKOFF_MAX_S)
        for n in range(retries)
    )
    return transfer_time_limit(max(sizes)) * (retries + 1) + backoff + config.reconcile_grace()


def run_pass(started_host: str | None = None) -> dict[str, int]:
    md = metadata()
    actions = decide.plan(
        md,
        time.time(),
        grace=config.reconcile_grace(),
        stale_after=_stale_after,
        deadline=defaults.PENDING_DEADLINE_S,
        started_host=started_host,
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
        v, plan = md.version(vkey), md.plan(vkey)
        busy = actions.busy.get(vkey, set())
        skip = md.settled(vkey) | {f"{s}:{r}" for s in busy for r in range(len(plan[s]))}
        send_transfers(vkey, md.manifest(vkey), plan, v["host"], skip=skip)
        md.mark_resent(vkey)
    for vkey in actions.commits:
        send_commit(vkey)
        md.mark_commit_enqueued(vkey)
    for vkey, reason in actions.aborts:
        md.abort(vkey, reason)
    for vkey in actions.removes:
        send_remove(vkey)
    return actions.counts()


@sweep("reconcile")
def reconcile() -> dict[str, int]:
    """One pass over every host's requests and versions."""
    return run_pass()
