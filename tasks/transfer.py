"""One (shard, replica) transfer: idempotent, retried with exact 2^n backoff."""

from __future__ import annotations

import json

from celery.utils.log import get_task_logger

from coordinator import config
from coordinator.dataplane.store_engine import send_shard
from coordinator.plan.manifest import blob_prefixes
from coordinator.plan.source_file import SourceIdentity
from coordinator.state.metadata import ABORTED, REMOVED, REMOVING
from smoltorrent import defaults
from smoltorrent.errors import (
    NodeError,
    NodeUnavailableError,
    NotFoundError,
    ProtocolError,
    SourceChangedError,
)
from tasks.app import app
from tasks.context import REDIS_TRANSIENT, metadata, node_client
from tasks.enqueue import send_store, settle

log = get_task_logger(__name__)

# A node that is down, full or answering garbage may be fine on the next try.
RETRYABLE = (NodeUnavailableError, NodeError, ProtocolError)


@app.task(
    name="smoltorrent.transfer",
    bind=True,
    autoretry_for=RETRYABLE + REDIS_TRANSIENT,
    retry_backoff=defaults.RETRY_BACKOFF_BASE_S,
    retry_backoff_max=defaults.RETRY_BACKOFF_MAX_S,
    retry_jitter=False,
    max_retries=config.transfer_retries(),
    # A retry after worker loss waits default_retry_delay (180 s in Celery), not the backoff.
    default_retry_delay=defaults.RETRY_BACKOFF_BASE_S,
)
def transfer(
    self, vkey: str, name: str, shard: int, replica: int, node_id: str, digest: str
) -> str:
    """Make node `node_id` hold shard `shard` of version `vkey`; settle it in the barrier."""
    md = metadata()
    try:
        v = md.version(vkey)
    except NotFoundError:
        return "version removed"
    if v["state"] in (ABORTED, REMOVING, REMOVED):
        return f"version {v['state']}"
    if md.blob_deleting(digest):
        # A remove is deleting this very blob from the nodes: a copy found there now may
        # vanish, so send it afresh once the remove is done with it.
        raise self.retry(countdown=defaults.REMOVING_WAIT_S)
    manifest = md.manifest(vkey)
    attempt = {"shard": shard, "replica": replica, "node": node_id, "attempt": self.request.retries}
    try:
        registered = md.nodes()
        target = node_client(node_id, registered)
        holders = [
            node_client(h, registered)
            for h in sorted(md.placement(digest))
            if h != node_id and h in registered
        ]
        how = send_shard(
            v["path"],
            SourceIdentity.from_dict(json.loads(v["identity"])),
            manifest,
            shard,
            blob_prefixes(manifest)[shard],
            target,
            holders,
        )
    except SourceChangedError as exc:
        md.record_attempt(vkey, {**attempt, "error": str(exc)})
        abandon(vkey, v, str(exc))
        return "source changed"
    except RETRYABLE as exc:
        md.record_attempt(vkey, {**attempt, "error": str(exc)})
        raise
    md.record_attempt(vkey, {**attempt, "result": how})
    settle(vkey, shard, replica, node_id, digest, name)
    return how


def abandon(vkey: str, version: dict, reason: str) -> None:
    """Abort a version whose source was rewritten, and store the new bytes once stable."""
    md = metadata()
    md.abort(vkey, reason)  # a no-op on a version that committed meanwhile
    if md.state(vkey) == ABORTED and md.claim(vkey, "restore_enqueued"):
        log.warning("%s: %s", version["name"], reason)
        shards = int(version.get("requested_shards") or 0) or None
        send_store(
            version["path"],
            version["name"],
            int(version["replicas"]),
            shards,
            version["host"],
            countdown=defaults.STABLE_AFTER_S,
        )
