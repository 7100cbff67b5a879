"""The repair steps themselves, callable with or without Celery (the repair task and
`smoltorrent verify` both run them): copy a blob node to node, trim surplus copies.

Every step reads the placement again before acting, so a retry, a redelivery or two
sweeps sending the same step leave the same state as one clean run.
"""

from __future__ import annotations

import logging

from coordinator.dataplane.node_client import NodeClient
from coordinator.state import repairs, trim_marks
from coordinator.state.metadata import Metadata
from coordinator.state.nodes import NodeRecord
from smoltorrent.errors import (
    NodeError,
    NodeUnavailableError,
)

log = logging.getLogger(__name__)

# What a node may answer when it cannot take part in a step right now.
UNREACHABLE = (NodeUnavailableError, NodeError)


def copy_blobs(
    md: Metadata,
    nodes: dict[str, NodeRecord],
    cluster_key: bytes | None,
    digests: list[str],
    source: str,
    target: str,
    rate: int = 0,
) -> dict[str, str]:
    """Make `target` hold a verified copy of each of `digests`, pushed by `source` in one
    node-to-node session (replicate_batch) at `rate` bytes/s at most, and only then count
    it in the placement. Digest -> what happened: stored, exists, unused, source-bad,
    source-missing, or "failed: why" for a copy the target did not take (the caller backs
    that target off for that blob alone). NodeUnavailableError or NodeError if the source
    could not be asked at all."""
    out: dict[str, str] = {}
    asked = []
    for digest in digests:
        if target in md.blobs.placement(digest):
            out[digest] = "exists"  # a redelivery of a repair that finished
        elif not md.blobs.blob_refs(digest) or md.blobs.blob_deleting(digest):
            out[digest] = "unused"  # removed meanwhile: nothing to repair
        else:
            asked.append(digest)
    if not asked:
        return out
    sender = NodeClient(nodes[source].address, cluster_key=cluster_key)
    answers = sender.replicate_batch(asked, nodes[target].address, rate)
    mismatched = [d for d in asked if answers[d] == "mismatch"]
    # The target hashed other bytes than the digest: the sender's copy is bad, or the
    # target corrupts what it receives. The sender re-hashes its copies to tell (and
    # quarantines the bad ones); a good one leaves the fault with the target.
    bad = set(sender.verify(mismatched)) if mismatched else set()
    unused = []
    for digest in asked:
        how = answers[digest]
        if how in ("stored", "exists"):
            if repairs.placed(md, digest, target):
                repairs.count(md, "repaired")
                out[digest] = how
            else:
                unused.append(digest)
                out[digest] = "unused"
        elif how == "missing":
            md.blobs.remove_placement(digest, source)
            log.error("repair of %s: %s no longer holds it; out of the placement", digest, source)
            out[digest] = "source-missing"
        elif how == "mismatch" and digest in bad:
            md.blobs.remove_placement(digest, source)
            log.error("repair of %s: the copy on %s is bad; quarantined there", digest, source)
            out[digest] = "source-bad"
        elif how == "mismatch":
            out[digest] = f"failed: {target} hashed other bytes than a good copy of it"
        else:
            out[digest] = how if how.startswith("failed: ") else f"failed: {how}"
    copied = sum(1 for how in out.values() if how == "stored")
    log.info("repaired %d of %d blobs: %s -> %s", copied, len(digests), source, target)
    for digest in unused:  # removed while it travelled: the copy is an orphan at once
        try:
            NodeClient(nodes[target].address, cluster_key=cluster_key).delete(digest)
        except UNREACHABLE:
            continue  # the crosscheck collects it
    return out


