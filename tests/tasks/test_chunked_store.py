"""Chunked versions through the real store and gather path (CLI, Celery worker, Redis,
node processes): only changed tensors move, versions share chunks, a chunk stored once is
neither encoded nor sent again while a version uses it, and a version stored in whole
shards (schema 2) still gathers."""

from __future__ import annotations

import hashlib
import os
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from coordinator.dataplane import codec
from coordinator.state import redis_keys as K
from coordinator.state.versions import COMMITTED
from tests.beat.test_retention import removed, sweep
from tests.beat.test_scrub import flip_byte, whole
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import node_bytes_received

SENT_METRIC = "smoltorrent_node_bytes_sent_total"


def node_bytes(cluster, metric: str) -> list[float]:
    """Each node's `metric` counter, scraped from its /metrics."""
    out = []
    for node in cluster.node_procs:
        port = (node.data_dir / "metrics_port").read_text().strip()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            text = page.read().decode()
        out.append(float(next(x for x in text.splitlines() if x.startswith(metric)).split()[-1]))
    return out


def model(seed: int = 0, changed: int | None = None) -> dict[str, torch.Tensor]:
    """bf16 N(0, 0.02) weights (up_proj 1 MiB: a chunk of its own), fp32 norms; with
    `changed`, up_proj of every layer takes other values (a fine-tune's step)."""
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors: dict[str, torch.Tensor] = {}
    for i in range(3):
        tensors |= {
            f"layers.{i}.q_proj.weight": weight(512, 512),
            f"layers.{i}.norm.weight": torch.ones(512, dtype=torch.float32),
            f"layers.{i}.up_proj.weight": weight(1024, 512),
        }
    if changed is not None:
        other = torch.Generator().manual_seed(changed)
        for name in [n for n in tensors if n.endswith("up_proj.weight")]:
            tensors[name] = (torch.randn(1024, 512, generator=other) * 0.02).to(torch.bfloat16)
    return tensors


def write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, path)
    past = time.time() - 60  # settled: the store does not wait for it
    os.utime(path, (past, past))
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def blob_files(cluster) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for node in cluster.node_procs:
        for path in (node.data_dir / "blobs").rglob("*"):
            if path.is_file() and len(path.name) == 64:
                found.setdefault(path.name, []).append(path)
    return found


def test_a_fine_tune_moves_only_its_changed_chunks_and_versions_share_the_rest(
    make_cluster, tmp_path
):
    c = make_cluster(4, chunks=True, SMOLTORRENT_METRICS_PORT="0", SMOLTORRENT_ENCODE="zstd")
    first = write(tmp_path / "step1.safetensors", model())
    out = c.cli_json("store", str(first), "--name", "run")
    v1 = c.md.versions.manifest(out["vkey"])
    assert v1.chunked and len(v1.chunks) >= 6
    files = blob_files(c)
    assert set(files) == {chunk.blob_sha256 for chunk in v1.chunks}
    for chunk in v1.chunks:  # the nodes keep the encoded chunks, R copies each
        assert len(files[chunk.blob_sha256]) == 2
        assert files[chunk.blob_sha256][0].read_bytes()[:4] == codec.MAGIC
    assert sum(c.blob_size for c in v1.chunks) < 0.8 * v1.source_size
    assert not any((c.root / "spool").glob("*/*")), "the spool is emptied"

    before = sum(node_bytes_received(c))
    second = write(tmp_path / "step2.safetensors", model(changed=1))
    out2 = c.cli_json("store", str(second), "--name", "run")
    v2 = c.md.versions.manifest(out2["vkey"])
    new = [
        chunk for chunk in v2.chunks if chunk.raw_sha256 not in {x.raw_sha256 for x in v1.chunks}
    ]
    changed = sum(chunk.data_end - chunk.data_start for chunk in new)
    assert changed == 3 * 1024 * 512 * 2  # the three up_proj matrices, nothing else
    # Only their encoded chunks reached a node, once per replica.
    assert sum(node_bytes_received(c)) - before == 2 * sum(chunk.blob_size for chunk in new)

    for name, src, version in (("a", first, v1), ("b", second, v2)):
        dest = tmp_path / f"out-{name}.safetensors"
        c.cli_json("gather", "run", "-o", str(dest), "--version", version.version_id[:12])
        assert sha(dest) == sha(src)

    # A partial load reads only the chunk holding its tensor, decoded whole.
    tensor = "layers.1.up_proj.weight"
    (info,) = [t for t in v2.header().tensors if t.name == tensor]
    start, end = info.start, info.end
    (holding,) = [x for x in v2.chunks if x.data_start <= start < x.data_end]
    assert (holding.data_start, holding.data_end) == (start, end)
    sent = sum(node_bytes(c, SENT_METRIC))
    dest = tmp_path / "part.safetensors"
    part = c.cli_json("gather", "run", "--tensors", tensor, "-o", str(dest))
    assert sum(node_bytes(c, SENT_METRIC)) - sent == holding.blob_size
    # and says so: that chunk of all, its encoded bytes as they came, nothing "read whole".
    assert part["chunks_read"] == [holding.index] and part["chunks_total"] == len(v2.chunks)
    assert part["whole_shards"] == [] and part["bytes_fetched"] == holding.blob_size
    assert torch.equal(load_file(dest)[tensor], model(changed=1)[tensor])
    line = c.cli("gather", "run", "--tensors", "layers.1*", "-o", str(tmp_path / "l1")).stdout
    assert "read whole" not in line and f" of {len(v2.chunks)} chunks" in line, line
    assert "each checked against its digests" in line, line

    # Removing the first keeps the second whole: the chunks they share stay.
    c.cli("rm", "run", "--version", v1.version_id[:12])
    gone = {x.blob_sha256 for x in v1.chunks} - {x.blob_sha256 for x in v2.chunks}
    assert gone and not gone & set(blob_files(c))
    dest = tmp_path / "out-after-rm.safetensors"
    c.cli_json("gather", "run", "-o", str(dest))
    assert sha(dest) == sha(second)
    state = c.md.versions.state(out2["vkey"])
    assert state == COMMITTED


