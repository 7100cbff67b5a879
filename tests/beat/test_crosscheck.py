"""The crosscheck sweep on a real cluster: node inventories against placement."""

from __future__ import annotations

import hashlib
import os

from coordinator.dataplane.node_client import NodeClient
from coordinator.state.versions import COMMITTED
from tests.beat.test_reconcile import pending_as_left_by_a_crash
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_ckpt


def sweep(c) -> dict:
    from celery import Celery

    app = Celery(broker=c.redis_url, backend=c.redis_url)
    try:
        return app.send_task("smoltorrent.sweep.crosscheck", queue="control").get(timeout=60)
    finally:
        app.close()


def drop_blob_file(node, data: bytes) -> str:
    """A complete blob file written straight into a node's data dir, as a crashed run or a
    restored backup leaves one: no version uses it, Redis has never heard of it."""
    digest = hashlib.sha256(data).hexdigest()
    bucket = node.data_dir / "blobs" / digest[:2]
    bucket.mkdir(parents=True, exist_ok=True)
    (bucket / digest).write_bytes(data)
    return digest


def node_id(node) -> str:
    return NodeClient(node.address).ping()


def held(node) -> set[str]:
    return set(NodeClient(node.address).list_blobs())


def test_an_orphan_is_collected_after_the_grace_and_a_pending_blob_never(make_cluster, tmp_path):
    c = make_cluster(3, SMOLTORRENT_ORPHAN_GRACE_S="2")
    node = c.node_procs[0]
    orphan = drop_blob_file(node, os.urandom(100_000))
    # A pending version (its store died after sending every blob) whose copies Redis has
    # partly lost track of: its blobs have no placement on one node, but a version uses them.
    vkey = pending_as_left_by_a_crash(c, make_ckpt(tmp_path / "p.safetensors"), send_blobs=True)
    pending_blobs = {s.blob_sha256 for s in c.md.versions.manifest(vkey).entries}
    forgotten = next(iter(pending_blobs))
    lost_on = sorted(c.md.blobs.placement(forgotten))[0]
    c.md.blobs.remove_placement(forgotten, lost_on)

    first = sweep(c)
    assert first.get("collected", 0) == 0 and first["orphans"] == 1  # noted, in its grace
    assert orphan in held(node)
    assert first["recorded"] == 1 and lost_on in c.md.blobs.placement(forgotten)
    wait_until(lambda: sweep(c).get("collected") == 1, timeout=60, what="the orphan collected")
    assert orphan not in held(node)
    assert not c.md.r.exists(f"smoltorrent:blob:{orphan}:nodes")
    assert c.md.r.hlen("smoltorrent:orphans") == 0
    # The pending version lost nothing: every blob still on its nodes, still pending.
    on_nodes = set().union(*(held(n) for n in c.node_procs))
    assert pending_blobs <= on_nodes
    assert c.md.versions.state(vkey) == "pending"
    for digest in pending_blobs:
        assert all(
            digest in held(n) for n in c.node_procs if node_id(n) in c.md.blobs.placement(digest)
        )


def test_placement_follows_the_nodes_and_removed_manifests_go(make_cluster, tmp_path):
    c = make_cluster(3, SMOLTORRENT_ORPHAN_GRACE_S="0")
    kept = make_ckpt(tmp_path / "kept.safetensors")
    gone = make_ckpt(tmp_path / "gone.safetensors", size=3_000_000)
    c.cli("store", str(kept), "--shards", "2")
    c.cli("store", str(gone), "--shards", "2")
    kept_vkey, gone_vkey = (
        c.md.versions.current("kept.safetensors"),
        c.md.versions.current("gone.safetensors"),
    )
    holder = next(n for n in c.node_procs if gone_vkey in NodeClient(n.address).list_manifests())
    manifest_bytes = NodeClient(holder.address).get_manifest(gone_vkey)
    c.cli("rm", "gone.safetensors", "--yes")
    assert c.md.versions.state(gone_vkey) == "removed"
    # A node that missed the remove (restored from a backup) still has its manifest.
    NodeClient(holder.address).put_manifest(gone_vkey, manifest_bytes)
    # A copy deleted behind Redis's back: placement still lists it.
    lost = c.md.versions.manifest(kept_vkey).entries[0].blob_sha256
    lost_node = next(n for n in c.node_procs if node_id(n) in c.md.blobs.placement(lost))
    NodeClient(lost_node.address).delete(lost)

    result = sweep(c)
    assert result["missing"] == 1
    assert node_id(lost_node) not in c.md.blobs.placement(lost)  # the repair sweep's to copy again
    assert result["manifests_deleted"] == 1
    assert gone_vkey not in NodeClient(holder.address).list_manifests()
    assert c.md.versions.state(kept_vkey) == COMMITTED
    again = sweep(c)
    assert again.get("missing", 0) == 0 and again.get("manifests_deleted", 0) == 0


