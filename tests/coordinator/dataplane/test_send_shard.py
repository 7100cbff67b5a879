"""send_shard against real node processes: corrupt holders, corrupting targets, slow links."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.dataplane.node_client import NodeAddress, NodeClient
from coordinator.dataplane.store_engine import PreparedStore, prepare_store, send_shard
from smoltorrent.errors import BadTargetError, SourceChangedError
from tests.checkpoints import write_llm_like, write_raw
from tests.nodeproc import start_node
from tests.tcpproxy import start_proxy

STALL_TIMEOUT_S = 2.0  # seconds; node and client socket timeouts (1 s flaked on a loaded box)
THROTTLED_BPS = 3 * 1024 * 1024  # bytes/s through the slow link
# 24 MiB at 3 MiB/s: a copy of ~8 s, four socket timeouts long. A 3 GB copy at 25 MB/s
# against the default 30 s timeout is the same ratio; this keeps the test seconds long.
SLOW_BLOB_BYTES = 24 * 1024 * 1024


@pytest.fixture(params=[None, b"cluster-key"], ids=["keyless", "keyed"])
def nodes(request, tmp_path):
    key = request.param
    started = [
        start_node(tmp_path / f"node{i}", key, socket_timeout=STALL_TIMEOUT_S) for i in range(2)
    ]
    yield started
    for node in started:
        node.kill()


def prepared(path: Path, nodes) -> PreparedStore:
    free = {n.client().ping(): 10**12 for n in nodes}
    return prepare_store(path, path.name, free, replicas=1, shards=2)


def send(p: PreparedStore, index: int, target, holders=(), **kw) -> str:
    return send_shard(p.path, p.identity, p.spans()[index], target, list(holders), **kw)


def blob_file(node, digest: str) -> Path:
    return node.data_dir / "blobs" / digest[:2] / digest


def test_a_corrupt_copy_on_the_holder_falls_back_to_the_source(nodes, tmp_path):
    holder, target = nodes
    src = tmp_path / "h.safetensors"
    write_llm_like(src)
    p = prepared(src, nodes)
    shard = p.manifest.shards[0]
    assert send(p, 0, holder.client()) == "sent"
    path = blob_file(holder, shard.blob_sha256)
    data = bytearray(path.read_bytes())
    data[shard.blob_data_offset + 3] ^= 0x10
    path.write_bytes(bytes(data))
    assert send(p, 0, target.client(), [holder.client()]) == "sent"
    assert target.client().verify([shard.blob_sha256]) == []


def test_a_target_that_corrupts_bytes_is_its_fault_not_the_sources(nodes, tmp_path):
    good, bad = nodes
    src = tmp_path / "t.safetensors"
    write_llm_like(src, layers=4, hidden=256)
    p = prepared(src, nodes)
    proxy = start_proxy(str(bad.address), tmp_path, flip_at=64 * 1024)
    try:
        flipping = NodeClient(NodeAddress("127.0.0.1", proxy.port), cluster_key=bad.cluster_key)
        with pytest.raises(BadTargetError, match="unchanged source"):
            send(p, 0, flipping)
        # A source rewritten in place (same size and times) is still told apart.
        stat = src.stat()
        with open(src, "r+b") as f:
            f.seek(p.manifest.data_start + p.manifest.shards[0].data_start + 10)
            f.write(os.urandom(16))
        os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        with pytest.raises(SourceChangedError, match="changed while shard 0"):
            send(p, 0, flipping)
        assert good.client().list_blobs() == {}
    finally:
        proxy.stop()


def test_a_slow_node_to_node_copy_completes_and_is_not_resent_from_the_source(nodes, tmp_path):
    holder, target = nodes
    src = tmp_path / "big.safetensors"
    tensor = {
        "w": {"dtype": "U8", "shape": [SLOW_BLOB_BYTES], "data_offsets": [0, SLOW_BLOB_BYTES]}
    }
    write_raw(src, tensor, os.urandom(SLOW_BLOB_BYTES))
    p = prepare_store(src, src.name, {holder.client().ping(): 10**12}, replicas=1, shards=1)
    assert send(p, 0, holder.client(timeout=STALL_TIMEOUT_S)) == "sent"
    proxy = start_proxy(str(target.address), tmp_path, rate=THROTTLED_BPS)
    try:
        slow_target = NodeClient(
            NodeAddress("127.0.0.1", proxy.port),
            cluster_key=target.cluster_key,
            timeout=STALL_TIMEOUT_S,
        )
        how = send(p, 0, slow_target, [holder.client(timeout=STALL_TIMEOUT_S)])
    finally:
        proxy.stop()
    assert how == "replicated", holder.log()[-2000:]
    assert target.client().verify([p.manifest.shards[0].blob_sha256]) == []
