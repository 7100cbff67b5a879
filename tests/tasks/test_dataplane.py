"""The data plane under faults, end to end: real Redis, worker, nodes and CLI."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import redis

from coordinator.local.synthetic import write_checkpoint
from coordinator.state import redis_keys as K

GARBAGE_BYTES = 3 * 1024 * 1024  # a few MiB: more than a neighbouring shard's range here


def make_ckpt(path: Path, size: int = 4_000_000) -> Path:
    write_checkpoint(path, size, hidden=128)
    past = time.time() - 60  # settled: the store does not wait for the file to settle
    os.utime(path, (past, past))
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def first_tried(c, index: int, digest: str):
    """The node the gather task tries first for shard `index` (its order: sorted holders,
    rotated by the shard index, live ones first; all are live here)."""
    holders = sorted(c.md.placement(digest))
    k = index % len(holders)
    node_id = (holders[k:] + holders[:k])[0]
    address = str(c.md.nodes()[node_id].address)
    return node_id, next(n for n in c.node_procs if str(n.address) == address)


def test_oversized_copies_gather_identical_and_are_recorded(make_cluster, tmp_path):
    c = make_cluster(4)
    src = make_ckpt(tmp_path / "o.safetensors")
    c.cli_json("store", str(src), "--shards", "4")
    manifest = c.md.manifest(c.md.current("o.safetensors"))
    spoiled = set()
    for index, shard in enumerate(manifest.shards):
        node_id, node = first_tried(c, index, shard.blob_sha256)
        blob = node.data_dir / "blobs" / shard.blob_sha256[:2] / shard.blob_sha256
        with open(blob, "ab") as f:
            f.write(os.urandom(GARBAGE_BYTES))
        spoiled.add(f"{shard.blob_sha256}:{node_id}")
    out = tmp_path / "out.safetensors"
    proc = c.cli("gather", "o.safetensors", "-o", str(out), "--json", check=False)
    # Identical or a clean failure; never a different file with exit 0.
    if proc.returncode == 0:
        assert sha(out) == sha(src)
    else:
        assert not out.exists()
    assert proc.returncode == 0, proc.stderr  # every shard has a good second copy
    report = json.loads(proc.stdout)
    assert len(report["bad_copies"]) == len(manifest.shards)
    recorded = redis.Redis.from_url(c.redis_url, decode_responses=True).hgetall(K.BAD_COPIES)
    assert set(recorded) == spoiled
