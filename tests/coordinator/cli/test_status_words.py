"""What `status` says while a node is down but not yet dead, through the real CLI on a
real cluster: no repair has started, so it says when one would, one row a version."""

from __future__ import annotations

from tests.tasks.test_control_plane import make_blobs_ckpt


def test_a_down_node_is_not_said_to_be_repaired_and_short_chunks_are_summed(make_cluster, tmp_path):
    c = make_cluster(3, worker=True, SMOLTORRENT_DEAD_AFTER_S="600")
    src = make_blobs_ckpt(tmp_path / "m.safetensors", 3, 1 << 20)
    c.cli("store", str(src), "--name", "run1/m.safetensors")
    entries = c.md.versions.manifest(c.md.versions.current("run1/m.safetensors")).entries
    chunks = len(entries)
    first = entries[0].blob_sha256
    (holder, *_) = [n for n in c.node_procs if any((n.data_dir / "blobs").rglob(first))]
    holder.kill()
    status = c.cli("status", check=False)
    text = status.stdout
    assert status.returncode == 0, text + status.stderr
    assert "being repaired" not in text, text
    assert "not repaired yet" in text and "SMOLTORRENT_DEAD_AFTER_S" in text, text
    assert "600 s" in text, text
    # One row for the version (tab-separated in a pipe), not one a chunk.
    rows = [line for line in text.splitlines() if line.startswith("run1/m.safetensors\t")]
    assert len(rows) == 1, text
    short = int(rows[0].split("\t")[2])
    assert 1 <= short <= chunks and "shard" not in text, text
