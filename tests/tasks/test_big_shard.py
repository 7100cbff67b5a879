"""A shard past 4 GiB (one tensor) through the CLI, the Celery worker and two real nodes
at R=2 (a chain): stored and gathered byte-identical. Nothing on the way may hold a length
or an offset in 32 bits. The source is sparse (cheap to write and to read), with random
bytes around the 2^31 and 2^32 offsets so a misplaced byte shows; the nodes and the
gathered file hold real bytes (about 13 GiB of disk while it runs, all removed after)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time

from coordinator.local.synthetic import write_sparse_checkpoint

TENSOR_BYTES = (4 << 30) + (64 << 20)  # the 2^32 offset lies well inside it
BIG_TIMEOUT_S = 1800  # seconds per CLI command; the test waits on the command, not a clock


def _same_bytes(a, b, chunk: int = 16 << 20) -> bool:
    """Whether two files hold the same bytes: compared a chunk at a time, three times
    faster than hashing both (SHA-256 runs at ~1.4 GB/s here, a compare at memory speed)."""
    with open(a, "rb", buffering=0) as fa, open(b, "rb", buffering=0) as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def test_a_shard_over_4_gib_round_trips_byte_identical(make_cluster, tmp_path):
    c = make_cluster(2)
    src, out = tmp_path / "big.safetensors", tmp_path / "big.out"
    part = tmp_path / "small.safetensors"
    try:
        size = write_sparse_checkpoint(src, TENSOR_BYTES)
        past = time.time() - 60  # settled: the store does not wait for it to stop changing
        os.utime(src, (past, past))
        argv = ("store", str(src), "--name", "big", "--shards", "1", "--json")
        stored = json.loads(c.cli(*argv, timeout=BIG_TIMEOUT_S).stdout)
        assert stored["state"] == "committed" and stored["size"] == size > 1 << 32
        assert stored["shards"] == 1 and stored["min_copies"] == 2
        blobs = [n.client().list_blobs() for n in c.node_procs]
        assert all(len(b) == 1 and next(iter(b.values())) > 1 << 32 for b in blobs)
        c.cli("gather", "big", "-o", str(out), timeout=BIG_TIMEOUT_S)
        assert os.path.getsize(out) == size
        assert _same_bytes(out, src)
        out.unlink()
        # A partial gather of the tensor past 4 GiB into the shard: a range read there.
        c.cli("gather", "big", "--tensors", "small", "-o", str(part), timeout=BIG_TIMEOUT_S)
        with open(src, "rb") as f:
            f.seek(size - 16)
            assert part.read_bytes()[-16:] == f.read(16)
        header = json.loads(
            part.read_bytes()[8 : 8 + struct.unpack("<Q", part.read_bytes()[:8])[0]]
        )
        assert set(header) - {"__metadata__"} == {"small"}
    finally:
        for path in (src, out, part):
            path.unlink(missing_ok=True)
        c.stop()
        shutil.rmtree(c.root, ignore_errors=True)
