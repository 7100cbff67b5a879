"""One shard to all its nodes by chain replication: the default for R >= 2.

The source sends the shard once, to the head of the chain, and the nodes pass it on
to each other (coordinator/dataplane/chain_engine.py). Every replica settles in the
commit barrier on its own, as a per-replica transfer does: a placed one at once, with
the node that really holds it (a lost node's replica moves to another live node); the
rest retry with the same exact 2^n backoff, and dead-letter when the retries run out.
A retry only moves what is still unsettled.
"""

from __future__ import annotations

import json
from collections import Counter

from celery.utils.log import get_task_logger

from coordinator import config
from coordinator.dataplane.bandwidth import raw_size
from coordinator.dataplane.chain_engine import Target, pick_spare, store_shard_chain
from coordinator.dataplane.chunk_source import release, spool_dir
from coordinator.plan.source_file import SourceIdentity
from coordinator.state import trim_marks
from coordinator.state.versions import ABORTED, REMOVED, REMOVING
from smoltorrent import defaults
from smoltorrent.errors import (
    NodeError,
    NodeUnavailableError,
    NotFoundError,
    SourceChangedError,
)
from tasks.app import app
from tasks.context import metadata, node_client
from tasks.delivery_policy import DELIVERY_TASK_OPTIONS, RETRYABLE, abandon
from tasks.enqueue import settle
from tasks.sent_progress import delivery_meter, record_wire, sent_recorder

log = get_task_logger(__name__)


