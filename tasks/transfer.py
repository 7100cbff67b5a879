"""One (shard, replica) transfer: idempotent, retried with exact 2^n backoff."""

from __future__ import annotations

import json
from collections import Counter
from functools import partial

from celery.utils.log import get_task_logger

from coordinator import config
from coordinator.dataplane.bandwidth import raw_size
from coordinator.dataplane.chain_engine import pick_spare, replaceable
from coordinator.dataplane.chunk_source import release, spool_dir
from coordinator.dataplane.store_engine import send_shard
from coordinator.plan.source_file import SourceIdentity
from coordinator.state import trim_marks
from coordinator.state.versions import ABORTED, REMOVED, REMOVING
from smoltorrent import defaults
from smoltorrent.errors import (
    NotFoundError,
    SourceChangedError,
)
from tasks.app import app
from tasks.context import metadata, node_client
from tasks.delivery_policy import DELIVERY_TASK_OPTIONS, RETRYABLE, abandon, wait_for_remove
from tasks.enqueue import settle
from tasks.sent_progress import delivery_meter, record_wire, sent_recorder

log = get_task_logger(__name__)


@app.task(name="smoltorrent.transfer", **DELIVERY_TASK_OPTIONS)
def transfer(
    self,
    vkey: str,
    name: str,
    shard: int,
    replica: int,
    node_id: str,
    digest: str,
    same: list[int] = (),
) -> str:
    """Make node `node_id` hold shard `shard` of version `vkey`; settle it in the barrier,
    with the later entries `same` that use its blob (tasks/enqueue.py send_transfers)."""
    md = metadata()
    try:
        v = md.versions.version(vkey)
    except NotFoundError:
        return "version removed"
    if v["state"] in (ABORTED, REMOVING, REMOVED):
        return f"version {v['state']}"
    if md.blobs.blob_deleting(digest):
        wait_for_remove(self, digest)
    if trim_marks.marked(md, digest, [node_id]):
        # A trim is deleting the node's copy: a put now could land before that delete.
        raise self.retry(countdown=defaults.REMOVING_WAIT_S)
    span = md.transfers.span(vkey, shard)
    attempt = {"shard": shard, "replica": replica, "node": node_id, "attempt": self.request.retries}
    meter = delivery_meter(v, vkey)
    try:
        return _deliver(md, v, vkey, name, span, replica, node_id, meter, attempt, same)
    finally:
        record_wire(md, vkey, meter)


def _deliver(md, v, vkey, name, span, replica, node_id, meter, attempt, same) -> str:
    """Send the replica from the source, paced by `meter` (or have a holder push it, or
    move it to a spare), then settle it; how it was placed."""
    shard, digest = span.index, span.digest
    try:
        registered = md.nodes.nodes()
        target = node_client(node_id, registered).paced(meter)
        holders = [
            node_client(h, registered)
            for h in sorted(md.blobs.placement(digest))
            if h != node_id and h in registered
        ]
        how = send_shard(
            v["path"],
            SourceIdentity.from_dict(json.loads(v["identity"])),
            span,
            target,
            holders,
            progress=partial(sent_recorder(md, vkey, shard), (replica,)),
            spool=spool_dir(config.spool_root(), vkey),
        )
    except SourceChangedError as exc:
        md.transfers.record_attempt(vkey, {**attempt, "error": str(exc)})
        abandon(vkey, v, str(exc))
        return "source changed"
    except RETRYABLE as exc:
        md.transfers.record_attempt(vkey, {**attempt, "error": str(exc)})
        moved = move_to_spare(md, v, vkey, span, replica, node_id, exc, meter, same)
        if moved is None:
            raise
        spare_id, how = moved
        md.transfers.record_attempt(vkey, {**attempt, "node": spare_id, "result": how})
        settle(vkey, shard, replica, spare_id, digest, name, same=same)
        return how
    if how == "sent":
        meter.raw(raw_size(span))
    md.transfers.record_attempt(vkey, {**attempt, "result": how})
    settle(vkey, shard, replica, node_id, digest, name, same=same)
    if len(md.blobs.placement(digest)) >= len(md.transfers.plan(vkey)[shard]):
        release(span, spool_dir(config.spool_root(), vkey))  # every replica is placed
    return how


def move_to_spare(md, v, vkey, span, replica, node_id, exc, meter, same=()):
    """A target that stops answering, is full or corrupts what it is sent loses this replica
    to another live node that does not hold the shard: (that node, how it got the shard),
    or None when no node can take it (the transfer then retries and dead-letters)."""
    if not replaceable(exc):
        return None
    shard, digest = span.index, span.digest
    registered = md.nodes.nodes()
    holding = md.blobs.placement(digest)
    plan = md.transfers.plan(vkey)
    keep_off = set(plan[shard]) | holding
    candidates = {n: rec.address for n, rec in registered.items() if n not in keep_off}
    spare_id = pick_spare(
        candidates,
        span.size,
        config.cluster_key(),
        planned=Counter(n for nodes in plan for n in nodes),
        spread=digest,
    )
    if spare_id is None:
        return None
    holders = [node_client(h, registered) for h in sorted(holding) if h in registered]
    try:
        how = send_shard(
            v["path"],
            SourceIdentity.from_dict(json.loads(v["identity"])),
            span,
            node_client(spare_id, registered).paced(meter),
            holders,
            spool=spool_dir(config.spool_root(), vkey),
        )
    except RETRYABLE:
        return None
    if how == "sent":
        meter.raw(raw_size(span))
    for index in same:  # the later entries with this blob name the same node
        md.transfers.replace_target(vkey, index, replica, node_id, spare_id)
    if md.transfers.replace_target(vkey, shard, replica, node_id, spare_id):
        log.warning(
            "%s shard %d: replica %d moved from %s to %s",
            v["name"],
            shard,
            replica,
            node_id,
            spare_id,
        )
    return spare_id, how
