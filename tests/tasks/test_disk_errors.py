"""A node whose disk fails every fsync with EIO (libfiu, inside that node process only):
a store places its copies on the other nodes and ends at R, byte-identical, with the
failing node named in the attempt log as a disk error, not as a node that stopped
answering."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

from coordinator.local.synthetic import write_checkpoint
from coordinator.state import redis_keys as K
from tests.conftest import require_libfiu

SHARDS = 6  # enough that the placement surely picks the failing node for some


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_store_moves_copies_off_a_node_whose_disk_fails(make_cluster, tmp_path: Path):
    require_libfiu()
    c = make_cluster(nodes=3)
    sick = c.node_procs[0]
    sick.kill()
    sick.launcher = ("fiu-run", "-x")
    sick.start()  # same port, data and id, now under libfiu
    enable = f"enable name=posix/io/sync/fsync,failinfo={errno.EIO}"
    subprocess.run(["fiu-ctrl", "-c", enable, str(sick.pid)], check=True, timeout=10)

    src = tmp_path / "d.safetensors"
    write_checkpoint(src, 1_500_000, hidden=64)
    past = time.time() - 60  # settled
    os.utime(src, (past, past))
    row = json.loads(c.cli("store", str(src), "--shards", str(SHARDS), "--json").stdout)
    assert row["state"] == "committed" and row["min_copies"] == 2, row

    digests = [e.blob_sha256 for e in c.md.versions.manifest(row["vkey"]).entries]
    assert sick.client().has(digests) == set()  # not one copy counted on the failing disk
    for node in c.node_procs[1:]:
        assert node.client().has(digests) == set(digests)
    attempts = [json.loads(a) for a in c.md.r.lrange(K.ATTEMPTS.format(vkey=row["vkey"]), 0, -1)]
    on_sick = [a for a in attempts if a.get("node") == sick.client().ping()]
    assert on_sick and all("disk failed" in a.get("error", "") for a in on_sick), attempts
    out = tmp_path / "back.safetensors"
    c.cli("gather", "d.safetensors", "-o", str(out))
    assert sha(out) == sha(src)
    assert sick.is_running()  # it kept serving through it