def trim_blob(
    md: Metadata,
    nodes: dict[str, NodeRecord],
    cluster_key: bytes | None,
    digest: str,
    replicas: int,
    up: dict[str, dict],
) -> dict:
    """Delete the copies of `digest` above `replicas` on the up nodes `up` (node id -> its
    last stat), keeping the copies on the nodes with the most free space. Keepers are
    re-hashed first (a bad one is quarantined there and replaced by the next holder): a
    copy is deleted only while `replicas` verified copies stay, and only while more
    copies stay than any version using the blob asks for now (a store that began using
    it after the sweep decided, maybe at a higher R, is counted as each copy is marked for
    its delete: coordinator/state/trim_marks.py)."""
    holders = sorted(
        md.blobs.placement(digest) & set(up) & set(nodes),
        key=lambda n: (-int(up[n].get("free_bytes", 0)), n),
    )
    if len(holders) <= replicas:
        return {"kept": holders, "deleted": []}
    keep, spare = [], []
    for node_id in holders:
        if len(keep) == replicas:
            spare.append(node_id)
            continue
        try:
            bad = NodeClient(nodes[node_id].address, cluster_key=cluster_key).verify([digest])
        except UNREACHABLE:
            continue  # neither kept nor deleted: it may be back next pass
        if digest in bad:
            md.blobs.remove_placement(digest, node_id)
            continue
        keep.append(node_id)
    if len(keep) < replicas:
        return {"kept": keep, "deleted": []}
    deleted = []
    for node_id in spare:
        # Marked and out of the placement in one step, only if still surplus: a store that
        # started using the blob since the sweep decided (at a higher R, its copies settled
        # on these very nodes) keeps them; one that starts later sends the blob here again
        # once the delete is done (trim_marks explains every order).
        outcome = trim_marks.mark(md, digest, node_id, replicas, up)
        if outcome == 0:
            break
        if outcome < 0:
            continue  # no longer listed (found bad, or trimmed by another run)
        try:
            NodeClient(nodes[node_id].address, cluster_key=cluster_key).delete(digest)
        except UNREACHABLE:
            # Whether the delete happened (or will) is unknown: the copy stays out of the
            # placement (the crosscheck lists it again if it is still there) and the mark
            # stands until it expires, so no store counts it meanwhile.
            log.warning("trim of %s on %s: the delete was not answered", digest, node_id)
            continue
        trim_marks.clear(md, digest, node_id)
        deleted.append(node_id)
        log.info("trimmed the surplus copy of %s on %s", digest, node_id)
    if deleted:
        repairs.count(md, "trimmed", len(deleted))
    return {"kept": keep, "deleted": deleted}


def settle_quarantined(
    md: Metadata,
    nodes: dict[str, NodeRecord],
    cluster_key: bytes | None,
    node_id: str,
    quarantined: list[str],
    counted: set[str],
) -> dict[str, list[str]]:
    """A node's quarantined (bad) copies: each leaves the placement at once (the node
    already keeps it out of reads), so the repair sweep copies the blob again, possibly
    to this very node, whose put replaces the bad copy (a two-node cluster cannot
    deadlock). A quarantined copy is discarded only once a good copy is counted on
    another node `counted` (not dead), or once no version uses the blob."""
    released, discarded = [], []
    client = NodeClient(nodes[node_id].address, cluster_key=cluster_key)
    # The list may predate a repair that already put a good copy there (which releases the
    # quarantined one): such a copy stays in the placement.
    whole = client.has(quarantined) if quarantined else set()
    for digest in quarantined:
        if digest in whole:
            continue
        if node_id in md.blobs.placement(digest):
            md.blobs.remove_placement(digest, node_id)
            released.append(digest)
            log.warning("bad copy of %s on %s: out of the placement", digest, node_id)
        elsewhere = (md.blobs.placement(digest) - {node_id}) & counted
        if (elsewhere or not md.blobs.blob_refs(digest)) and client.discard(digest):
            discarded.append(digest)
    return {"released": released, "discarded": discarded}


def check_bad_copy(
    md: Metadata,
    nodes: dict[str, NodeRecord],
    cluster_key: bytes | None,
    digest: str,
    node_id: str,
) -> bool:
    """A copy a gather found corrupt: its node re-hashes it (quarantining a bad one), and
    a copy that is bad or gone leaves the placement (True). The report is forgotten once
    its node answered. UNREACHABLE if it did not (the report stays, asked again)."""
    if node_id not in nodes:
        md.blobs.forget_bad_copy(digest, node_id)
        return False
    bad = NodeClient(nodes[node_id].address, cluster_key=cluster_key).verify([digest])
    if digest in bad:
        md.blobs.remove_placement(digest, node_id)
    md.blobs.forget_bad_copy(digest, node_id)
    return digest in bad


def check_reported_bad(
    md: Metadata, nodes: dict[str, NodeRecord], cluster_key: bytes | None
) -> list[tuple[str, str]]:
    """Every copy a gather found corrupt, checked (check_bad_copy). (digest, node) of those
    that left the placement."""
    out = []
    for digest, node_id in md.blobs.reported_bad_copies():
        try:
            if check_bad_copy(md, nodes, cluster_key, digest, node_id):
                out.append((digest, node_id))
        except UNREACHABLE:
            continue  # asked again next pass
    return out
