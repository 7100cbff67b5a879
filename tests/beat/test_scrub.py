"""The scrub sweep (checksum_sync) on a real cluster: a byte flipped on one node's disk
is found by that node's scrub, and with `smoltorrent beat` running and nothing else
done, the blob is back to 2 verified copies."""

from __future__ import annotations

import hashlib
import json
import time

from coordinator.plan.read_order import read_order
from tests.beat.test_repair import stored
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_blobs_ckpt, make_ckpt, sha

FAST = {
    "SMOLTORRENT_HEALTH_INTERVAL_S": "1",
    "SMOLTORRENT_DEAD_AFTER_S": "30",
    "SMOLTORRENT_REPAIR_INTERVAL_S": "1",
    "SMOLTORRENT_SCRUB_INTERVAL_S": "1",
    "SMOLTORRENT_SCRUB_RATE_BPS": str(100 * 1024 * 1024),
}


def blob_file(node, digest: str):
    return node.data_dir / "blobs" / digest[:2] / digest


def flip_byte(node, digest: str, at: int) -> None:
    path = blob_file(node, digest)
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(data)


def first_read(c, name: str, index: int = 0):
    """The node a gather of `name` reads shard `index` from first (plan/read_order, as
    the gather task asks it)."""
    manifest = c.md.versions.manifest(c.md.versions.current(name))
    holders = [c.md.blobs.placement(s.blob_sha256) for s in manifest.entries]
    sizes = [s.blob_size for s in manifest.entries]
    node_id = read_order(holders, sizes, c.md.nodes.alive(c.md.nodes.nodes()))[index][0]
    return node_id, next(n for n in c.node_procs if n.client().ping() == node_id)


def whole(node, digest: str) -> bool:
    path = blob_file(node, digest)
    return path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == digest


def two_verified(c, digest: str) -> bool:
    """The placement lists two copies and two nodes hold the blob's exact bytes."""
    return (
        len(c.md.blobs.placement(digest)) == 2 and sum(whole(n, digest) for n in c.node_procs) == 2
    )


