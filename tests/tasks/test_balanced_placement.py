"""Balanced placement through the real store and gather: Redis, worker, nodes, the CLI."""

from __future__ import annotations

import os
import time
from collections import Counter

from coordinator.state.versions import COMMITTED
from tests.checkpoints import write_raw
from tests.tasks.test_control_plane import sha

MB = 1 << 20


def write_unequal(path) -> None:
    """One large tensor and three small ones, so 4 shards cut at tensor boundaries differ
    fourfold in size (an embedding table beside layers)."""
    sizes = {"embed": 4 * MB, "layer.0": MB, "layer.1": MB, "layer.2": MB}
    header, offset = {}, 0
    for name, size in sizes.items():
        header[name] = {
            "dtype": "F32",
            "shape": [size // 4],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    write_raw(path, header, os.urandom(offset), pad_to=8)
    past = time.time() - 60  # settled: the store need not wait for the file to be finished
    os.utime(path, (past, past))


def test_four_unequal_shards_on_four_equal_nodes_two_blobs_each(make_cluster, tmp_path):
    """4 shards x 2 copies on 4 equal nodes: the nodes' own inventories hold 2 blobs each
    (placing by bytes alone gave 1, 1, 3, 3), every node heads one chain, and a gather
    reads one shard from each node."""
    c = make_cluster(4)
    src = tmp_path / "u.safetensors"
    write_unequal(src)
    row = c.cli_json("store", str(src), "--shards", "4")
    assert row["state"] == COMMITTED and row["min_copies"] == 2
    shards = c.md.versions.manifest(row["vkey"]).entries
    assert len({s.blob_size for s in shards}) > 1  # the shards really differ
    ids = {n.client().ping(): n for n in c.node_procs}
    held = {node_id: len(node.client().list_blobs()) for node_id, node in ids.items()}
    assert held == dict.fromkeys(ids, 2)
    heads = Counter(t[0] for t in c.md.transfers.plan(row["vkey"]))
    assert heads == dict.fromkeys(ids, 1)  # the coordinator sent to every node alike
    out = tmp_path / "out.safetensors"
    report = c.cli_json("gather", "u.safetensors", "-o", str(out))
    assert sha(out) == sha(src)
    assert sorted(Counter(report["served_by"].values()).values()) == [1, 1, 1, 1]
