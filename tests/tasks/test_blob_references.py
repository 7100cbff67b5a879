"""Blob references, remove and rebuild on a real cluster: a removed version never comes
back, and a blob is deleted only when no version uses it."""

from __future__ import annotations

import json
import subprocess
import sys

from coordinator.dataplane.node_client import NodeClient
from coordinator.state import redis_keys as K
from coordinator.state.versions import COMMITTED
from tests.beat.test_repair import run_sweep
from tests.tasks.conftest import wait_until
from tests.tasks.test_chunked_store import model, write
from tests.tasks.test_control_plane import make_ckpt, sha


def inventories(c) -> list[tuple[dict, list]]:
    return [
        (NodeClient(n.address).list_blobs(), NodeClient(n.address).list_manifests())
        for n in c.node_procs
    ]


def test_rm_racing_a_store_that_shares_its_blobs(make_cluster, tmp_path):
    """rm of one name while the same bytes are stored under another: whichever wins each
    blob, every version that commits gathers byte-identical."""
    c = make_cluster(3)
    src = make_ckpt(tmp_path / "shared.safetensors", 6_000_000)
    cmd = [sys.executable, "-m", "coordinator.cli"]
    for k in range(3):
        c.cli("store", str(src), "--name", f"old{k}")
        procs = [
            subprocess.Popen([*cmd, "rm", f"old{k}", "--yes"], env=c.env()),
            subprocess.Popen([*cmd, "store", str(src), "--name", f"new{k}"], env=c.env()),
        ]
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    rows = [r for r in c.cli_json("ls") if r["state"] == COMMITTED]
    assert {r["name"] for r in rows} == {"new0", "new1", "new2"}
    for r in rows:
        out = tmp_path / f"{r['name']}.out"
        c.cli("gather", r["name"], "-o", str(out))
        assert sha(out) == sha(src)


def test_a_remove_a_down_node_interrupted_is_never_rebuilt(make_cluster, tmp_path):
    c = make_cluster(3)
    src = make_ckpt(tmp_path / "gone.safetensors")
    c.cli("store", str(src), "--shards", "3")
    vkey = c.md.versions.current("gone.safetensors")
    down = c.node_procs[0]
    down.kill()
    proc = c.cli("rm", "gone.safetensors", "--yes")
    assert "left behind" in " ".join(proc.stdout.split() + proc.stderr.split())
    assert c.md.versions.version(vkey)["state"] == "removing"
    down.start()
    summary = c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    assert summary["restored"] == 0
    assert c.md.versions.version(vkey)["state"] == "removing"
    out = tmp_path / "out.safetensors"
    assert c.cli("gather", "gone.safetensors", "-o", str(out), check=False).returncode == 1
    c.cli("rm", "gone.safetensors", "--yes")  # resumed: the node is back
    assert c.md.versions.version(vkey)["state"] == "removed"
    assert all(blobs == {} and manifests == [] for blobs, manifests in inventories(c))
    c.md.r.flushall()
    summary = c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    assert summary["versions"] == 0 and c.cli_json("ls") == []


def test_a_remove_finishes_without_a_dead_node_which_owes_its_manifest_when_back(
    make_cluster, tmp_path
):
    """A node lost for good (dead: silent past the dead timeout) does not keep a remove
    open: its copies count no more, so the remove finishes without them (a fault run's
    scratch version stayed removing for ever after its node was lost), and the manifest
    it may hold is owed: deleted by the crosscheck when it answers again, never rebuilt,
    even once the removed version's tombstone has lapsed."""
    dead_after = 2.0
    c = make_cluster(3, SMOLTORRENT_DEAD_AFTER_S=str(dead_after))
    src = make_ckpt(tmp_path / "gone.safetensors")
    c.cli("store", str(src), "--shards", "3")
    vkey = c.md.versions.current("gone.safetensors")
    lost = c.node_procs[0]
    lost_id = lost.client().ping()
    assert lost_id in c.md.versions.manifest_nodes(vkey)
    lost.kill()
    killed = c.md.sweeps.redis_time()
    wait_until(lambda: c.md.sweeps.redis_time() - killed > dead_after + 1, what="its death")
    assert run_sweep(c, "health")["newly_dead"] == 1
    c.cli("rm", "gone.safetensors", "--yes")
    assert c.md.versions.version(vkey)["state"] == "removed"
    assert vkey in c.md.nodes.manifests_owed(lost_id)
    c.md.r.delete(K.VERSION.format(vkey=vkey))  # the removed tombstone has lapsed
    lost.start()
    assert vkey in lost.client().list_manifests()
    summary = c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    assert summary["restored"] == 0
    run_sweep(c, "crosscheck")
    assert vkey not in lost.client().list_manifests()
    assert c.md.nodes.manifests_owed(lost_id) == set()
    c.md.r.flushall()
    assert c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))["versions"] == 0


