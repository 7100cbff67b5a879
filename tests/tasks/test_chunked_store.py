"""Chunked versions through the real store and gather path (CLI, Celery worker, Redis,
node processes): only changed tensors move, versions share chunks, a chunk stored once is
neither encoded nor sent again while a version uses it, and a version stored in whole
shards (schema 2) still gathers."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from coordinator.dataplane import codec
from coordinator.state.versions import COMMITTED
from tests.tasks.test_control_plane import node_bytes_received


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
