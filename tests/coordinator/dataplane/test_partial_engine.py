"""Partial gathers without Celery: the selected tensors' byte ranges from real node
processes, verified against the per-tensor digests recorded at store time."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coordinator.dataplane.partial_engine import gather_tensors
from coordinator.dataplane.store_engine import prepare_store, store_checkpoint
from coordinator.plan.safetensors_header import read_header
from coordinator.plan.selection import select
from smoltorrent.errors import GatherError
from tests.checkpoints import write_llm_like
from tests.coordinator.dataplane.test_store_gather import ids_of, sources_for
from tests.nodeproc import NodeProcess, bytes_sent


@pytest.fixture
def nodes(tmp_path):
    """Four nodes that count the bytes they send on /metrics."""
    env = dict(os.environ, SMOLTORRENT_METRICS_PORT="0")
    started = [NodeProcess(tmp_path / f"node{i}", env=env).start() for i in range(4)]
    yield started
    for node in started:
        node.kill()


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_tensor_digests_are_recorded_at_plan_time(tmp_path):
    src = tmp_path / "d.safetensors"
    write_llm_like(src, layers=3, hidden=48)
    header, data = read_header(src), src.read_bytes()
    prepared = prepare_store(src, "d", {"a": 1 << 40, "b": 1 << 40}, replicas=1, shards=3)
    by_name = {t.name: t for t in header.tensors}
    assert prepared.manifest.schema_version == 2
    for shard in prepared.manifest.shards:
        assert shard.tensor_sha256 is not None
        for name, digest in zip(shard.tensors, shard.tensor_sha256, strict=True):
            t = by_name[name]
            raw = data[header.data_start + t.start : header.data_start + t.end]
            assert digest == hashlib.sha256(raw).hexdigest(), name


def test_a_partial_gather_moves_only_the_selected_bytes(nodes, tmp_path):
    src = tmp_path / "p.safetensors"
    tensors = write_llm_like(src, layers=6, hidden=64)
    result = store_checkpoint(src, [n.address for n in nodes], shards=4)
    patterns = ["model.layers.2.*", "lm_head.*"]
    selection = select(result.manifest, patterns)
    out = tmp_path / "part.safetensors"
    sent_before = bytes_sent(nodes)
    report = gather_tensors(result.manifest, selection, sources_for(result, ids_of(nodes)), out)
    sent = bytes_sent(nodes) - sent_before
    back = load_file(out)
    want = {k for k in tensors if k.startswith("model.layers.2.") or k.startswith("lm_head.")}
    assert set(back) == want == set(report.tensors)
    for name in want:
        assert back[name].dtype == tensors[name].dtype and bits(back[name]) == bits(tensors[name])
    data_bytes = sum(tensors[n].numel() * tensors[n].element_size() for n in want)
    assert report.bytes_fetched == selection.data_bytes == data_bytes
    assert sent == data_bytes  # the nodes' own count: not one byte more left them
    assert report.whole_shards == [] and report.bad_copies == []


def test_bad_bytes_under_a_selected_tensor_fall_back_to_the_replica(nodes, tmp_path):
    src = tmp_path / "bad.safetensors"
    tensors = write_llm_like(src, layers=4, hidden=64)
    result = store_checkpoint(src, [n.address for n in nodes], shards=4)
    name = "model.layers.1.mlp.up_proj.weight"
    index = next(i for i, s in enumerate(result.manifest.shards) if name in s.tensors)
    shard = result.manifest.shards[index]
    selection = select(result.manifest, [name])
    (piece,) = selection.reads[0].pieces
    by_id = ids_of(nodes)
    first = by_id[result.holders[index][0]]
    blob = first.data_dir / "blobs" / shard.blob_sha256[:2] / shard.blob_sha256
    data = bytearray(blob.read_bytes())
    data[piece.blob_offset + piece.length // 2] ^= 0x40
    blob.write_bytes(bytes(data))
    out = tmp_path / "one.safetensors"
    report = gather_tensors(result.manifest, selection, sources_for(result, by_id, first), out)
    assert bits(load_file(out)[name]) == bits(tensors[name])
    assert [b.address for b in report.bad_copies] == [str(first.address)]
    assert f"tensor {name}" in report.bad_copies[0].reason
    assert report.bytes_fetched == 2 * piece.length  # the bad range, then the good one


def test_a_manifest_without_tensor_digests_reads_whole_shards(nodes, tmp_path):
    src = tmp_path / "old.safetensors"
    tensors = write_llm_like(src, layers=4, hidden=64)
    result = store_checkpoint(src, [n.address for n in nodes], shards=4)
    # A manifest as schema 1 wrote it: no per-tensor digests.
    old = dataclasses.replace(
        result.manifest,
        schema_version=1,
        shards=tuple(dataclasses.replace(s, tensor_sha256=None) for s in result.manifest.shards),
    )
    names = ["model.layers.0.quant_scale", "model.layers.3.self_attn.q_proj.weight"]
    selection = select(old, names)
    out = tmp_path / "whole.safetensors"
    report = gather_tensors(old, selection, sources_for(result, ids_of(nodes)), out)
    back = load_file(out)
    assert all(bits(back[n]) == bits(tensors[n]) for n in names)
    shards = sorted({i for i, s in enumerate(old.shards) for n in names if n in s.tensors})
    assert report.whole_shards == shards
    assert report.bytes_fetched == sum(old.shards[i].blob_size for i in shards)


def test_no_good_replica_fails_and_leaves_nothing(nodes, tmp_path):
    src = tmp_path / "gone.safetensors"
    write_llm_like(src, layers=2, hidden=32)
    result = store_checkpoint(src, [n.address for n in nodes[:2]], shards=2, replicas=1)
    selection = select(result.manifest, ["model.norm.weight"])
    sources = sources_for(result, ids_of(nodes))
    for node in nodes[:2]:
        node.kill()
    out = tmp_path / "never.safetensors"
    with pytest.raises(GatherError, match="model.norm.weight"):
        gather_tensors(result.manifest, selection, sources, out)
    assert list(Path(tmp_path).glob("never*")) == [] and list(tmp_path.glob(".never*")) == []