@app.task(name="smoltorrent.chain", **DELIVERY_TASK_OPTIONS)
def chain_transfer(
    self,
    vkey: str,
    name: str,
    shard: int,
    replicas: list[int],
    node_ids: list[str],
    digest: str,
    same: list[int] = (),
) -> dict:
    """Make the nodes of `node_ids` (replicas `replicas` of shard `shard`, in chain order)
    hold the shard; settle each replica in the barrier as it is placed, for the shard and
    for the later entries `same` with its blob (tasks/enqueue.py send_transfers). Returns
    how each node got it: {"how": ..., "nodes": {node id: "sent" | "replicated" | "exists"}}."""
    md = metadata()
    try:
        v = md.versions.version(vkey)
    except NotFoundError:
        return {"how": "version removed", "nodes": {}}
    if v["state"] in (ABORTED, REMOVING, REMOVED):
        return {"how": f"version {v['state']}", "nodes": {}}
    if md.blobs.blob_deleting(digest):
        raise self.retry(countdown=defaults.REMOVING_WAIT_S)
    span = md.transfers.span(vkey, shard)
    plan = md.transfers.plan(vkey)[shard]
    registered = md.nodes.nodes()
    holding = md.blobs.placement(digest)
    # The plan names the node a replica moved to if an earlier try replaced a lost one. A
    # replica is done when its node holds a verified copy (settled is not enough: a dead
    # letter settles too, and its replay must still place the copy).
    todo = [
        (r, plan[r] if r < len(plan) else n)
        for r, n in zip(replicas, node_ids, strict=True)
        if (plan[r] if r < len(plan) else n) not in holding
    ]
    if trim_marks.marked(md, digest, {n for _, n in todo}):
        # A trim is deleting a target's copy: a put now could land before that delete.
        raise self.retry(countdown=defaults.REMOVING_WAIT_S)
    for r, n in zip(replicas, node_ids, strict=True):
        node = plan[r] if r < len(plan) else n
        if node in holding:  # placed by an earlier try that died before settling it
            # held: refused if a trim took it out of the placement since the read above
            settle(vkey, shard, r, node, digest, name, held=True, same=same)
    if not todo:
        return {"how": "exists", "nodes": {}}
    # Nodes another transfer just could not reach: neither a target nor a spare while
    # another node can take the copy, so this transfer does not wait out the same timeout.
    unreachable = md.nodes.unreachable(registered)
    keep_off = set(plan) | holding | {n for _, n in todo}
    blob_size = span.size
    meter = delivery_meter(v, vkey)  # what the source sends, on one bucket with the others

    def spare(seen: set[str]) -> Target | None:
        found = spare_for(
            registered, keep_off | seen | unreachable, blob_size, md.transfers.plan(vkey), digest
        )
        if found is not None:
            found.client = found.client.paced(meter.wire)
        return found

    targets, lost = [], []
    for r, n in todo:  # in chain order; nodes holding the blob head it (holders below)
        if n in registered and n not in unreachable:
            targets.append(Target(r, n, node_client(n, registered).paced(meter.wire)))
        else:
            lost.append((r, n))
    for r, n in lost:  # removed from the cluster or unreachable: another takes the replica
        replacement = spare({t.node_id for t in targets})
        if replacement is None and n in registered:  # no other node: try it after all
            targets.append(Target(r, n, node_client(n, registered).paced(meter.wire)))
            continue
        if replacement is None:
            raise NodeUnavailableError(
                f"node {n} is not registered and no other node can hold"
                f" shard {shard}; see `smoltorrent nodes ls`."
            )
        replacement.replica = r
        keep_off.add(replacement.node_id)
        for index in [shard, *same]:
            md.transfers.replace_target(vkey, index, r, n, replacement.node_id)
        targets.append(replacement)
    holders = [
        node_client(h, registered)
        for h in sorted(holding)
        if h in registered and h not in {t.node_id for t in targets}
    ]
    base = {"shard": shard, "attempt": self.request.retries, "chain": True}
    try:
        outcome = store_shard_chain(
            v["path"],
            SourceIdentity.from_dict(json.loads(v["identity"])),
            span,
            targets,
            holders,
            spare,
            sent_recorder(md, vkey, shard),
            spool_dir(config.spool_root(), vkey),
        )
        # Raw bytes once per send from the source (one send feeds the whole chain).
        meter.raw(raw_size(span) * (outcome.bytes_from_source // max(span.size, 1)))
    except SourceChangedError as exc:
        md.transfers.record_attempt(vkey, {**base, "error": str(exc)})
        abandon(vkey, v, str(exc))
        return {"how": "source changed", "nodes": {}}
    finally:
        record_wire(md, vkey, meter)
    for r, (old, new) in outcome.replaced.items():
        if r not in outcome.placed:
            continue
        for index in [shard, *same]:
            if md.transfers.replace_target(vkey, index, r, old, new):
                log.warning(
                    "%s shard %d: replica %d moved from node %s to %s", name, index, r, old, new
                )
    for r, node, exc in outcome.lost:
        md.transfers.record_attempt(
            vkey, {**base, "replica": r, "node": node, "error": f"replaced: {exc}"}
        )
    md.nodes.mark_unreachable(
        {node for _, node, exc in outcome.lost if isinstance(exc, NodeUnavailableError)}
        | {node for node, exc in outcome.failed.values() if isinstance(exc, NodeUnavailableError)}
    )
    for r, (node, how) in sorted(outcome.placed.items()):
        md.transfers.record_attempt(vkey, {**base, "replica": r, "node": node, "result": how})
        settle(vkey, shard, r, node, digest, name, same=same)
    for r, (node, exc) in sorted(outcome.failed.items()):
        md.transfers.record_attempt(vkey, {**base, "replica": r, "node": node, "error": str(exc)})
    if outcome.failed:
        errors = [exc for _, exc in outcome.failed.values()]
        first = next((e for e in errors if isinstance(e, RETRYABLE)), None)
        error = first or NodeError("internal", "; ".join(str(e) for e in errors))
        # A dead letter names the nodes that failed, not the whole chain.
        error.node_id = ",".join(node for node, _ in outcome.failed.values())
        raise error
    release(span)  # every replica of this chain is placed: its spooled chunk is done
    nodes = {node: how for node, how in outcome.placed.values()}
    return {"how": "+".join(sorted(set(nodes.values()))), "nodes": nodes}


def spare_for(
    registered, keep_off: set[str], size: int, plan: list[list[str]], digest: str
) -> Target | None:
    """Another node for a lost replica (see chain_engine.pick_spare), as a chain target:
    the version's plan says how many replicas each node already takes."""
    candidates = {n: rec.address for n, rec in registered.items() if n not in keep_off}
    planned = Counter(n for nodes in plan for n in nodes)
    node_id = pick_spare(candidates, size, config.cluster_key(), planned=planned, spread=digest)
    return None if node_id is None else Target(-1, node_id, node_client(node_id, registered))
