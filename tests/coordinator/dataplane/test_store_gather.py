"""The data plane without Celery: store and gather through real node processes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from coordinator.dataplane.gather_engine import gather_checkpoint
from coordinator.dataplane.node_client import NodeClient
from coordinator.dataplane.store_engine import store_checkpoint
from smoltorrent.errors import CheckpointFormatError, GatherError
from tests.checkpoints import write_llm_like, write_mlx, write_one_giant, write_raw
from tests.nodeproc import start_node


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def nodes(tmp_path):
    started = [start_node(tmp_path / f"node{i}") for i in range(4)]
    yield started
    for node in started:
        node.kill()


def ids_of(nodes) -> dict[str, object]:
    return {NodeClient(n.address).ping(): n for n in nodes}


def sources_for(result, by_id, first=None):
    """Replica lists per shard; `first` (a node) is tried first wherever it holds a copy."""
    out = []
    for index in range(len(result.manifest.shards)):
        holders = [by_id[h] for h in result.holders[index]]
        holders.sort(key=lambda n: n is not first)
        out.append([NodeClient(n.address) for n in holders])
    return out


def round_trip(src: Path, nodes, tmp_path: Path, **kw):
    result = store_checkpoint(src, [n.address for n in nodes], **kw)
    out = tmp_path / ("out-" + src.name)
    gather_checkpoint(result.manifest, sources_for(result, ids_of(nodes)), out)
    assert sha(out) == sha(src)
    return result


def test_llm_like_round_trip_is_byte_identical_and_blobs_are_safetensors(nodes, tmp_path):
    src = tmp_path / "llm.safetensors"
    tensors = write_llm_like(src, layers=6, hidden=96)
    result = round_trip(src, nodes, tmp_path)
    assert len(result.manifest.shards) == 4 and not result.under_replicated()
    # Every blob on every node is a standalone safetensors file holding its tensors.
    seen = set()
    for node in nodes:
        for blob in (node.data_dir / "blobs").rglob("*"):
            if not blob.is_file():
                continue
            with safe_open(str(blob), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    got, want = f.get_tensor(name), tensors[name]
                    assert got.dtype == want.dtype and got.shape == want.shape, name
                    assert got.reshape(-1).view(torch.uint8).tolist() == (
                        want.reshape(-1).view(torch.uint8).tolist()
                    ), name
                    seen.add(name)
    assert seen == set(tensors)


def test_mlx_checkpoint_round_trip(nodes, tmp_path):
    src = tmp_path / "mlx.safetensors"
    write_mlx(src)
    round_trip(src, nodes, tmp_path, shards=3)


def test_one_giant_tensor_and_more_shards_than_nodes(nodes, tmp_path):
    giant = tmp_path / "giant.safetensors"
    write_one_giant(giant)
    round_trip(giant, nodes, tmp_path)
    many = tmp_path / "many.safetensors"
    write_llm_like(many, layers=8)
    result = round_trip(many, nodes, tmp_path, shards=11)
    assert len(result.manifest.shards) == 11
    assert all(len(h) == 2 and len(set(h)) == 2 for h in result.holders.values())


def test_node_killed_before_and_during_gather_falls_back(nodes, tmp_path):
    src = tmp_path / "big.safetensors"
    write_llm_like(src, layers=4, hidden=1024)  # ~70 MB: slow enough to kill mid-stream
    result = store_checkpoint(src, [n.address for n in nodes], replicas=2)
    by_id = ids_of(nodes)
    dead_before = by_id[result.holders[0][0]]
    dead_before.kill()
    out = tmp_path / "before.safetensors"
    report = gather_checkpoint(result.manifest, sources_for(result, by_id, dead_before), out)
    assert sha(out) == sha(src) and report.fallbacks

    victim = next(n for n in nodes if n is not dead_before)
    dead_before.start(dead_before.address.port)
    killed = []

    def kill_on_first_bytes(_n: int) -> None:
        if not killed:
            killed.append(victim.pid)
            victim.kill()

    out2 = tmp_path / "during.safetensors"
    report = gather_checkpoint(
        result.manifest, sources_for(result, by_id, victim), out2, progress=kill_on_first_bytes
    )
    assert killed and sha(out2) == sha(src)
    assert any(str(victim.address) in line for line in report.fallbacks)


def test_flipped_bit_is_found_by_verify_and_gather_falls_back(nodes, tmp_path):
    src = tmp_path / "flip.safetensors"
    write_llm_like(src)
    result = store_checkpoint(src, [n.address for n in nodes])
    by_id = ids_of(nodes)
    shard = result.manifest.shards[1]
    node = by_id[result.holders[1][0]]
    blob = node.data_dir / "blobs" / shard.blob_sha256[:2] / shard.blob_sha256
    data = bytearray(blob.read_bytes())
    data[shard.blob_data_offset + 5] ^= 0x01
    blob.write_bytes(bytes(data))
    out = tmp_path / "out.safetensors"
    report = gather_checkpoint(result.manifest, sources_for(result, by_id, node), out)
    assert sha(out) == sha(src)
    assert any("hash" in line for line in report.fallbacks)
    # verify finds it too, and sets it aside: no later read gets those bytes.
    assert NodeClient(node.address).verify() == [shard.blob_sha256]
    assert NodeClient(node.address).has([shard.blob_sha256]) == set()


def test_both_replicas_gone_fails_naming_the_shard_and_leaves_destination(nodes, tmp_path):
    src = tmp_path / "lost.safetensors"
    write_llm_like(src)
    result = store_checkpoint(src, [n.address for n in nodes])
    by_id = ids_of(nodes)
    for node_id in result.holders[2]:
        by_id[node_id].kill()
    dest = tmp_path / "existing.safetensors"
    dest.write_bytes(b"precious")
    with pytest.raises(GatherError, match=r"shard 2 \("):
        gather_checkpoint(result.manifest, sources_for(result, by_id), dest)
    assert dest.read_bytes() == b"precious"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
BAD_FILES = {
    "not safetensors (pickle)": b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94.",
    "empty": b"",
    "header beyond file": (10**12).to_bytes(8, "little") + b"{}",
    "truncated data": None,
    "overlapping offsets": {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    },
    "unknown dtype": {"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}},
    "shape/size mismatch": {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
    "duplicate names": b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
    b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_input_is_refused_and_nothing_is_sent(case, nodes, tmp_path):
    path = tmp_path / "bad.safetensors"
    spec = BAD_FILES[case]
    if spec is None:
        write_raw(path, GOOD, b"\0" * 8)
        os.truncate(path, path.stat().st_size - 3)
    elif isinstance(spec, dict):
        write_raw(path, spec, b"\0" * 16)
    elif spec.startswith(b"{"):
        write_raw(path, spec, b"\0" * 2)
    else:
        path.write_bytes(spec)
    with pytest.raises(CheckpointFormatError, match="bad.safetensors"):
        store_checkpoint(path, [n.address for n in nodes])
    for node in nodes:
        client = NodeClient(node.address)
        assert client.list_blobs() == {} and client.list_manifests() == []


def test_manifest_is_kept_on_the_nodes(nodes, tmp_path):
    src = tmp_path / "m.safetensors"
    write_llm_like(src)
    result = store_checkpoint(src, [n.address for n in nodes])
    key = result.manifest.storage_key()
    holding = [n for n in nodes if key in NodeClient(n.address).list_manifests()]
    by_id = ids_of(nodes)
    assert set(holding) == {by_id[n] for h in result.holders.values() for n in h}
    stored = json.loads(NodeClient(holding[0].address).get_manifest(key))
    assert stored["version_id"] == result.manifest.version_id


def test_gather_onto_a_full_disk_fails_cleanly(nodes, tmp_path, small_fs):
    src = tmp_path / "big.safetensors"
    write_llm_like(src, layers=4, hidden=384)  # ~9 MB: more than the 4 MiB file system
    result = store_checkpoint(src, [n.address for n in nodes])
    dest = small_fs / "restored.safetensors"
    dest.write_bytes(b"previous")
    with pytest.raises(GatherError, match="not enough free space"):
        gather_checkpoint(result.manifest, sources_for(result, ids_of(nodes)), dest)
    assert [p.name for p in small_fs.iterdir()] == ["restored.safetensors"]
    assert dest.read_bytes() == b"previous"


def test_chain_replication_moves_each_byte_once_from_the_source(nodes, tmp_path):
    src = tmp_path / "chain.safetensors"
    write_llm_like(src)
    result = store_checkpoint(src, [n.address for n in nodes], chain=True)
    assert all(len(h) == 2 for h in result.holders.values())
    out = tmp_path / "out.safetensors"
    gather_checkpoint(result.manifest, sources_for(result, ids_of(nodes)), out)
    assert sha(out) == sha(src)
    # The second copy of every shard came from a node: the source sent each blob once.
    blob_bytes = sum(s.blob_size for s in result.manifest.shards)
    assert result.bytes_sent == 2 * blob_bytes
    assert result.bytes_from_source == blob_bytes
    parallel = store_checkpoint(src, [n.address for n in nodes], name="again")
    assert parallel.bytes_sent == 0  # content addressing: every blob is already in place


def blob_file(node, digest: str) -> Path:
    return node.data_dir / "blobs" / digest[:2] / digest


GARBAGE_BYTES = 3 * 1024 * 1024  # a few MiB: more than any neighbouring shard's range here


def test_oversized_copies_never_spill_into_a_neighbouring_shard(nodes, tmp_path):
    src = tmp_path / "spill.safetensors"
    write_llm_like(src, layers=4, hidden=256)
    result = store_checkpoint(src, [n.address for n in nodes])
    by_id = ids_of(nodes)
    sources = []
    for index, shard in enumerate(result.manifest.shards):
        first, second = (by_id[h] for h in result.holders[index])
        with open(blob_file(first, shard.blob_sha256), "ab") as blob:
            blob.write(os.urandom(GARBAGE_BYTES))  # a foreign tool, a bad disk
        sources.append([NodeClient(first.address), NodeClient(second.address)])
    out = tmp_path / "out.safetensors"
    met = []
    report = gather_checkpoint(result.manifest, sources, out, on_bad_copy=met.append)
    assert sha(out) == sha(src)
    assert out.stat().st_size == src.stat().st_size
    bad = sorted((b.shard, b.address) for b in report.bad_copies)
    assert bad == sorted((i, str(s[0].address)) for i, s in enumerate(sources))
    assert met == report.bad_copies
    assert all("not the" in b.reason for b in report.bad_copies)


def test_only_oversized_copies_left_fails_cleanly(nodes, tmp_path):
    src = tmp_path / "spill.safetensors"
    write_llm_like(src, layers=4, hidden=256)
    result = store_checkpoint(src, [n.address for n in nodes])
    by_id = ids_of(nodes)
    shard = result.manifest.shards[0]
    for node_id in result.holders[0]:
        with open(blob_file(by_id[node_id], shard.blob_sha256), "ab") as blob:
            blob.write(os.urandom(GARBAGE_BYTES))
    dest = tmp_path / "existing.safetensors"
    dest.write_bytes(b"precious")
    with pytest.raises(GatherError, match=r"shard 0 \("):
        gather_checkpoint(result.manifest, sources_for(result, by_id), dest)
    assert dest.read_bytes() == b"precious"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_truncated_copy_is_a_bad_copy(nodes, tmp_path):
    src = tmp_path / "short.safetensors"
    write_llm_like(src)
    result = store_checkpoint(src, [n.address for n in nodes])
    by_id = ids_of(nodes)
    last = len(result.manifest.shards) - 1
    shard = result.manifest.shards[last]
    node = by_id[result.holders[last][0]]
    os.truncate(blob_file(node, shard.blob_sha256), shard.blob_size - 100)
    out = tmp_path / "out.safetensors"
    report = gather_checkpoint(result.manifest, sources_for(result, by_id, node), out)
    assert sha(out) == sha(src)
    assert [(b.shard, b.address) for b in report.bad_copies] == [(last, str(node.address))]
