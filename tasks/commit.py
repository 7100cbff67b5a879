"""Commit: make a version durable on the nodes, then flip the name's current version."""

from __future__ import annotations

import contextlib
import dataclasses

from coordinator import config
from coordinator.dataplane.store_engine import write_manifest
from coordinator.state.marks import node_manifest
from coordinator.state.redis_keys import VERSION_WAKE
from coordinator.state.versions import COMMITTED, PENDING
from coordinator.state.wakeups import wake
from smoltorrent import defaults
from smoltorrent.errors import (
    ManifestNotDurableError,
    NodeError,
    NodeUnavailableError,
    SmoltorrentError,
)
from tasks.app import app
from tasks.context import REDIS_TRANSIENT, client, metadata, node_client, read_manifest
from tasks.enqueue import send_transfers


@app.task(
    name="smoltorrent.commit",
    bind=True,
    trail=False,  # nothing reads the chain tasks a commit re-sends as its children
    autoretry_for=(NodeUnavailableError, NodeError, ManifestNotDurableError, *REDIS_TRANSIENT),
    retry_backoff=defaults.RETRY_BACKOFF_BASE_S,
    retry_backoff_max=defaults.RETRY_BACKOFF_MAX_S,
    retry_jitter=False,
    max_retries=config.transfer_retries(),
    default_retry_delay=defaults.RETRY_BACKOFF_BASE_S,  # after worker loss; see transfer
)
def commit(self, vkey: str) -> str:
    md = metadata()
    v = md.versions.version(vkey)
    if v["state"] != PENDING:
        return v["state"]
    manifest = read_manifest(md, vkey)  # what its parse freed given back before the rest
    missing = sorted(set(range(len(manifest.entries))) - md.transfers.ready_shards(vkey))
    if missing:
        raise SmoltorrentError(
            f"{manifest.name}: shards {missing} have no verified replica yet; the version "
            "stays pending. Replay its dead letters (`smoltorrent dlq ls`) once nodes are back."
        )
    registered = md.nodes.nodes()
    # Placement says who got each blob; a remove or a repair may have deleted a copy since.
    # Ask the holders, and never commit a shard that no node really has.
    holders = confirm_holders(md, manifest, registered)
    lost = [i for i, s in enumerate(manifest.entries) if not holders.get(s.blob_sha256)]
    if lost:
        md.transfers.reopen_shards(vkey, lost)
        plan = md.transfers.plan(vkey)
        keep = {f"{i}:{r}" for i, t in enumerate(plan) for r in range(len(t)) if i not in lost}
        send_transfers(vkey, manifest, plan, v["host"], skip=keep)
        return f"shards {lost} had no copy left; sent again"
    # The nodes' copies carry the version's request order, so a rebuild orders by it.
    seq = int(v.get("seq") or 0)
    # With its pin and labels too (a version removed and stored again may have kept them).
    # The manifest read above, not a second parse of it: compact as it is (a ChunkTable),
    # a second read was most of a commit's peak memory for thousands of chunks.
    ordered = dataclasses.replace(node_manifest(md, vkey, manifest), seq=seq)
    del manifest
    write_manifest_durably(md, ordered, set().union(*holders.values()), registered)
    md.versions.commit(vkey, ordered.name)
    # Its CLI store learns it now, not at its next poll; a hint, so a lost one is no failure.
    with contextlib.suppress(*REDIS_TRANSIENT):
        wake(md.r, VERSION_WAKE.format(vkey=vkey))
    if int(md.versions.version(vkey).get("seq") or 0) > seq:
        record_request_order(md, vkey)  # a later request joined it while it committed
    return COMMITTED


def record_request_order(md, vkey: str) -> int:
    """Put committed version `vkey`'s manifest again, with the sequence number of its
    latest request, on the live nodes holding its blobs: a later store of the same bytes
    (a rollback) made it current again after its commit, and a rebuild from the nodes
    must order the name's versions by that request, not by when each was created. Best
    effort (a rebuild takes the highest number any copy carries); how many nodes took it."""
    manifest = node_manifest(md, vkey)  # its marks kept: coordinator/state/marks.py
    registered = md.nodes.nodes()
    placed = set().union(*(md.blobs.placement(digest) for digest, _ in manifest.blobs))
    holders = sorted(placed & set(md.nodes.alive(registered)))
    md.versions.note_manifest_nodes(vkey, holders)
    try:
        return write_manifest(manifest, [node_client(n, registered) for n in holders])
    except SmoltorrentError:
        return 0  # no holder answered: the copies keep the order of the commit


def write_manifest_durably(md, manifest, holders: set[str], registered) -> None:
    """Every node holding a blob keeps the manifest, so Redis can be rebuilt from them;
    anything less raises ManifestNotDurableError and the commit retries. An
    under-replicated (or empty) version also puts it on other live nodes, up to
    min(R, live): a node that cannot take a few KB within MANIFEST_EXTRA_TIMEOUT_S does
    not count as live, so a hung node delays the commit by that much, not for ever.
    Every node is recorded as a manifest holder before it is sent the copy (a remove
    deletes it there, Versions.manifest_nodes)."""
    vkey = manifest.storage_key()
    if holders:
        md.versions.note_manifest_nodes(vkey, holders)
        try:
            written = write_manifest(manifest, [node_client(n, registered) for n in holders])
        except SmoltorrentError as exc:  # no node took it at all
            raise ManifestNotDurableError(str(exc)) from exc
        if written < len(holders):
            raise ManifestNotDurableError(
                f"the manifest of {manifest.name} reached {written} of {len(holders)} holders; "
                "the commit retries until every holder keeps it."
            )
    kept = len(holders)
    for node_id in sorted(set(md.nodes.alive(registered)) - holders):
        if kept >= manifest.replicas:
            break
        extra = client(registered[node_id].address, timeout=defaults.MANIFEST_EXTRA_TIMEOUT_S)
        md.versions.note_manifest_nodes(vkey, [node_id])
        try:
            kept += write_manifest(manifest, [extra])
        except SmoltorrentError:
            continue  # not live after all
    if not kept:
        raise ManifestNotDurableError(
            f"no live node took the manifest of {manifest.name}; the commit retries."
        )


def confirm_holders(md, manifest, registered) -> dict[str, frozenset[str]]:
    """Digest -> the registered nodes that answer `has` for it now. A node that says no
    leaves the placement; one that does not answer is not counted. Digests held by the
    same nodes share one set: a few node sets for thousands of chunks."""
    asked: dict[str, set[str]] = {}
    for shard in manifest.entries:
        for node_id in md.blobs.placement(shard.blob_sha256) & set(registered):
            asked.setdefault(node_id, set()).add(shard.blob_sha256)
    by_digest: dict[str, tuple[str, ...]] = {}
    for node_id, digests in asked.items():
        try:
            present = node_client(node_id, registered).has(sorted(digests))
        except (NodeUnavailableError, NodeError):
            continue
        for digest in digests:
            if digest in present:
                by_digest[digest] = (*by_digest.get(digest, ()), node_id)
            else:
                md.blobs.remove_placement(digest, node_id)
    shared: dict[tuple[str, ...], frozenset[str]] = {}
    return {d: shared.setdefault(n, frozenset(n)) for d, n in by_digest.items()}
