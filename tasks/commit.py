"""Commit: make a version durable on the nodes, then flip the name's current version."""

from __future__ import annotations

from coordinator import config
from coordinator.dataplane.store_engine import write_manifest
from coordinator.state.metadata import COMMITTED, PENDING
from smoltorrent import defaults
from smoltorrent.errors import NodeError, NodeUnavailableError, SmoltorrentError
from tasks.app import app
from tasks.context import REDIS_TRANSIENT, metadata, node_client
from tasks.enqueue import send_transfers


@app.task(
    name="smoltorrent.commit",
    bind=True,
    autoretry_for=(NodeUnavailableError, NodeError, *REDIS_TRANSIENT),
    retry_backoff=defaults.RETRY_BACKOFF_BASE_S,
    retry_backoff_max=defaults.RETRY_BACKOFF_MAX_S,
    retry_jitter=False,
    max_retries=config.transfer_retries(),
    default_retry_delay=defaults.RETRY_BACKOFF_BASE_S,  # after worker loss; see transfer
)
def commit(self, vkey: str) -> str:
    md = metadata()
    v = md.version(vkey)
    if v["state"] != PENDING:
        return v["state"]
    manifest = md.manifest(vkey)
    missing = sorted(set(range(len(manifest.shards))) - md.ready_shards(vkey))
    if missing:
        raise SmoltorrentError(
            f"{manifest.name}: shards {missing} have no verified replica yet; the version "
            "stays pending. Replay its dead letters (`smoltorrent dlq ls`) once nodes are back."
        )
    registered = md.nodes()
    # Placement says who got each blob; a remove or a repair may have deleted a copy since.
    # Ask the holders, and never commit a shard that no node really has.
    holders = confirm_holders(md, manifest, registered)
    lost = [i for i, s in enumerate(manifest.shards) if not holders.get(s.blob_sha256)]
    if lost:
        md.reopen_shards(vkey, lost)
        plan = md.plan(vkey)
        keep = {f"{i}:{r}" for i, t in enumerate(plan) for r in range(len(t)) if i not in lost}
        send_transfers(vkey, manifest, plan, v["host"], skip=keep)
        return f"shards {lost} had no copy left; sent again"
    # Every node holding a blob also keeps the manifest: Redis can be rebuilt from them.
    nodes = sorted(set().union(*holders.values()))
    write_manifest(manifest, [node_client(n, registered) for n in nodes])
    md.commit(vkey, manifest.name)
    return COMMITTED


def confirm_holders(md, manifest, registered) -> dict[str, set[str]]:
    """Digest -> the registered nodes that answer `has` for it now. A node that says no
    leaves the placement; one that does not answer is not counted."""
    asked: dict[str, set[str]] = {}
    for shard in manifest.shards:
        for node_id in md.placement(shard.blob_sha256) & set(registered):
            asked.setdefault(node_id, set()).add(shard.blob_sha256)
    out: dict[str, set[str]] = {}
    for node_id, digests in asked.items():
        try:
            present = node_client(node_id, registered).has(sorted(digests))
        except (NodeUnavailableError, NodeError):
            continue
        for digest in digests:
            if digest in present:
                out.setdefault(digest, set()).add(node_id)
            else:
                md.remove_placement(digest, node_id)
    return out
