"""store_shard_chain against real node processes: what the chain misses is placed in
rounds, by the nodes that hold a copy, and a lost target is replaced by a spare."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from coordinator.dataplane.chain_engine import Target, pick_spare, store_shard_chain
from coordinator.dataplane.chunk_engine import prepare_chunked_store
from coordinator.dataplane.chunk_source import chunk_span
from coordinator.dataplane.store_engine import PreparedStore, prepare_store
from smoltorrent.errors import NodeUnavailableError, SourceChangedError
from tests.checkpoints import write_llm_like
from tests.nodeproc import start_node

KEY = b"chain-engine-key"
STALL_TIMEOUT_S = 2.0  # seconds; node and client socket timeouts in these tests


@pytest.fixture
def nodes(tmp_path):
    started = [
        start_node(tmp_path / f"node{i}", KEY, socket_timeout=STALL_TIMEOUT_S) for i in range(4)
    ]
    yield started
    for node in started:
        node.kill()


def prepared(path: Path, nodes) -> PreparedStore:
    write_llm_like(path)
    free = {n.client().ping(): 10**12 for n in nodes}
    return prepare_store(path, path.name, free, replicas=3, shards=1)


def target(node, replica: int) -> Target:
    return Target(replica, node.client().ping(), node.client(timeout=STALL_TIMEOUT_S))


def run(p: PreparedStore, targets, holders=(), spare=None):
    return store_shard_chain(p.path, p.identity, p.spans()[0], targets, list(holders), spare)


def held(node, digest: str) -> bool:
    path = node.data_dir / "blobs" / digest[:2] / digest
    return path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_a_healthy_chain_sends_the_shard_once(nodes, tmp_path):
    p = prepared(tmp_path / "a.safetensors", nodes)
    digest = p.manifest.shards[0].blob_sha256
    out = run(p, [target(n, r) for r, n in enumerate(nodes[:3])])
    assert out.failed == {} and out.replaced == {}
    assert [how for _, how in (out.placed[r] for r in range(3))] == ["sent", "replicated"] * 1 + [
        "replicated"
    ]
    assert out.bytes_from_source == p.manifest.shards[0].blob_size
    assert all(held(n, digest) for n in nodes[:3]) and not held(nodes[3], digest)


def test_a_dead_head_hands_the_chain_to_the_next_node_and_a_spare_takes_its_replica(
    nodes, tmp_path
):
    p = prepared(tmp_path / "b.safetensors", nodes)
    digest = p.manifest.shards[0].blob_sha256
    targets = [target(n, r) for r, n in enumerate(nodes[:3])]
    nodes[0].kill()
    spare_node = nodes[3]
    offered: list[set[str]] = []

    def spare(seen: set[str]) -> Target | None:
        offered.append(set(seen))
        return target(spare_node, -1)

    out = run(p, targets, spare=spare)
    assert out.failed == {}
    assert out.replaced == {0: (targets[0].node_id, targets[2].node_id and out.placed[0][0])}
    assert out.placed[0][0] == spare_node.client().ping()
    assert offered and targets[0].node_id in offered[0]
    # The source sent the shard once (to the new head); the spare got a node's copy.
    assert out.bytes_from_source == p.manifest.shards[0].blob_size
    assert all(held(n, digest) for n in nodes[1:])


def test_a_frozen_middle_node_is_given_up_and_the_tail_still_gets_its_copy(nodes, tmp_path):
    """SIGSTOP: the middle node's kernel accepts connections but nothing answers. The
    head gives up on it within its share of the timeout; the tail is served past it."""
    p = prepared(tmp_path / "c.safetensors", nodes)
    digest = p.manifest.shards[0].blob_sha256
    targets = [target(n, r) for r, n in enumerate(nodes[:3])]
    nodes[1].send_signal(signal.SIGSTOP)
    try:
        out = run(p, targets)
    finally:
        nodes[1].send_signal(signal.SIGCONT)
    assert set(out.placed) == {0, 2}
    node, error = out.failed[1]
    assert node == targets[1].node_id and isinstance(error, NodeUnavailableError)
    assert held(nodes[0], digest) and held(nodes[2], digest) and not held(nodes[1], digest)


def test_holders_head_the_chain_and_the_source_sends_nothing(nodes, tmp_path):
    p = prepared(tmp_path / "d.safetensors", nodes)
    digest = p.manifest.shards[0].blob_sha256
    first = run(p, [target(nodes[0], 0)])
    assert first.bytes_from_source > 0
    out = run(p, [target(n, r) for r, n in enumerate(nodes[1:3], start=1)], [nodes[0].client()])
    assert out.bytes_from_source == 0 and out.failed == {}
    assert {how for _, how in out.placed.values()} == {"replicated"}
    assert held(nodes[1], digest) and held(nodes[2], digest)


def test_a_spare_is_the_node_with_fewest_replicas_planned(nodes):
    addresses = {n.client().ping(): n.address for n in nodes}
    ids = sorted(addresses)
    planned = {ids[0]: 3, ids[1]: 2, ids[2]: 1, ids[3]: 2}
    assert pick_spare(addresses, 1, KEY, planned=planned, spread="a" * 64) == ids[2]


def test_spares_for_different_blobs_spread_over_equal_nodes(nodes):
    """The replicas of one lost node are replaced at the same moment by tasks that do not
    see each other's choice: on nodes sharing one disk (free bytes a few MB apart) they
    used to land all on the node that happened to report the most."""
    addresses = {n.client().ping(): n.address for n in nodes}
    planned = dict.fromkeys(addresses, 2)
    picks = {
        pick_spare(
            addresses, 1, KEY, planned=planned, spread=hashlib.sha256(bytes([i])).hexdigest()
        )
        for i in range(16)
    }
    assert len(picks) >= 3, picks


def test_a_source_changed_behind_its_identity_abandons_rather_than_blames_the_head(nodes, tmp_path):
    """Bytes rewritten in place with the mtime put back: the head's digest differs, the
    source is hashed again and differs too, so the version is abandoned (no node is
    replaced for a fault that is the source's)."""
    p = prepared(tmp_path / "a.safetensors", nodes)
    before = Path(p.path).stat()
    with open(p.path, "r+b") as f:
        f.seek(p.manifest.data_start)
        first = f.read(1)
        f.seek(p.manifest.data_start)
        f.write(bytes([first[0] ^ 0xFF]))
    os.utime(p.path, ns=(before.st_atime_ns, before.st_mtime_ns))
    spares = []
    with pytest.raises(SourceChangedError, match="changed while shard 0 was sent"):
        run(p, [target(n, r) for r, n in enumerate(nodes[:3])], spare=lambda seen: spares.append(1))
    assert spares == []


def test_a_holder_heads_the_chain_of_an_encoded_chunk_with_the_encoded_blob(nodes, tmp_path):
    """A chunk's span in the checkpoint is its raw range; the chain announces the encoded
    blob, so a node holding it pushes its copy (the chain asked the holder for the raw
    bytes under the blob's digest, and every node refused them)."""
    src = tmp_path / "ones.safetensors"
    save_file({"norm.weight": torch.ones(512, 512)}, src)  # 1 MiB: one chunk, encoded
    free = {n.client().ping(): 10**12 for n in nodes}
    p = prepare_chunked_store(src, "ones", free, tmp_path / "spool")
    (chunk,) = p.manifest.chunks
    assert chunk.blob_size < chunk.data_end - chunk.data_start
    first = store_shard_chain(p.path, p.identity, p.spans[0], [target(nodes[0], 0)], [])
    assert first.bytes_from_source == chunk.blob_size
    span = chunk_span(p.manifest, chunk, "")  # as a later store has it: nothing spooled
    _replicated_from_the_holder(p, chunk, span, nodes, tmp_path)


def _headed_by_the_holder(p, span, nodes, tmp_path):
    """The chunk's chain to nodes[1] and nodes[2], nodes[0] listed as holding it."""
    targets = [target(n, r) for r, n in enumerate(nodes[1:3], start=1)]
    return store_shard_chain(
        p.path, p.identity, span, targets, [nodes[0].client()], spool=str(tmp_path / "again")
    )


def _replicated_from_the_holder(p, chunk, span, nodes, tmp_path) -> None:
    """nodes[0] pushes its copy down that chain: both nodes get it, the source sends nothing."""
    out = _headed_by_the_holder(p, span, nodes, tmp_path)
    assert out.failed == {} and out.bytes_from_source == 0
    assert {how for _, how in out.placed.values()} == {"replicated"}
    assert held(nodes[1], chunk.blob_sha256) and held(nodes[2], chunk.blob_sha256)


def _stored_encoded_then_rewritten(nodes, tmp_path):
    """An encoded chunk on nodes[0], its spool gone, and the source rewritten since (the
    next step's weights in the same file): the prepared store and the chunk's span as a
    later transfer has it."""
    src = tmp_path / "ones.safetensors"
    save_file({"norm.weight": torch.ones(512, 512)}, src)  # 1 MiB: one chunk, encoded
    free = {n.client().ping(): 10**12 for n in nodes}
    p = prepare_chunked_store(src, "ones", free, tmp_path / "spool")
    (chunk,) = p.manifest.chunks
    store_shard_chain(p.path, p.identity, p.spans[0], [target(nodes[0], 0)], [])
    save_file({"norm.weight": torch.full((512, 512), 2.0)}, src)
    return p, chunk, chunk_span(p.manifest, chunk, "")


def test_a_holder_heads_an_encoded_chunk_whose_spool_is_gone_though_the_source_changed(
    nodes, tmp_path
):
    """The holder pushes its own copy: nothing is encoded again from the source, so a
    source rewritten since does not abandon a version whose blob a node still holds."""
    p, chunk, span = _stored_encoded_then_rewritten(nodes, tmp_path)
    _replicated_from_the_holder(p, chunk, span, nodes, tmp_path)
    assert not (tmp_path / "again").exists()  # nothing was encoded


def test_a_holder_that_lost_its_copy_falls_back_to_the_source_which_says_it_changed(
    nodes, tmp_path
):
    """The listed holder no longer has the blob: the source must send it, cannot encode
    the planned blob from a rewritten file, and says so (the version is abandoned)."""
    p, chunk, span = _stored_encoded_then_rewritten(nodes, tmp_path)
    nodes[0].client().delete(chunk.blob_sha256)
    with pytest.raises(SourceChangedError, match="rewritten"):
        _headed_by_the_holder(p, span, nodes, tmp_path)
    assert not held(nodes[1], chunk.blob_sha256) and not held(nodes[2], chunk.blob_sha256)
