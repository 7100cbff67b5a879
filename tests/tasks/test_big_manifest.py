"""A checkpoint of 170,000 tensors, whose manifest (about 18 MB in chunks, which keep
the header; 34 MB in shards, with a digest per tensor) is over one JSON body's 16 MiB:
stored through the CLI and the Celery worker on two real nodes (the manifest goes to each
in parts), committed, and gathered byte-identical."""

from __future__ import annotations

import json
import os
import struct
import time

from smoltorrent import defaults
from tests.tasks.test_control_plane import sha

TENSORS = 170_000


def test_a_checkpoint_whose_manifest_is_over_16_mib_commits_and_gathers(make_cluster, tmp_path):
    src = tmp_path / "many.safetensors"
    header = {
        f"model.layers.{i}.w": {"dtype": "U8", "shape": [4], "data_offsets": [4 * i, 4 * i + 4]}
        for i in range(TENSORS)
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(src, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + os.urandom(4 * TENSORS))
    past = time.time() - 60  # settled: the store does not wait for it
    os.utime(src, (past, past))
    c = make_cluster(2)
    stored = c.cli_json("store", str(src), "--name", "many")
    assert stored["state"] == "committed" and stored["tensors"] == TENSORS
    manifest = c.md.r.get(f"smoltorrent:version:{stored['vkey']}:manifest")
    assert len(manifest) > defaults.MAX_JSON_BODY_BYTES
    expected = json.loads(manifest)
    for node in c.node_procs:  # each node holds the whole manifest
        copy = json.loads(node.client().get_manifest(stored["vkey"]))
        # The nodes' copies also carry the version's request order (seq), for a rebuild.
        assert copy.pop("seq") == int(c.md.versions.version(stored["vkey"])["seq"])
        same = copy == expected  # not compared inside assert: pytest's diff of 18 MB hangs
        assert same, f"{node} holds a manifest other than Redis's"
    out = tmp_path / "many.out"
    c.cli("gather", "many", "-o", str(out))
    assert sha(out) == sha(src)
