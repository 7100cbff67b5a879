"""What a rebuild takes from the nodes' copies of manifests: only a copy whose version id
is its content's. A node (or whoever can write to one) could otherwise make a rebuild
restore a version under an id of its choosing, current if its request number is highest."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time

from coordinator.local.synthetic import write_checkpoint
from coordinator.plan.manifest import Manifest
from tests.tasks.conftest import make_cluster  # noqa: F401  (the fixture, shared)

NAME = "run/latest.safetensors"


def test_a_copy_whose_version_id_is_not_its_content_s_is_never_restored(make_cluster, tmp_path):  # noqa: F811
    c = make_cluster(2)
    src = tmp_path / "v.safetensors"
    write_checkpoint(src, 200_000, hidden=32)
    os.utime(src, (time.time() - 60, time.time() - 60))
    real = c.cli_json("store", str(src), "--name", NAME)["version_id"]
    node = c.node_procs[0].client()
    vkey = c.md.versions.current(NAME)
    manifest = Manifest.from_json(node.get_manifest(vkey))
    forged_id = hashlib.sha256(b"an id of the forger's choosing").hexdigest()
    forged = dataclasses.replace(manifest, version_id=forged_id, seq=manifest.seq + 1000)
    node.put_manifest(forged.storage_key(), forged.to_json())

    c.kill_redis()
    shutil.rmtree(c.root / "redis")
    c.start_redis()
    summary = c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    assert summary["restored"] == 1, summary
    assert [r["version_id"] for r in c.cli_json("ls", NAME)] == [real]
    assert any("version id" in line and forged_id[:12] in line for line in summary["unreachable"])