def test_a_flipped_byte_on_a_two_node_cluster_is_repaired_onto_the_same_node(
    make_cluster, beat, tmp_path
):
    """Two nodes, R=2: the only node that can take the repair is the one whose copy was
    bad. Nothing deadlocks: its copy is quarantined, repaired in place, then released."""
    c = make_cluster(2, **FAST)
    src = make_ckpt(tmp_path / "flip.safetensors")
    digests = stored(c, src, "flip.safetensors")
    victim, other = c.node_procs
    victim_id = victim.client().ping()
    digest = digests[0]
    assert whole(victim, digest) and whole(other, digest)
    flip_byte(victim, digest, 1234)
    flipped_at = time.monotonic()
    beat(c)

    def healed() -> bool:
        return (
            whole(victim, digest)
            and whole(other, digest)
            and len(c.md.blobs.placement(digest)) == 2
            and not victim.client().scrub(start=False)["quarantined"]
        )

    wait_until(healed, timeout=120, what="2 verified copies again")
    print(f"flipped byte to 2 verified copies: {time.monotonic() - flipped_at:.1f} s")
    rows = {n["node_id"]: n for n in c.cli_json("status")["nodes"]}
    assert rows[victim_id]["bad_copies_found"] == 1
    assert rows[victim_id]["last_scrub"] is not None
    assert "quarantined until the coordinator repairs it" in victim.log()
    out = tmp_path / "out.safetensors"
    c.cli("gather", "flip.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_a_reported_bad_copy_left_on_record_is_rehashed_and_repaired(make_cluster, beat, tmp_path):
    """A bad copy the scrub has not reached yet, reported by a reader whose at-once check
    never ran (its send failed): the record stays, the scrub sweep has its node re-hash
    it, and the repair brings the copy back."""
    slow = {**FAST, "SMOLTORRENT_SCRUB_RATE_BPS": "1"}  # the node's own pass is no help here
    c = make_cluster(3, **slow)
    src = make_ckpt(tmp_path / "read.safetensors")
    digests = stored(c, src, "read.safetensors")
    by_id = {n.client().ping(): n for n in c.node_procs}
    bad_on = min(c.md.blobs.placement(digests[0]))
    flip_byte(by_id[bad_on], digests[0], 99)
    c.md.blobs.record_bad_copy(digests[0], bad_on, "sha256 mismatch")
    beat(c)
    wait_until(
        lambda: all(two_verified(c, d) for d in digests) and not c.md.blobs.reported_bad_copies(),
        timeout=120,
        what="every blob back at 2 verified copies",
    )


def test_a_copy_a_gather_found_corrupt_is_repaired_at_once_with_no_sweep(make_cluster, tmp_path):
    """No beat at all: the gather that met the bad copy queues its check and its repair
    itself, so the blob is back at 2 verified copies without waiting for any sweep."""
    c = make_cluster(3)
    src = make_ckpt(tmp_path / "now.safetensors")
    digests = stored(c, src, "now.safetensors")
    _, bad_node = first_read(c, "now.safetensors")
    flip_byte(bad_node, digests[0], 99)
    out = tmp_path / "out.safetensors"
    report = c.cli_json("gather", "now.safetensors", "-o", str(out))
    assert sha(out) == sha(src)
    assert [b["shard"] for b in report["bad_copies"]] == [0]  # the gather met it
    wait_until(
        lambda: two_verified(c, digests[0]) and not c.md.blobs.reported_bad_copies(),
        timeout=60,
        what="the bad copy repaired with no sweep running",
    )
    for name in ("scrub", "repair"):
        assert not c.md.r.exists(f"smoltorrent:sweep:{name}:runs")
    assert c.md.r.hget("smoltorrent:repairs:counts", "repaired") == "1"


def test_a_bad_copy_a_scrub_reports_is_repaired_in_the_same_sweep(make_cluster, beat, tmp_path):
    """The repair sweep is an hour away: the scrub sweep that reads the node's report of
    a bad copy queues its repair itself."""
    c = make_cluster(3, **{**FAST, "SMOLTORRENT_REPAIR_INTERVAL_S": "3600"})
    src = make_ckpt(tmp_path / "rep.safetensors")
    digests = stored(c, src, "rep.safetensors")
    by_id = {n.client().ping(): n for n in c.node_procs}
    victim = by_id[min(c.md.blobs.placement(digests[0]))]
    flip_byte(victim, digests[0], 4321)
    beat(c)
    wait_until(
        lambda: two_verified(c, digests[0]),
        timeout=60,
        what="2 verified copies with no repair sweep",
    )
    assert not c.md.r.exists("smoltorrent:sweep:repair:runs")


def test_a_flipped_byte_and_a_deleted_blob_are_healed_by_beat_alone(make_cluster, beat, tmp_path):
    """One byte flipped in one copy, another blob's file deleted from another node: with
    `smoltorrent beat` running and nothing else done, every blob is back to 2 verified
    copies (the scrub finds the first, the crosscheck the second, the repairs copy both)."""
    c = make_cluster(3, **FAST, SMOLTORRENT_CROSSCHECK_INTERVAL_S="1")
    src = make_blobs_ckpt(tmp_path / "both.safetensors", 3)
    digests = stored(c, src, "both.safetensors")
    flipped, deleted = digests[0], next(d for d in digests if d != digests[0])
    by_id = {n.client().ping(): n for n in c.node_procs}
    flip_byte(by_id[min(c.md.blobs.placement(flipped))], flipped, 777)
    gone_from = by_id[max(c.md.blobs.placement(deleted))]
    blob_file(gone_from, deleted).unlink()
    beat(c)

    def healed() -> bool:
        return all(two_verified(c, d) for d in digests) and not any(
            n.client().scrub(start=False)["quarantined"] for n in c.node_procs
        )

    wait_until(healed, timeout=180, what="every blob at 2 verified copies")
    out = tmp_path / "out.safetensors"
    c.cli("gather", "both.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_a_bad_copy_a_node_finds_mid_pass_is_repaired_before_the_next_scrub_sweep(
    make_cluster, beat, tmp_path
):
    """The scrub and repair sweeps are an hour away; a node's pass (started as the last
    scrub sweep would have) finds a flipped byte. The health probe sees the node hold a
    new bad copy, the reports are collected then, and the repair is queued at once."""
    hours = {"SMOLTORRENT_SCRUB_INTERVAL_S": "3600", "SMOLTORRENT_REPAIR_INTERVAL_S": "3600"}
    c = make_cluster(3, **{**FAST, **hours})
    src = make_ckpt(tmp_path / "mid.safetensors")
    digests = stored(c, src, "mid.safetensors")
    by_id = {n.client().ping(): n for n in c.node_procs}
    victim = by_id[min(c.md.blobs.placement(digests[0]))]
    flip_byte(victim, digests[0], 2024)
    beat(c)
    victim.client().scrub()  # the pass an earlier scrub sweep started
    wait_until(
        lambda: two_verified(c, digests[0]),
        timeout=60,
        what="2 verified copies before any scrub or repair sweep came round",
    )
    assert not c.md.r.exists("smoltorrent:sweep:repair:runs")
    runs = [json.loads(r) for r in c.md.r.lrange("smoltorrent:sweep:scrub:runs", 0, -1)]
    assert runs and all(r["outcome"] == "done" for r in runs)