def test_rebuild_restores_only_versions_whose_every_shard_is_on_a_node(make_cluster, tmp_path):
    c = make_cluster(3)
    whole = make_ckpt(tmp_path / "whole.safetensors")
    holed = make_ckpt(tmp_path / "holed.safetensors", 3_000_000)
    c.cli("store", str(whole), "--shards", "3")
    c.cli("store", str(holed), "--shards", "3")
    lost = c.md.versions.manifest(c.md.versions.current("holed.safetensors")).entries[2].blob_sha256
    for n in c.node_procs:  # every copy of one shard goes (disks lost, a foreign tool)
        NodeClient(n.address).delete(lost)
    c.md.r.flushall()
    summary = c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    # The skipped manifest is said once, as skipped, not counted among the versions found.
    assert (summary["versions"], summary["restored"], summary["skipped"]) == (1, 1, 1)
    assert summary["names"] == 1
    assert any("holed.safetensors" in line for line in summary["unreachable"])
    assert [r["name"] for r in c.cli_json("ls")] == ["whole.safetensors"]
    out = tmp_path / "out.safetensors"
    c.cli("gather", "whole.safetensors", "-o", str(out))
    assert sha(out) == sha(whole)


def test_a_stalled_remove_sent_again_never_deletes_a_newer_versions_blobs(make_cluster, tmp_path):
    """rm of A while one holder of its blob is SIGKILLed (still registered): the remove
    deletes the other copy and stays open. Its tombstone then lapses (deleted here: an
    hour of re-sends), and B with the same bytes is stored and committed on the live
    nodes. The old remove sent again must leave B's copies: it deleted every node in the
    blob's placement without looking at its references again, and B was lost."""
    c = make_cluster(3)
    src = make_ckpt(tmp_path / "a.safetensors")
    c.cli("store", str(src), "--name", "a", "--shards", "1")
    a = c.md.versions.current("a")
    [digest] = [s.blob_sha256 for s in c.md.versions.manifest(a).entries]
    holders = sorted(c.md.blobs.placement(digest))
    dead = next(n for n in c.node_procs if n.client().ping() == holders[0])
    dead.kill()
    proc = c.cli("rm", "a", "--yes")
    assert "left behind" in " ".join(proc.stdout.split() + proc.stderr.split())
    assert c.md.versions.version(a)["state"] == "removing"
    c.md.r.delete(K.BLOB_DELETING.format(digest=digest))  # the tombstone's hour is over
    row = c.cli_json("store", str(src), "--name", "b", "--shards", "1")
    assert row["state"] == COMMITTED
    live = [n for n in c.node_procs if n is not dead]

    def holding() -> list[str]:
        return [str(n.address) for n in live if digest in NodeClient(n.address).list_blobs()]

    before = holding()
    assert before  # B's bytes are on a live node (the copy A's remove deleted is not counted)
    c.cli("rm", "a", "--yes")  # the remove sent again (reconcile does, every minute)
    assert holding() == before
    out = tmp_path / "out.safetensors"
    c.cli("gather", "b", "-o", str(out))
    assert sha(out) == sha(src)


def test_a_store_sharing_a_blob_a_stalled_remove_holds_waits_it_out_then_sends_it(
    make_cluster, tmp_path
):
    """rm of A while one holder of its chunk is SIGKILLed (still registered): the remove
    deletes the other copy and stays open, its tombstone on the blob until the remove is
    sent again. B with the same bytes, stored meanwhile, must wait for it however long
    (a wait is no failed try: it dead-lettered once its retries ran out, 5 s each), and
    send the chunk again once the remove, sent again, sees B use it and lets it go."""
    c = make_cluster(3)  # SMOLTORRENT_TRANSFER_RETRIES=2: a chain task dead-letters at 3
    src = make_ckpt(tmp_path / "a.safetensors")
    c.cli("store", str(src), "--name", "a")
    [digest] = [s.blob_sha256 for s in c.md.versions.manifest(c.md.versions.current("a")).entries]
    holders = sorted(c.md.blobs.placement(digest))
    next(n for n in c.node_procs if n.client().ping() == holders[0]).kill()
    proc = c.cli("rm", "a", "--yes")
    assert "left behind" in " ".join(proc.stdout.split() + proc.stderr.split())
    assert c.md.blobs.blob_deleting(digest)
    store = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "store", str(src), "--name", "b", "--json"],
        env=c.env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        waits = f"waits for the remove deleting {digest[:12]}"
        wait_until(
            lambda: c.md.dead_letters.dead_letters() or c.worker_log().count(waits) > 3,
            timeout=120,
            what="a dead letter, or the store waiting past its retries",
        )
        assert c.md.dead_letters.dead_letters() == []
        c.cli("rm", "a", "--yes")  # sent again (reconcile does, every minute)
        assert store.wait(timeout=120) == 0
    finally:
        store.kill()
    assert json.loads(store.stdout.read())["state"] == COMMITTED
    out = tmp_path / "out.safetensors"
    c.cli("gather", "b", "-o", str(out))
    assert sha(out) == sha(src)


