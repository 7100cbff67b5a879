"""Commit: make a version durable on the nodes, then flip the name's current version."""

from __future__ import annotations

from coordinator import config
from coordinator.dataplane.store_engine import write_manifest
from coordinator.state.metadata import COMMITTED, PENDING
from smoltorrent import defaults
from smoltorrent.errors import NodeError, NodeUnavailableError, SmoltorrentError
from tasks.app import app
from tasks.context import REDIS_TRANSIENT, metadata, node_client


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
    holders = sorted(
        {n for s in manifest.shards for n in md.placement(s.blob_sha256) if n in registered}
    )
    # Every node holding a blob also keeps the manifest: Redis can be rebuilt from them.
    write_manifest(manifest, [node_client(n, registered) for n in holders])
    md.commit(vkey, manifest.name)
    return COMMITTED