def test_a_version_stored_in_whole_shards_still_gathers_beside_chunked_ones(make_cluster, tmp_path):
    """--shards N takes the whole-shard path (manifest schema 2), as every version stored
    before chunks: it gathers, and the same bytes stored in chunks are another version."""
    c = make_cluster(2, chunks=True)
    src = write(tmp_path / "old.safetensors", model())
    old = c.cli_json("store", str(src), "--name", "m", "--shards", "2")
    manifest = c.md.versions.manifest(old["vkey"])
    assert manifest.schema_version == 2 and len(manifest.shards) == 2
    chunked = c.cli_json("store", str(src), "--name", "m")
    assert c.md.versions.manifest(chunked["vkey"]).chunked and chunked["new"] is True
    for version in (old, chunked):
        dest = tmp_path / f"out-{version['vkey'][:6]}.safetensors"
        c.cli_json("gather", "m", "-o", str(dest), "--version", version["version_id"][:12])
        assert sha(dest) == sha(src)


def test_rebuild_from_the_nodes_restores_chunked_versions_and_what_they_store(
    make_cluster, tmp_path
):
    """After Redis is lost, the nodes' manifests bring the chunked versions back: they
    gather, and a store of bytes they hold finds its chunks stored and sends nothing."""
    c = make_cluster(2, chunks=True, SMOLTORRENT_METRICS_PORT="0")
    first = write(tmp_path / "a.safetensors", model())
    second = write(tmp_path / "b.safetensors", model(changed=1))
    for src in (first, second):
        c.cli_json("store", str(src), "--name", "run")
    c.md.r.flushall()
    summary = c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    assert summary["restored"] == 2
    dest = tmp_path / "out.safetensors"
    c.cli_json("gather", "run", "-o", str(dest))
    assert sha(dest) == sha(second)
    before = sum(node_bytes_received(c))
    again = c.cli_json("store", str(first), "--name", "copy")
    assert again["new"] is True and c.md.versions.manifest(again["vkey"]).chunked
    assert sum(node_bytes_received(c)) == before