def referencing(c, vkey: str) -> set[str]:
    """The blobs whose reference set names `vkey`."""
    pattern = K.BLOB_REFS.format(digest="*")
    head, tail = pattern.split("*")
    return {
        key[len(head) : -len(tail)]
        for key in c.md.r.scan_iter(match=pattern, count=1000)
        if c.md.r.sismember(key, vkey)
    }


def test_a_store_joining_a_version_in_another_encoding_leaves_no_reference_behind(
    make_cluster, tmp_path
):
    """The same bytes stored encoded (SMOLTORRENT_ENCODE=zstd), Redis lost and rebuilt
    (its chunk entries then name no encoding, so no store counts on them), then stored
    again by a worker that sends RAW: the second store joins the committed version (same
    content, same id) but its plan names other blobs, the RAW ones. versions/create added
    the version to those blobs' reference sets, which no remove takes away (it reads the
    recorded manifest): after rm they still named it, for good."""
    c = make_cluster(3, SMOLTORRENT_ENCODE="zstd")
    src = write(tmp_path / "a.safetensors", model())
    c.cli("store", str(src), "--name", "a")
    vkey = c.md.versions.current("a")
    manifest = c.md.versions.manifest(vkey)
    recorded = {s.blob_sha256 for s in manifest.entries}
    raws = {ch.raw_sha256 for ch in manifest.chunks}
    assert recorded != raws  # stored encoded
    c.md.r.flushall()
    c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    assert referencing(c, vkey) == recorded
    c.kill_worker()
    c.start_worker(env={"SMOLTORRENT_ENCODE": "raw"})
    row = c.cli_json("store", str(src), "--name", "a")
    assert (row["state"], row["new"]) == (COMMITTED, False)  # joined
    assert referencing(c, vkey) == recorded
    c.cli("rm", "a", "--yes")
    assert c.md.versions.version(vkey)["state"] == "removed"
    assert referencing(c, vkey) == set()
    assert all(blobs == {} and manifests == [] for blobs, manifests in inventories(c))


def test_a_removed_version_whose_manifest_a_trimmed_node_kept_is_never_rebuilt(
    make_cluster, tmp_path
):
    """A stored at R=3, then lowered to R=1: two nodes' copies of its chunk are trimmed
    (they leave the placement) but keep its manifest. B, the same bytes under another
    name, uses every chunk of A. rm A while one trimmed node is down: the remove asked
    only the blob holders to answer for the manifest, finished, and once that node was
    back a rebuild (Redis lost) found A's manifest there with every chunk held (by B's
    copies) and brought A back."""
    c = make_cluster(3)
    src = make_ckpt(tmp_path / "a.safetensors")
    c.cli("store", str(src), "--name", "a", "--replicas", "3")
    a = c.md.versions.current("a")
    c.cli("store", str(src), "--name", "a", "--replicas", "1")
    placed = set().union(
        *(c.md.blobs.placement(s.blob_sha256) for s in c.md.versions.manifest(a).entries)
    )
    trimmed = [n for n in c.node_procs if n.client().ping() not in placed]
    assert len(trimmed) == 2
    assert all(a in NodeClient(n.address).list_manifests() for n in trimmed)
    c.cli("store", str(src), "--name", "b", "--replicas", "1")
    trimmed[0].kill()
    c.cli("rm", "a", "--yes", check=False)
    trimmed[0].start()
    c.cli("rm", "a", "--yes", check=False)  # resumed if left open (reconcile does it too)
    c.md.r.flushall()
    c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    assert [r["name"] for r in c.cli_json("ls")] == ["b"]
    assert all(a not in manifests for _, manifests in inventories(c))