def test_blobs_of_a_manifest_redis_does_not_know_are_never_collected(make_cluster, tmp_path):
    """Redis lost a version (restored from an old backup, not yet rebuilt): its blobs have
    no references, but a manifest on the nodes names them, so they stay."""
    c = make_cluster(3, SMOLTORRENT_ORPHAN_GRACE_S="0")
    src = make_ckpt(tmp_path / "lost.safetensors")
    c.cli("store", str(src), "--shards", "2")
    vkey = c.md.versions.current("lost.safetensors")
    digests = {s.blob_sha256 for s in c.md.versions.manifest(vkey).entries}
    md = c.md
    for key in md.r.scan_iter(f"smoltorrent:*{vkey}*"):
        md.r.delete(key)
    for d in digests:
        md.r.delete(f"smoltorrent:blob:{d}:refs")
    md.r.hdel("smoltorrent:current", "lost.safetensors")
    md.r.delete("smoltorrent:name:lost.safetensors:versions")
    md.r.srem("smoltorrent:names", "lost.safetensors")

    for _ in range(2):
        result = sweep(c)
        assert result.get("collected", 0) == 0 and result["manifests_unknown"] >= 1
    on_nodes = set().union(*(held(n) for n in c.node_procs))
    assert digests <= on_nodes


def test_an_orphan_claimed_while_a_store_starts_using_it_is_sent_again_by_the_store(
    make_cluster, tmp_path
):
    """self-healing.md: an orphan is deleted under the tombstone a remove sets, only if no
    version uses it at that instant, and a store that starts using it meanwhile waits, then
    sends it again. The crosscheck's own steps (claim_orphan, the node's delete,
    orphan_deleted) are taken here at the instants that race: claimed, then a real store
    of the very bytes records its version, then the delete lands. The store must end
    committed at R with the blob on its nodes, and gather byte for byte."""
    import struct
    import subprocess
    import sys

    c = make_cluster(3)
    src = make_ckpt(tmp_path / "race.safetensors")
    raw = src.read_bytes()
    data = raw[8 + struct.unpack("<Q", raw[:8])[0] :]  # one RAW chunk (loopback): its blob
    node = c.node_procs[0]
    orphan = drop_blob_file(node, data)
    owner = "crosscheck-test"
    assert c.md.blobs.claim_orphan(orphan, owner)  # no version uses it: tombstoned
    store = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "store", str(src), "--name", "race"],
        env=c.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # The store's version uses the blob, and its delivery met the tombstone and waits
        # (tasks/delivery_policy.py wait_for_remove: sent again in REMOVING_WAIT_S).
        wait_until(
            lambda: f"waits for the remove deleting {orphan[:12]}" in c.worker_log(),
            60,
            what="the store's delivery waiting on the tombstone",
        )
        assert c.md.blobs.referenced([orphan])[orphan]
        # The crosscheck's delete, decided before the store began, lands now.
        NodeClient(node.address).delete(orphan)
        c.md.blobs.orphan_deleted(orphan, owner, [node_id(node)])
        out, _ = store.communicate(timeout=120)
    finally:
        store.kill()
    assert store.returncode == 0, out
    vkey = c.md.versions.current("race")
    assert c.md.versions.version(vkey)["state"] == COMMITTED
    (chunk,) = c.md.versions.manifest(vkey).chunks
    assert chunk.blob_sha256 == orphan
    holders = [n for n in c.node_procs if orphan in held(n)]
    assert len(holders) == 2 and {node_id(n) for n in holders} == c.md.blobs.placement(orphan)
    dest = tmp_path / "out.safetensors"
    c.cli("gather", "race", "-o", str(dest))
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == hashlib.sha256(raw).hexdigest()
