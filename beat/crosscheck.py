"""The crosscheck sweep: what the nodes hold against what Redis says they hold.

- A copy placement lists but the node's inventory lacks is taken out of the
  placement: the repair sweep then sees the blob under R and copies it again.
- A copy the node holds but placement does not list is recorded, if a version
  uses the blob (the references decide, atomically): Redis lost track of it
  (a rebuild, a settle that never ran).
- A copy no version uses is an orphan: noted with the time it was first seen,
  and deleted once older than SMOLTORRENT_ORPHAN_GRACE_S, under the same
  tombstone a remove sets (a store that starts using the blob waits, then sends
  it again). A blob of a pending version has references, so it is never one; a
  blob named by a manifest Redis does not know (Redis lost, not yet rebuilt) is
  never collected either.
- A manifest of a version Redis has removed is deleted from the node; one of a
  committed version is recorded as held there (a remove waits for that node too).

Placement is read before the inventories, so a copy settled meanwhile (stored on
the node before its settle) is never taken for missing.
"""

from __future__ import annotations

import uuid
from collections import Counter

from celery.utils.log import get_task_logger

from beat.sweeps import sweep
from coordinator import config
from coordinator.plan.manifest import Manifest
from coordinator.state.metadata import Metadata
from coordinator.state.versions import COMMITTED, REMOVED
from smoltorrent.errors import SmoltorrentError
from tasks.context import metadata, node_client

log = get_task_logger(__name__)


def run_pass(grace: float | None = None) -> dict[str, int]:
    md = metadata()
    grace = config.orphan_grace() if grace is None else grace
    registered = md.nodes.nodes()
    counts: Counter[str] = Counter()
    before = md.blobs.placements()
    inventories: dict[str, set[str]] = {}
    manifests: dict[str, list[str]] = {}
    for node_id in sorted(registered):
        client = node_client(node_id, registered)
        try:
            inventories[node_id] = set(client.list_blobs())
            manifests[node_id] = client.list_manifests()
        except SmoltorrentError as exc:  # down, or answering garbage: next pass
            log.info("crosscheck: node %s not read: %s", node_id[:12], exc)
            counts["nodes_unread"] += 1
    protected, sure = _manifests(md, registered, manifests, counts)
    for digest, nodes in before.items():
        for node_id in sorted(nodes & inventories.keys()):
            if digest not in inventories[node_id]:
                md.blobs.remove_placement(digest, node_id)
                counts["missing"] += 1
    digests = sorted(set().union(*inventories.values()))
    used = md.blobs.referenced(digests)
    seen = set()
    owner = f"crosscheck-{uuid.uuid4().hex}"
    for digest in digests:
        holders = sorted(n for n, inv in inventories.items() if digest in inv)
        if used[digest]:
            # Only copies the placement did not list: one script call per unknown copy,
            # not one per copy in the cluster.
            unknown = [n for n in holders if n not in before.get(digest, ())]
            counts["recorded"] += sum(md.blobs.record_copy(digest, n) for n in unknown)
            continue
        if digest in protected or not sure or md.blobs.blob_deleting(digest):
            continue
        due = []
        for node_id in holders:
            seen.add(f"{digest}:{node_id}")
            if md.blobs.note_orphan(digest, node_id) >= grace:
                due.append(node_id)
        counts["orphans"] += len(holders)
        if due and md.blobs.claim_orphan(digest, owner):
            gone = []
            for node_id in due:
                try:
                    node_client(node_id, registered).delete(digest)
                    gone.append(node_id)
                except SmoltorrentError as exc:
                    log.info("crosscheck: orphan %s stays on %s: %s", digest[:12], node_id, exc)
            md.blobs.orphan_deleted(digest, owner, gone)
            counts["collected"] += len(gone)
    # Marks of copies that are no orphans any more (used again, or gone) start over.
    md.blobs.forget_orphans(md.blobs.orphan_marks() - seen)
    result = dict(counts)
    if any(v for k, v in result.items() if k != "orphans"):
        log.warning("crosscheck: %s", result)
    return result


def _manifests(md: Metadata, registered, manifests: dict[str, list[str]], counts: Counter):
    """Delete node manifests of removed versions; return the blobs named by manifests
    Redis does not know (never collected), and whether every such manifest was read
    (if one was not, no orphan is collected this pass: it may name any blob)."""
    protected: set[str] = set()
    sure = True
    for node_id, keys in manifests.items():
        client = node_client(node_id, registered)
        states = md.versions.states(keys)
        # A copy found where none was recorded (a version committed before the nodes
        # sent a copy were recorded, a copy put by hand): its remove waits for it too.
        md.versions.note_manifests_held(
            node_id, [k for k, s in zip(keys, states, strict=True) if s == COMMITTED]
        )
        # Manifests owed since a remove finished while the node was dead: one it does not
        # hold is settled, and so is one whose version was committed again since (the
        # same name and bytes: the copy is that version's now).
        held = dict(zip(keys, states, strict=True))
        owed = md.nodes.manifests_owed(node_id)
        md.nodes.manifests_paid(
            node_id, [k for k in owed if k not in held or held[k] not in (None, REMOVED)]
        )
        for key, state in zip(keys, states, strict=True):
            try:
                if state == REMOVED or (state is None and key in owed):
                    client.delete_manifest(key)
                    md.nodes.manifests_paid(node_id, [key] if key in owed else [])
                    counts["manifests_deleted"] += 1
                elif state is None:
                    counts["manifests_unknown"] += 1
                    manifest = Manifest.from_json(client.get_manifest(key))
                    protected.update(s.blob_sha256 for s in manifest.entries)
            except SmoltorrentError as exc:
                log.info("crosscheck: manifest %s on %s: %s", key, node_id[:12], exc)
                sure = sure and state is not None
    return protected, sure


@sweep("crosscheck")
def crosscheck() -> dict[str, int]:
    """One pass over every registered node."""
    return run_pass()
