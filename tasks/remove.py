"""Remove a version: mark it removing, clean the nodes, and only then forget it.

The order makes a remove resumable: a crash or a down node leaves the version
"removing" (never gatherable, never rebuilt, never re-committed), and running
the remove again finishes it. Redis keys go last.
"""

from __future__ import annotations

from coordinator.state.metadata import REMOVED
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
    found = md.begin_remove(vkey)
    if found in (None, REMOVED):
        return {"vkey": vkey, "removed": False, "blobs_deleted": 0}
    manifest = md.manifest(vkey)
    registered = md.nodes()
    deleted, kept = 0, []
    holders_of_manifest = set()
    for shard in manifest.shards:
        holders = md.placement(shard.blob_sha256)
        holders_of_manifest |= holders
        if md.blob_in_use(shard.blob_sha256, besides=vkey):
            continue  # shared with another version (content addressing)
        for node_id in holders:
            if node_id not in registered:
                continue
            try:
                node_client(node_id, registered).delete(shard.blob_sha256)
                md.remove_placement(shard.blob_sha256, node_id)
                deleted += 1
            except (NodeUnavailableError, NodeError) as exc:
                kept.append(f"{shard.blob_sha256[:12]} on {node_id}: {exc}")
    for node_id in holders_of_manifest & set(registered):
        try:
            node_client(node_id, registered).delete_manifest(vkey)
        except (NodeUnavailableError, NodeError) as exc:
            kept.append(f"manifest on {node_id}: {exc}")
    if not kept:
        md.finish_remove(vkey)
    return {"vkey": vkey, "removed": True, "blobs_deleted": deleted, "left_behind": kept}
