"""Selections: globs to byte ranges, neighbours in one read, and a file of their own."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load

from coordinator.plan.selection import select
from smoltorrent.errors import NotFoundError
from tests.checkpoints import LLM_METADATA, write_llm_like
from tests.coordinator.plan.test_manifest import store_in_memory


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    path = tmp_path_factory.mktemp("selection") / "s.safetensors"
    tensors = write_llm_like(path, layers=3, hidden=32)
    manifest, blobs, _ = store_in_memory(path, shards=3)
    return tensors, manifest, blobs


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assemble(selection, blobs) -> bytes:
    """The output file a partial gather writes, built from the blobs in memory."""
    out = bytearray(selection.size)
    out[: len(selection.prefix)] = selection.prefix
    for read in selection.reads:
        for p in read.pieces:
            out[p.out_offset : p.out_offset + p.length] = blobs[read.shard][
                p.blob_offset : p.blob_offset + p.length
            ]
    return bytes(out)


def test_globs_select_tensors_into_a_valid_file_of_their_own(stored):
    tensors, manifest, blobs = stored
    selection = select(manifest, ["model.layers.1.*", "model.norm.weight"])
    want = {n for n in tensors if n.startswith("model.layers.1.")} | {"model.norm.weight"}
    assert set(selection.names) == want
    back = load(assemble(selection, blobs))
    assert set(back) == want
    for name in want:
        assert bits(back[name]) == bits(tensors[name]), name
    assert selection.data_bytes == sum(tensors[n].numel() * tensors[n].element_size() for n in want)
    header = selection.prefix[8:].decode()
    assert all(f'"{k}":"{v}"' in header for k, v in LLM_METADATA.items())  # metadata kept


def test_neighbours_in_a_shard_come_in_one_read(stored):
    _, manifest, _ = stored
    shard = manifest.shards[1]
    selection = select(manifest, list(shard.tensors[:3]) + [shard.tensors[-1]])
    lengths = [len(r.pieces) for r in selection.reads]
    assert lengths == [3, 1] and {r.shard for r in selection.reads} == {1}
    first = selection.reads[0]
    assert first.length == sum(p.length for p in first.pieces)
    assert all(p.sha256 is not None for r in selection.reads for p in r.pieces)


def test_without_tensor_digests_the_shard_is_read_whole(stored):
    _, manifest, _ = stored
    old = dataclasses.replace(
        manifest, shards=tuple(dataclasses.replace(s, tensor_sha256=None) for s in manifest.shards)
    )
    shard = old.shards[2]
    selection = select(old, [shard.tensors[0], shard.tensors[-1]])
    assert selection.whole_shards == {2} and len(selection.reads) == 1


def test_a_glob_matching_nothing_names_itself(stored):
    _, manifest, _ = stored
    with pytest.raises(NotFoundError, match=r"matches 'model\.layer\.\*'.*smoltorrent show"):
        select(manifest, ["model.norm.weight", "model.layer.*"])


def test_a_tensor_name_selects_itself_even_where_it_reads_as_a_glob(tmp_path):
    """fnmatch reads "w[0]" as "w0": a name holding brackets (or * or ?) selected another
    tensor, or nothing, though it was given exactly. A pattern that is a tensor's name
    selects that tensor; any other is a glob."""
    from safetensors.torch import save_file

    path = tmp_path / "b.safetensors"
    save_file({"w[0]": torch.ones(2), "w0": torch.zeros(2), "x": torch.ones(1)}, str(path))
    manifest, _, _ = store_in_memory(path, shards=1)
    assert set(select(manifest, ["w[0]"]).names) == {"w[0]"}
    assert set(select(manifest, ["w[01]"]).names) == {"w0"}  # not a name: a glob
    assert set(select(manifest, ["w[0]", "x"]).names) == {"w[0]", "x"}
