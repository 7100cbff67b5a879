"""Sixteen real node processes behind one Celery worker: a store at R=2 places on every one
of them, and the gather is byte-identical."""

from __future__ import annotations

from coordinator.dataplane.node_client import NodeClient
from tests.tasks.test_control_plane import make_blobs_ckpt, sha

NODES = 16


def test_store_and_gather_over_16_nodes(make_cluster, tmp_path):
    c = make_cluster(NODES)
    assert len(c.cli_json("nodes", "ls")) == NODES
    src = make_blobs_ckpt(tmp_path / "wide.safetensors", NODES)
    stored = c.cli_json("store", str(src), "--name", "wide")
    assert stored["state"] == "committed"
    assert stored["shards"] == NODES and stored["min_copies"] == 2  # a shard per live node
    held = [NodeClient(n.address).list_blobs() for n in c.node_procs]
    assert all(held), [len(h) for h in held]  # every node holds a copy of something
    assert sum(len(h) for h in held) == 2 * NODES
    out = tmp_path / "wide.out"
    c.cli("gather", "wide", "-o", str(out))
    assert sha(out) == sha(src)
