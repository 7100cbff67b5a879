"""What a shard delivery task (`transfer`: one replica; `chain`: a shard's chain) does
on failure: which errors it retries, its retry options, and what a changed source does
to the version. One place, so the two tasks can never drift apart."""

from __future__ import annotations

import shutil
from typing import NoReturn

from celery.exceptions import Ignore
from celery.utils.log import get_task_logger

from coordinator import config
from coordinator.dataplane.chunk_source import spool_dir
from coordinator.state.versions import ABORTED
from smoltorrent import defaults
from smoltorrent.errors import NodeError, NodeUnavailableError, ProtocolError
from tasks.context import REDIS_TRANSIENT, metadata
from tasks.enqueue import send_store

log = get_task_logger(__name__)

# A node that is down, full or answering garbage may be fine on the next try.
RETRYABLE = (NodeUnavailableError, NodeError, ProtocolError)

DELIVERY_TASK_OPTIONS = {
    "bind": True,
    "autoretry_for": RETRYABLE + REDIS_TRANSIENT,
    "retry_backoff": defaults.RETRY_BACKOFF_BASE_S,
    "retry_backoff_max": defaults.RETRY_BACKOFF_MAX_S,
    "retry_jitter": False,
    "max_retries": config.transfer_retries(),
}


def abandon(vkey: str, version: dict, reason: str) -> None:
    """Abort a version whose source was rewritten, and store the new bytes once stable."""
    spool = spool_dir(config.spool_root(), vkey)  # a key that is no version's: refused
    md = metadata()
    md.versions.abort(vkey, reason)  # a no-op on a version that committed meanwhile
    if md.versions.state(vkey) == ABORTED:  # its encoded chunks are of no use now
        shutil.rmtree(spool, ignore_errors=True)
    if md.versions.state(vkey) == ABORTED and md.versions.claim(vkey, "restore_enqueued"):
        log.warning("%s: %s", version["name"], reason)
        shards = int(version.get("requested_shards") or 0) or None
        send_store(
            version["path"],
            version["name"],
            int(version["replicas"]),
            shards,
            version["host"],
            countdown=defaults.STABLE_AFTER_S,
            bwlimit=int(version["bwlimit"]) if "bwlimit" in version else None,
        )


def wait_for_remove(task, digest: str) -> NoReturn:
    """A remove is deleting blob `digest` from the nodes (its tombstone): a copy found there
    now may vanish, so `task` is sent again in REMOVING_WAIT_S to send the blob afresh once
    the remove is done with it. A wait is no failed try, so it does not count toward the
    task's retries: a remove a down node holds open keeps the tombstone until it is sent
    again (reconcile, every minute) and sees this version use the blob, and retries
    counted that way dead-lettered the store in about 30 s. Ignore is raised."""
    log.info(
        "%s waits for the remove deleting %s; again in %.0f s",
        task.name,
        digest[:12],
        defaults.REMOVING_WAIT_S,
    )
    task.signature_from_request(
        task.request, countdown=defaults.REMOVING_WAIT_S, retries=task.request.retries
    ).apply_async()
    raise Ignore()
