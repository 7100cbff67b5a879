"""`smoltorrent verify` on a real cluster: no beat, no worker; the command itself has
the nodes re-hash and repairs what they found."""

from __future__ import annotations

import time

from smoltorrent import defaults
from tests.beat.test_scrub import flip_byte, whole
from tests.tasks.test_control_plane import make_blobs_ckpt, make_ckpt, sha


def store(c, src, name: str) -> list[str]:
    c.cli("store", str(src), "--name", name)
    md = c.md
    return [s.blob_sha256 for s in md.versions.manifest(md.versions.current(name)).entries]


def test_verify_finds_a_flipped_byte_and_a_deleted_copy_and_repairs_both(make_cluster, tmp_path):
    c = make_cluster(3)
    src = make_blobs_ckpt(tmp_path / "v.safetensors", 3)  # a blob to flip, one to delete
    digests = store(c, src, "v.safetensors")
    other = make_ckpt(tmp_path / "w.safetensors", size=1_000_000)
    untouched = store(c, other, "w.safetensors")
    by_id = {n.client().ping(): n for n in c.node_procs}
    flipped_on = by_id[min(c.md.blobs.placement(digests[0]))]
    deleted_on = by_id[min(c.md.blobs.placement(digests[1]))]
    flip_byte(flipped_on, digests[0], 77)
    (deleted_on.data_dir / "blobs" / digests[1][:2] / digests[1]).unlink()
    c.kill_worker()  # verify needs no worker

    report = c.cli_json("verify", "v.safetensors")
    found = {(b["digest"], b["problem"]) for b in report["bad"]}
    assert found == {(digests[0], "bad"), (digests[1], "missing")}
    assert {r["digest"] for r in report["repaired"]} == {digests[0], digests[1]}
    assert report["under_replicated"] == []
    assert report["copies_checked"] == 2 * len(set(digests))
    assert not set(untouched) & {r["digest"] for r in report["repaired"]}
    for d in digests:
        assert sum(whole(n, d) for n in c.node_procs) == 2
        assert len(c.md.blobs.placement(d)) == 2
    # The bad copy was repaired in place or elsewhere; either way nothing bad is held.
    assert all(not n.client().scrub(start=False)["quarantined"] for n in c.node_procs)

    again = c.cli("verify")
    assert "every blob has all its copies, verified" in again.stdout
    c.start_worker()
    out = tmp_path / "out.safetensors"
    c.cli("gather", "v.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_verify_says_what_it_cannot_check_or_repair_and_exits_1(make_cluster, tmp_path):
    c = make_cluster(2, SMOLTORRENT_DEAD_AFTER_S="2")
    src = make_ckpt(tmp_path / "u.safetensors")
    store(c, src, "u.safetensors")
    c.node_procs[1].kill()
    # Down, not yet dead: its copies still count, but nothing vouches for them now.
    proc = c.cli("verify", check=False)
    assert proc.returncode == 1
    assert "could not be checked" in proc.stdout
    time.sleep(2.5)  # past the dead timeout: now no node can take the second copies
    proc = c.cli("verify", check=False)
    assert proc.returncode == 1
    assert "1 live node(s) for 2 copies" in proc.stderr + proc.stdout
    assert c.cli("verify", "nothing-here", "--json", check=False).returncode == 1


def test_verify_of_the_whole_cluster_runs_the_crosscheck_too(make_cluster, tmp_path):
    import os

    from tests.beat.test_crosscheck import drop_blob_file, held

    c = make_cluster(3, SMOLTORRENT_ORPHAN_GRACE_S="0")
    store(c, make_ckpt(tmp_path / "x.safetensors", size=1_000_000), "x.safetensors")
    node = c.node_procs[0]
    orphan = drop_blob_file(node, os.urandom(50_000))
    c.kill_worker()
    reports = [c.cli_json("verify")]
    assert reports[0]["crosscheck"]["orphans"] == 1
    if orphan in held(node):  # noted on first sight; collected once past the grace
        reports.append(c.cli_json("verify"))
    assert sum(r["crosscheck"].get("collected", 0) for r in reports) == 1
    assert orphan not in held(node)
    assert reports[-1]["under_replicated"] == []


def test_verifys_copies_keep_to_the_repair_rate(make_cluster, tmp_path):
    """verify's copies go through the node's repair bucket at SMOLTORRENT_REPAIR_BPS, as the
    repair sweep's do, so a Pi's port keeps room for gathers (they went unpaced)."""
    rate = 500_000
    c = make_cluster(3, SMOLTORRENT_REPAIR_BPS=str(rate))
    src = make_ckpt(tmp_path / "p.safetensors", size=2_000_000)
    digests = store(c, src, "p.safetensors")
    by_id = {n.client().ping(): n for n in c.node_procs}
    pushed: dict[str, int] = {}  # bytes each surviving holder must send
    for d in set(digests):
        lost_on, source = sorted(c.md.blobs.placement(d))
        path = by_id[lost_on].data_dir / "blobs" / d[:2] / d
        pushed[source] = pushed.get(source, 0) + path.stat().st_size
        path.unlink()
    started = time.monotonic()
    report = c.cli_json("verify", "p.safetensors")
    elapsed = time.monotonic() - started
    assert {r["digest"] for r in report["repaired"]} == set(digests)
    # A lower bound, whatever the machine's load: each node pays its own bucket at the
    # rate, less the burst it lets through after an idle spell and less its last slice
    # (a slice is paid after it is sent, and take() waits only for the bytes before it).
    # All the copies' bytes over one rate were no bound (two sources' buckets each let a
    # burst through after the other's turn), nor was the busiest source's less the burst
    # alone: 3.19 s against 3.22 s, one pusher, on 2026-12-06.
    last_slice_s = defaults.BWLIMIT_SLICE_BYTES / rate
    bound = max(pushed.values()) / rate - defaults.BWLIMIT_BURST_S - last_slice_s
    assert elapsed >= bound, (elapsed, bound, pushed)