def test_a_corrupt_encoded_chunk_is_caught_at_gather_and_by_the_nodes_scrub(make_cluster, tmp_path):
    """A node keeps and re-hashes the encoded bytes (it never decodes): a flipped byte in
    one copy is read from the other replica at gather, and `verify` (the nodes' scrub,
    then repair) finds it and brings the chunk back to two good copies."""
    c = make_cluster(3, chunks=True, SMOLTORRENT_ENCODE="zstd")
    src = write(tmp_path / "m.safetensors", model())
    out = c.cli_json("store", str(src), "--name", "m")
    chunk = max(c.md.versions.manifest(out["vkey"]).chunks, key=lambda x: x.blob_size)
    by_id = {n.client().ping(): n for n in c.node_procs}
    for node_id in c.md.blobs.placement(chunk.blob_sha256):
        if node_id != min(c.md.blobs.placement(chunk.blob_sha256)):
            continue
        flip_byte(by_id[node_id], chunk.blob_sha256, chunk.blob_size // 2)
    dest = tmp_path / "out.safetensors"
    caught = set()
    for _ in range(2):  # whichever replica it reads first, the file is whole
        gathered = c.cli_json("gather", "m", "-o", str(dest))
        assert sha(dest) == sha(src)
        caught |= {("gather", b["shard"]) for b in gathered["bad_copies"]}
    report = c.cli_json("verify", "m")
    caught |= {("scrub", b["digest"]) for b in report["bad"] if b["problem"] == "bad"}
    # Found by a gather that read it (then re-hashed and repaired at once), else by verify.
    assert caught and caught <= {("gather", chunk.index), ("scrub", chunk.blob_sha256)}
    wait_until(lambda: sum(whole(n, chunk.blob_sha256) for n in c.node_procs) == 2)
    assert len(c.md.blobs.placement(chunk.blob_sha256)) == 2


def test_a_chunk_two_versions_share_survives_the_retention_of_one(make_cluster, tmp_path):
    c = make_cluster(3, chunks=True, SMOLTORRENT_KEEP_LAST="1", SMOLTORRENT_ENCODE="zstd")
    first = write(tmp_path / "a.safetensors", model())
    second = write(tmp_path / "b.safetensors", model(changed=1))
    old = c.cli_json("store", str(first), "--name", "r")["vkey"]
    new = c.cli_json("store", str(second), "--name", "r")["vkey"]
    chunks = {v: {x.blob_sha256 for x in c.md.versions.manifest(v).chunks} for v in (old, new)}
    shared, own = chunks[old] & chunks[new], chunks[old] - chunks[new]
    assert shared and own
    assert sweep(c) == {"retired": 1}
    wait_until(lambda: removed(c, old), what="the remove of the older version")
    held = set(blob_files(c))
    assert shared <= held and not own & held
    assert all(len(c.md.blobs.placement(d)) == 2 for d in shared)
    dest = tmp_path / "out.safetensors"
    c.cli_json("gather", "r", "-o", str(dest))
    assert sha(dest) == sha(second)


def test_byte_identical_chunks_in_one_version_are_sent_once_and_all_gather(make_cluster, tmp_path):
    """A freshly initialised model has several tensors with the same bytes (every norm at
    ones): their chunks are one blob. The version lists each chunk, the blob is sent once
    per replica, and the version commits and gathers whole."""
    c = make_cluster(3, chunks=True, SMOLTORRENT_METRICS_PORT="0", SMOLTORRENT_ENCODE="zstd")
    tensors = model()
    for i in range(3):  # 1 MiB each: a chunk of its own, the same bytes in every layer
        tensors[f"layers.{i}.post_norm.weight"] = torch.ones(512, 512, dtype=torch.float32)
    src = write(tmp_path / "init.safetensors", tensors)
    out = c.cli_json("store", str(src), "--name", "init")
    assert c.md.versions.state(out["vkey"]) == COMMITTED
    manifest = c.md.versions.manifest(out["vkey"])
    blobs = {chunk.blob_sha256: chunk.blob_size for chunk in manifest.chunks}
    assert len(manifest.chunks) - len(blobs) >= 2, "three chunks share one blob"
    assert sum(node_bytes_received(c)) == 2 * sum(blobs.values())
    assert {d: len(paths) for d, paths in blob_files(c).items()} == dict.fromkeys(blobs, 2)
    assert not any((c.root / "spool").glob("*/*")), "encoded once, and the spool emptied"
    dest = tmp_path / "out.safetensors"
    c.cli_json("gather", "init", "-o", str(dest))
    assert sha(dest) == sha(src)


def zeros(path: Path, dtype: torch.dtype) -> Path:
    """2 MiB of zeros as one tensor of `dtype` (a chunk of its own): the same raw bytes,
    hence the same raw digest, at every width, grouped by 1, 2 or 4 bytes when encoded."""
    return write(path, {"m": torch.zeros(2 * 1024 * 1024 // dtype.itemsize, dtype=dtype)})


@pytest.mark.parametrize("why", ["chain off", "holder down"])
def test_a_shared_chunk_sent_again_from_the_source_gives_the_blob_it_names(
    make_cluster, tmp_path, why
):
    """All-zero tensors are common (Adam moments at step 0, LoRA B): bf16 zeros stored
    first, the same bytes as fp32 zeros stored after find that chunk stored. When its blob
    must then be sent from the source (SMOLTORRENT_CHAIN=0 and a second copy wanted, or
    its one holder down), the bytes encoded again must be that blob: encoded by fp32's
    width they were another, and the store was abandoned as "changed while chunk 0 was
    encoded", then queued again to make the same choice."""
    env = {"SMOLTORRENT_CHAIN": "0"} if why == "chain off" else {}
    c = make_cluster(3, chunks=True, SMOLTORRENT_ENCODE="zstd", **env)
    first = c.cli_json(
        "store",
        str(zeros(tmp_path / "a.safetensors", torch.bfloat16)),
        "--name",
        "a",
        "--replicas",
        "1",
    )
    [held] = c.md.versions.manifest(first["vkey"]).chunks
    if why == "holder down":
        [holder] = c.md.blobs.placement(held.blob_sha256)
        next(n for n in c.node_procs if n.client().ping() == holder).kill()
    src = zeros(tmp_path / "b.safetensors", torch.float32)
    out = c.cli_json("store", str(src), "--name", "b", "--replicas", "2")
    assert c.md.versions.state(out["vkey"]) == COMMITTED
    [chunk] = c.md.versions.manifest(out["vkey"]).chunks
    assert chunk.raw_sha256 == held.raw_sha256
    dest = tmp_path / "out.safetensors"
    c.cli_json("gather", "b", "-o", str(dest))
    assert sha(dest) == sha(src)


def test_a_shared_chunk_whose_only_copy_rotted_is_sent_again_not_counted(make_cluster, tmp_path):
    """Invariant 14: a deduplicated chunk counts as a copy only while a copy of it is known
    good. At R=1 the one copy of a chunk two versions share rots in place (same size); the
    store of the second version has its node re-hash the copy before counting it, finds it
    bad (quarantined there) and sends the chunk again, so the version it reports stored
    gathers byte-identical. Counted unchecked, the store committed and the gather failed."""
    c = make_cluster(2, chunks=True, SMOLTORRENT_ENCODE="zstd")
    first = write(tmp_path / "a.safetensors", model())
    out = c.cli_json("store", str(first), "--name", "run", "--replicas", "1")
    v1 = c.md.versions.manifest(out["vkey"])
    (q_proj,) = [t for t in v1.header().tensors if t.name == "layers.0.q_proj.weight"]
    (shared,) = [x for x in v1.chunks if x.data_start <= q_proj.start < x.data_end]
    (holder,) = c.md.blobs.placement(shared.blob_sha256)
    node = next(n for n in c.node_procs if n.client().ping() == holder)
    flip_byte(node, shared.blob_sha256, shared.blob_size // 2)
    second = write(tmp_path / "b.safetensors", model(changed=1))
    out = c.cli_json("store", str(second), "--name", "run", "--replicas", "1")
    assert shared in c.md.versions.manifest(out["vkey"]).chunks
    dest = tmp_path / "out.safetensors"
    c.cli_json("gather", "run", "-o", str(dest))
    assert sha(dest) == sha(second)
    assert any(whole(n, shared.blob_sha256) for n in c.node_procs)


def test_a_raw_chunk_whose_blob_is_not_its_raw_digest_is_refused_at_gather(make_cluster, tmp_path):
    """A bare RAW chunk's blob is its raw bytes, so its blob digest is its raw digest. A
    manifest that names another blob for it (edited by hand, a hostile copy) names bytes
    that are not the chunk's: the blob's own digest holds, and the gather wrote them into
    the chunk's range before (issue 37 4g). It must refuse the chunk, write nothing."""
    c = make_cluster(3, chunks=True, SMOLTORRENT_ENCODE="raw")
    generator = torch.Generator().manual_seed(7)
    tensors = {  # two chunks of one size (each at least a chunk of its own), not alike
        name: torch.randint(0, 256, (2 * 1024 * 1024,), dtype=torch.uint8, generator=generator)
        for name in ("a", "b")
    }
    src = write(tmp_path / "m.safetensors", tensors)
    vkey = c.cli_json("store", str(src), "--name", "m")["vkey"]
    manifest = c.md.versions.manifest(vkey)
    first, second = manifest.chunks[0], manifest.chunks[1]
    assert first.blob_size == first.data_end - first.data_start == second.blob_size  # bare RAW
    assert first.blob_sha256 == first.raw_sha256 != second.blob_sha256
    key = K.MANIFEST.format(vkey=vkey)
    text = c.md.r.get(key)
    c.md.r.set(
        key,
        text.replace(
            f'"blob_sha256":"{first.blob_sha256}"', f'"blob_sha256":"{second.blob_sha256}"', 1
        ),
    )
    assert c.md.versions.manifest(vkey).chunks[0].blob_sha256 == second.blob_sha256
    dest = tmp_path / "out.safetensors"
    gathered = c.cli("gather", "m", "-o", str(dest), check=False)
    assert gathered.returncode == 1, gathered.stdout + gathered.stderr
    assert "raw" in gathered.stderr and first.raw_sha256[:12] in gathered.stderr, gathered.stderr
    assert not dest.exists()
