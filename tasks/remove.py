"""Remove a version: mark it removing, clean the nodes, and only then forget it.

The order makes a remove resumable: a crash or a down node leaves the version
"removing" (never gatherable, never rebuilt, never re-committed), and running
the remove again finishes it. Redis keys go last.
"""

from __future__ import annotations

from coordinator import config
from coordinator.state.liveness import DEAD, node_health
from coordinator.state.versions import REMOVED
from smoltorrent import defaults
from smoltorrent.errors import NodeError, NodeUnavailableError
from tasks.app import app
from tasks.context import REDIS_TRANSIENT, metadata, node_client


@app.task(
    name="smoltorrent.remove",
    bind=True,
    autoretry_for=REDIS_TRANSIENT,
    retry_backoff=defaults.RETRY_BACKOFF_BASE_S,
    retry_jitter=False,
    max_retries=defaults.TRANSFER_RETRIES,
)
def remove(self, vkey: str) -> dict:
    md = metadata()
    found = md.removals.begin_remove(vkey)
    if found in (None, REMOVED):
        return {"vkey": vkey, "removed": False, "blobs_deleted": 0}
    registered = md.nodes.nodes()
    # A dead node's copies count no more (repair replaced them): the remove does not wait
    # for it, or a node lost for good kept every remove of its versions open for ever. What
    # it may hold of this version is left to the node's return: a blob no version uses is
    # the crosscheck's orphan, and the manifest is owed (deleted then, never rebuilt).
    dead = {n for n, h in node_health(md, config.dead_after()).items() if h.state == DEAD}
    manifest = md.versions.manifest(vkey)
    # Nodes that may hold its manifest: every holder of one of its blobs (a holder whose
    # copy is deleted below leaves the placement only once it answered), and every node
    # it was ever put on or found on: an extra holder of an under-replicated commit, a
    # node whose blob copies were trimmed since. A copy left on any of them lets a
    # rebuild bring the version back, its chunks held by the versions sharing them.
    involved = md.versions.manifest_nodes(vkey).union(
        *(md.blobs.placement(s.blob_sha256) for s in manifest.entries)
    )
    chunks: dict[str, list] = {}
    for chunk in manifest.chunks:
        chunks.setdefault(chunk.blob_sha256, []).append(chunk)
    deleted, kept = 0, []
    # Only blobs no other version uses: the reference sets decided, atomically with the
    # state change, which ones (a second run resumes the ones not yet deleted). Asked
    # again just before the delete: a remove a down node keeps open can be sent again
    # long after, when a new version has stored the same bytes.
    for digest in sorted(md.blobs.blobs_to_delete(vkey)):
        if not md.blobs.claim_delete(vkey, digest):
            continue
        gone, left = [], False
        for node_id in sorted(md.blobs.placement(digest)):
            if node_id not in registered or node_id in dead:
                continue
            try:
                node_client(node_id, registered).delete(digest)
                gone.append(node_id)
                deleted += 1
            except (NodeUnavailableError, NodeError) as exc:
                kept.append(f"{digest[:12]} on {node_id}: {exc}")
                left = True
        if not left:
            md.blobs.blob_deleted(vkey, digest, gone)
            # A later store must encode and send these bytes again, not count on them.
            md.chunks.forget((c.raw_sha256, digest) for c in chunks.get(digest, ()))
        else:
            # The copies deleted are gone now, whatever is left: a store of the same bytes
            # must not count on them.
            for node_id in gone:
                md.blobs.remove_placement(digest, node_id)
    # Ask every node: a manifest left on any of them would let rebuild bring it back.
    # Only a node that may hold it (involved) and cannot answer keeps the remove open.
    for node_id in registered:
        if node_id in dead:
            if node_id in involved:
                md.nodes.owe_manifest(node_id, vkey)
            continue
        try:
            node_client(node_id, registered).delete_manifest(vkey)
        except (NodeUnavailableError, NodeError) as exc:
            if node_id in involved:
                kept.append(f"manifest on {node_id}: {exc}")
    if not kept:
        md.dead_letters.drop_dead_letters_of(vkey)
        md.removals.finish_remove(vkey)  # Redis forgets it last: until then it stays "removing"
    return {"vkey": vkey, "removed": True, "blobs_deleted": deleted, "left_behind": kept}
